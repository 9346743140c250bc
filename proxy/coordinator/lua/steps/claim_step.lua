-- claim_step: drop too-stale buffered rollouts, then claim the oldest ones for step current+1
-- (or claim the init step 0 from base -1 when no version exists yet).
-- KEYS[1] state  KEYS[2] counters  KEYS[3] requeue  KEYS[4] buffer  KEYS[5] rollout_retention
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] groups_needed  ARGV[4] max_staleness  ARGV[5] record_ttl_s
-- ARGV[6] track: rollouts for retention ("1") or keep them all ("0")
-- ARGV[7] final_version: the run ends there, so no step is claimed from it (checked here, atomically with the
--   claim: a publish may land between the caller's own check and this script)
-- returns {"OK", step:int, base_version:int, rollouts_json:json, claimed:rows, dropped:int}
--   claimed = "version:admitted_ms:groups,..." per claimed rollout
--   | {"NOT_READY", why, dropped:int} | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, needed, max_staleness, ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
if num(KEYS[1], 'step_inflight', -1) >= 0 then return {'NOT_READY', 'a step is in flight', 0} end
local current = num(KEYS[1], 'current_version', -1)
if current < 0 then
  call('HSET', key(STEP, 0), 'step', 0, 'base_version', -1, 'rollouts', '[]', 'claimed_ms', now,
    'sent_ms', 0, 'state', 'claimed', 'groups', 0)
  call('HSET', KEYS[1], 'step_inflight', 0)
  call('HINCRBY', KEYS[2], 'steps_claimed', 1)
  return {'OK', 0, -1, '[]', '', 0}
end
if current >= tonumber(ARGV[7]) then return {'NOT_READY', 'the run reached its final version', 0} end
local dropped = 0
-- Whether a buffered rollout is too stale changes only when the version does (a submission that is too stale is
-- refused, and a failed step puts back rollouts claimed at this version): the buffer is scanned once per version
-- and staleness bound, not at every claim attempt (every round of a full buffer, O(buffer) reads each).
local scan = current .. ':' .. max_staleness
local scanned = redis.call('HGET', KEYS[1], 'stale_scan') == scan
for _, tid in ipairs(scanned and {} or redis.call('LRANGE', KEYS[4], 0, -1)) do
  local rk = key(ROLLOUT, tid)
  if current - num(rk, 'version', 0) > max_staleness then
    call('LREM', KEYS[4], 1, tid)
    local gids = cjson.decode(redis.call('HGET', rk, 'group_ids'))
    for _, gid in ipairs(gids) do end_group(gid, 'stale', now, ttl, KEYS[3]) end
    call('HINCRBY', KEYS[1], 'groups_buffered', -#gids)
    call('HINCRBY', KEYS[2], 'groups_stale', #gids)
    call('HINCRBY', KEYS[2], 'rollouts_stale', 1)
    call('HSET', rk, 'state', 'stale')
    retire(rk, ttl)
    retire(key(TASK, tid), ttl)
    retain_until(KEYS[5], ARGV[6], tid, current)
    dropped = dropped + #gids
  end
end
if not scanned then call('HSET', KEYS[1], 'stale_scan', scan) end
if num(KEYS[1], 'groups_buffered', 0) < needed then return {'NOT_READY', 'too few groups buffered', dropped} end
local step = current + 1
local refs, claimed, total = {}, {}, 0
while total < needed do
  local tid = call('LPOP', KEYS[4])
  if not tid then break end
  local rk = key(ROLLOUT, tid)
  local gids = cjson.decode(redis.call('HGET', rk, 'group_ids'))
  for _, gid in ipairs(gids) do call('HSET', key(GROUP, gid), 'state', 'claimed', 'step', step) end
  refs[#refs + 1] = redis.call('HGET', rk, 'ref')
  local r = redis.call('HMGET', rk, 'version', 'admitted_ms')
  claimed[#claimed + 1] = r[1] .. ':' .. r[2] .. ':' .. #gids
  call('HSET', rk, 'state', 'claimed', 'step', step)
  total = total + #gids
end
local rollouts = '[' .. table.concat(refs, ',') .. ']'
call('HINCRBY', KEYS[1], 'groups_buffered', -total)
call('HSET', key(STEP, step), 'step', step, 'base_version', current, 'rollouts', rollouts, 'claimed_ms', now,
  'sent_ms', 0, 'state', 'claimed', 'groups', total)
call('HSET', KEYS[1], 'step_inflight', step)
call('HINCRBY', KEYS[2], 'steps_claimed', 1)
call('HINCRBY', KEYS[2], 'groups_claimed', total)
return {'OK', step, current, rollouts, table.concat(claimed, ','), dropped}
