-- submit_rollout: admit a generate task's rollout iff current - version <= max_staleness.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] rejected_reasons  KEYS[4] requeue  KEYS[5] tasks_inflight
-- KEYS[6] buffer  KEYS[7] rollout_retention  KEYS[8] prompt_attempts
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] max_staleness  ARGV[4] record_ttl_s  ARGV[5] task_id
-- ARGV[6] worker_id  ARGV[7] version  ARGV[8] ref_json: the rollout ref (as the optimize task will carry it)
-- ARGV[9] admitted_json: group ids  ARGV[10] rejected_json: [[group_id, reason], ...]
-- ARGV[11] omitted_reason: recorded for groups of the task the submission does not mention
-- ARGV[12] track: rollouts for retention ("1") or keep them all ("0")
-- ARGV[13] sha256: of the rollout object  ARGV[14] lease_id: the lease it was made under ("" when not given)
-- ARGV[15] window_version: the version whose staleness is checked, here and at claim (the leased version, or
--   with async.stale_tokens = "mask" the rollout's newest token's); the rollout and its groups are buffered at it
-- a refused late or repeated submission (STALE, CANCELLED, DUPLICATE of a finished rollout) puts its
-- rollout object, possibly written again just now, back under retention; a task that ran to its submission
-- clears the failed-attempt counts of its prompts
-- a submission is bound to its lease: it must come from the task's holder (grant_lease.lua), with a version
-- (and lease, when named) the holder leased for the task; a repeated one must match the admitted rollout
-- returns {"OK", current:int} | {"DUPLICATE", current:int} | {"STALE", current:int} (groups requeued)
--   | {"CANCELLED"} | {"UNKNOWN_TASK"} | {"BAD_ROLLOUT", message} (nothing changed)
--   | {"NOT_HOLDER", message} (not this worker's lease, version or rollout: nothing changed) | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, max_staleness, ttl, tid = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
local track = ARGV[12]
local tk = key(TASK, tid)
local tstate = redis.call('HGET', tk, 'state')
local current = num(KEYS[1], 'current_version', -1)
local worker, version, sha, lease_id = ARGV[6], tonumber(ARGV[7]), ARGV[13], ARGV[14]
local window = tonumber(ARGV[15])
-- why the holder's leases of the task (recorded by grant_lease.lua) do not cover this submission, or nil
local function not_leased()
  local leases = redis.call('HGET', tk, 'leases')
  if not leases then return nil end -- leased by a proxy that did not record leases: the holder is all we know
  local lease_known = false
  for entry in string.gmatch(leases, '%S+') do
    local lid, v = string.match(entry, '^(.+):(%d+)$')
    if lease_id == '' or lid == lease_id then
      if tonumber(v) == version then return nil end
      lease_known = true
    end
  end
  if lease_id ~= '' and not lease_known then
    return 'lease ' .. lease_id .. ' is not a lease of task ' .. tid .. ' by worker ' .. worker
  end
  return 'version v' .. version .. ' was not leased for task ' .. tid .. ' by worker ' .. worker
    .. '; submit the version of the lease the rollout was made under'
end
if not tstate then return {'UNKNOWN_TASK'} end
if tstate == 'admitted' then
  -- a repeat (the worker's retry, or a redelivered task resubmitting its object) must be the admitted rollout
  local rk = key(ROLLOUT, tid)
  local by = redis.call('HGET', tk, 'worker_id') or redis.call('HGET', rk, 'worker_id')
  local admitted_sha = redis.call('HGET', tk, 'sha256')
  if not admitted_sha then
    local ref = redis.call('HGET', rk, 'ref')
    if ref then admitted_sha = cjson.decode(ref)['sha256'] end
  end
  local admitted_version = num(tk, 'version', version)
  if (by and by ~= worker) or (admitted_sha and admitted_sha ~= sha) or admitted_version ~= version then
    return {'NOT_HOLDER', 'task ' .. tid .. ' already has another rollout admitted (another worker, sha256 or '
      .. 'version); this one is not wanted'}
  end
  local why = not_leased()
  if why then return {'NOT_HOLDER', why} end
  call('HINCRBY', KEYS[2], 'rollouts_duplicate', 1)
  local rstate = redis.call('HGET', key(ROLLOUT, tid), 'state')
  if rstate ~= 'buffered' and rstate ~= 'claimed' then retain_until(KEYS[7], track, tid, current) end
  return {'DUPLICATE', current}
end
if tstate == 'stale' then
  retain_until(KEYS[7], track, tid, current)
  return {'STALE', current}
end
if tstate ~= 'inflight' then
  retain_until(KEYS[7], track, tid, current)
  return {'CANCELLED'}
end
if window > current then
  return {'BAD_ROLLOUT', 'rollout version v' .. window .. ' is newer than the current version v' .. current}
end
local holder = redis.call('HGET', tk, 'worker_id')
if not holder then
  return {'NOT_HOLDER', 'task ' .. tid .. ' was never leased, or its holder handed it back (released its lease); '
    .. 'a generate worker leases its task before it submits'}
end
if holder ~= worker then
  return {'NOT_HOLDER', 'task ' .. tid .. ' is leased by another worker, not ' .. worker
    .. ' (it was leased again, e.g. redelivered after this worker was presumed lost): drop this rollout'}
end
local why = not_leased()
if why then return {'NOT_HOLDER', why} end
local task_groups = cjson.decode(redis.call('HGET', tk, 'group_ids'))
local member, fate = {}, {}
for _, gid in ipairs(task_groups) do member[gid] = true end
for _, gid in ipairs(cjson.decode(ARGV[9])) do
  if not member[gid] then return {'BAD_ROLLOUT', 'group ' .. gid .. ' is not part of task ' .. tid} end
  if fate[gid] then return {'BAD_ROLLOUT', 'group ' .. gid .. ' is listed twice'} end
  fate[gid] = true
end
for _, pair in ipairs(cjson.decode(ARGV[10])) do
  local gid = pair[1]
  if not member[gid] then return {'BAD_ROLLOUT', 'group ' .. gid .. ' is not part of task ' .. tid} end
  if fate[gid] then return {'BAD_ROLLOUT', 'group ' .. gid .. ' is listed twice'} end
  fate[gid] = pair[2]
end
local stale = current - window > max_staleness
local admitted, rejected, dropped = {}, 0, 0
for _, gid in ipairs(task_groups) do
  local f = fate[gid] or ARGV[11]
  local idx = redis.call('HGET', key(GROUP, gid), 'prompt_index')
  if idx then call('HDEL', KEYS[8], idx, 'reason:' .. idx) end
  if f == true then
    if stale then
      end_group(gid, 'stale', now, ttl, KEYS[4])
      dropped = dropped + 1
    else
      call('HSET', key(GROUP, gid), 'state', 'buffered', 'version', window, 'admitted_ms', now)
      admitted[#admitted + 1] = gid
    end
  else
    call('HSET', key(GROUP, gid), 'reason', f)
    end_group(gid, 'rejected', now, ttl, nil)
    call('HINCRBY', KEYS[3], f, 1)
    rejected = rejected + 1
  end
end
call('ZREM', KEYS[5], tid)
call('HINCRBY', KEYS[1], 'groups_inflight', -#task_groups)
call('HINCRBY', KEYS[2], 'groups_rejected', rejected)
if stale then
  call('HSET', tk, 'state', 'stale', 'version', version, 'worker_id', ARGV[6], 'ended_ms', now)
  retire(tk, ttl)
  call('HINCRBY', KEYS[2], 'rollouts_stale', 1)
  call('HINCRBY', KEYS[2], 'groups_stale', dropped)
  retain_until(KEYS[7], track, tid, current)
  return {'STALE', current}
end
call('HSET', tk, 'state', 'admitted', 'version', version, 'worker_id', ARGV[6], 'sha256', sha,
  'ended_ms', now)
if #admitted > 0 then
  call('HSET', key(ROLLOUT, tid), 'ref', ARGV[8], 'version', window, 'admitted_ms', now,
    'group_ids', ARGV[9], 'groups', #admitted, 'worker_id', ARGV[6], 'state', 'buffered')
  call('RPUSH', KEYS[6], tid)
  call('HINCRBY', KEYS[1], 'groups_buffered', #admitted)
else
  -- every group rejected: nothing of this rollout will be trained
  retire(tk, ttl)
  retain_until(KEYS[7], track, tid, current)
end
call('HINCRBY', KEYS[2], 'rollouts_admitted', 1)
call('HINCRBY', KEYS[2], 'groups_admitted', #admitted)
return {'OK', current}
