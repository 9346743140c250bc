"""The coordinator's Lua scripts: every change to a run's Redis state is one of these, so it is atomic.

Each script starts with lines stating its KEYS, ARGV and return codes. A script returns a table whose first
element is a code string; ``proxy.coordinator.service`` maps each code other than ``OK`` to its own exception.
Time is always passed in (``now_ms``) so that tests control the clock; leases also get a real ``PEXPIRE``
as a backstop. Item keys (one per group, task, rollout, step, lease, worker) are built inside the scripts
as ``prefix .. kind .. ':' .. id`` with the kinds of ``proxy.coordinator.redis_keys`` substituted in below.

Group states: ``inflight`` (in a generate task) -> ``buffered`` (admitted) -> ``claimed`` (in a step) ->
``trained``; or one of the other terminal states ``stale`` (requeued as a new group), ``rejected``
(bad input, with a reason) or ``cancelled`` (its task was lost; requeued). Terminal records expire after
``record_ttl_s`` so that Redis does not grow with the length of the run.

Rollout retention: when a rollout can never be trained (again) -- its step was published, or it was dropped as
stale, rejected, or its task was cancelled -- its task id goes into the ``rollout_retention`` sorted set,
scored with the version after which its bucket object may go (the version its step produced, else the
current one). Scripts that do so take a ``track`` argument: "0" (``async.rollout_retention_versions = -1``)
keeps every rollout and records nothing. DUE_ROLLOUTS and FORGET_ROLLOUTS serve the proxy's collection.
"""

from __future__ import annotations

from proxy.coordinator.redis_keys import GROUP_KIND, LEASE_KIND, ROLLOUT_KIND, STEP_KIND, TASK_KIND, WORKER_KIND

_HELPERS = f"""
local PREFIX = ARGV[1]
local function key(kind, id) return PREFIX .. kind .. ':' .. id end
local GROUP, TASK, ROLLOUT, STEP, LEASE, WORKER =
  '{GROUP_KIND}', '{TASK_KIND}', '{ROLLOUT_KIND}', '{STEP_KIND}', '{LEASE_KIND}', '{WORKER_KIND}'
local function num(k, field, default)
  local v = redis.call('HGET', k, field)
  if v then return tonumber(v) end
  return default
end
local function retire(k, ttl) redis.call('EXPIRE', k, ttl) end
-- the rollout of task tid will never be trained (again): its object may go once `version` is old enough
local function retain_until(zkey, track, tid, version)
  if track == '1' then redis.call('ZADD', zkey, version, tid) end
end
-- a group leaves the line for good with this fate; stale and cancelled ones put their prompt back in line
local function end_group(gid, fate, now, ttl, requeue_key)
  local gk = key(GROUP, gid)
  redis.call('HSET', gk, 'state', fate, 'ended_ms', now)
  if requeue_key then redis.call('RPUSH', requeue_key, redis.call('HGET', gk, 'prompt_index')) end
  retire(gk, ttl)
end
"""

DISPATCH_GENERATE = (
    """-- dispatch_generate: create one generate task; requeued prompts first, then the epoch permutation.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] requeue  KEYS[4] tasks_inflight
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] deadline_ms  ARGV[4] groups_per_task  ARGV[5] queue_maxsize
-- ARGV[6] expected epoch  ARGV[7] expected epoch_pos  ARGV[8] num_prompts  ARGV[9] run
-- ARGV[10..] groups_per_task candidate prompt indices of the permutation from (epoch, epoch_pos) on
-- returns {"OK", task_id, groups_json} | {"NO_ROOM"} (buffer full) | {"RETRY"} (epoch_pos moved)
--   | {"NO_STATE"}"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, k, n = ARGV[2], tonumber(ARGV[4]), tonumber(ARGV[8])
if #ARGV - 9 < k then return redis.error_reply('dispatch_generate: fewer candidates than groups_per_task') end
local inflight, buffered = num(KEYS[1], 'groups_inflight', 0), num(KEYS[1], 'groups_buffered', 0)
if inflight + buffered + k > tonumber(ARGV[5]) then return {'NO_ROOM'} end
local epoch, pos = num(KEYS[1], 'epoch', 0), num(KEYS[1], 'epoch_pos', 0)
if epoch ~= tonumber(ARGV[6]) or pos ~= tonumber(ARGV[7]) then return {'RETRY'} end
local seq = redis.call('HINCRBY', KEYS[1], 'task_seq', 1)
local task_id = 'gen-' .. ARGV[9] .. '-' .. num(KEYS[1], 'incarnation', 0) .. '-' .. string.format('%08d', seq)
local indices, from_requeue, used = {}, 0, 0
while #indices < k do
  local idx = redis.call('LPOP', KEYS[3])
  if not idx then break end
  indices[#indices + 1] = idx
  from_requeue = from_requeue + 1
end
while #indices < k do
  used = used + 1
  indices[#indices + 1] = ARGV[9 + used]
end
pos = pos + used
while pos >= n do pos = pos - n; epoch = epoch + 1 end
local gids, parts = {}, {}
for i, idx in ipairs(indices) do
  local gid = task_id .. '.' .. (i - 1)
  gids[i] = gid
  redis.call('HSET', key(GROUP, gid), 'prompt_index', idx, 'state', 'inflight', 'task_id', task_id,
    'dispatched_ms', now)
  parts[i] = '{"group_id":"' .. gid .. '","prompt_index":' .. idx .. '}'
end
redis.call('HSET', key(TASK, task_id), 'state', 'inflight', 'group_ids', '["' .. table.concat(gids, '","') .. '"]',
  'dispatched_ms', now, 'deadline_ms', ARGV[3])
redis.call('ZADD', KEYS[4], ARGV[3], task_id)
redis.call('HINCRBY', KEYS[1], 'groups_inflight', k)
redis.call('HSET', KEYS[1], 'epoch', epoch, 'epoch_pos', pos)
redis.call('HINCRBY', KEYS[2], 'tasks_dispatched', 1)
redis.call('HINCRBY', KEYS[2], 'groups_dispatched', k)
redis.call('HINCRBY', KEYS[2], 'groups_requeue_served', from_requeue)
return {'OK', task_id, '[' .. table.concat(parts, ',') .. ']'}
"""
)

CANCEL_TASKS = (
    """-- cancel_tasks: generate tasks presumed lost; their groups are cancelled and their prompts requeued.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] requeue  KEYS[4] tasks_inflight  KEYS[5] rollout_retention
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] record_ttl_s  ARGV[4] force ("1": even before the deadline)
-- ARGV[5] track rollouts for retention ("1") or keep them all ("0")
-- ARGV[6..] task ids (only tasks still in flight, and past their deadline unless forced, are cancelled)
-- returns {"OK", tasks_cancelled, groups_requeued} | {"NO_STATE"}"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, ttl, force, track = tonumber(ARGV[2]), ARGV[3], ARGV[4] == '1', ARGV[5]
local current = num(KEYS[1], 'current_version', -1)
local tasks, groups = 0, 0
for i = 6, #ARGV do
  local tid = ARGV[i]
  local tk = key(TASK, tid)
  if redis.call('HGET', tk, 'state') == 'inflight' and (force or num(tk, 'deadline_ms', 0) <= now) then
    for _, gid in ipairs(cjson.decode(redis.call('HGET', tk, 'group_ids'))) do
      if redis.call('HGET', key(GROUP, gid), 'state') == 'inflight' then
        end_group(gid, 'cancelled', now, ttl, KEYS[3])
        groups = groups + 1
        redis.call('HINCRBY', KEYS[1], 'groups_inflight', -1)
      end
    end
    redis.call('HSET', tk, 'state', 'cancelled', 'ended_ms', now)
    retire(tk, ttl)
    redis.call('ZREM', KEYS[4], tid)
    -- the worker may have written its rollout before it was lost
    retain_until(KEYS[5], track, tid, current)
    tasks = tasks + 1
  end
end
redis.call('HINCRBY', KEYS[2], 'tasks_cancelled', tasks)
redis.call('HINCRBY', KEYS[2], 'groups_cancelled', groups)
return {'OK', tasks, groups}
"""
)

SUBMIT_ROLLOUT = (
    """-- submit_rollout: admit a generate task's rollout iff current - version <= max_staleness.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] rejected_reasons  KEYS[4] requeue  KEYS[5] tasks_inflight
-- KEYS[6] buffer  KEYS[7] rollout_retention
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] max_staleness  ARGV[4] record_ttl_s  ARGV[5] task_id
-- ARGV[6] worker_id  ARGV[7] version  ARGV[8] rollout ref json (as the optimize task will carry it)
-- ARGV[9] admitted group ids json  ARGV[10] rejected json [[group_id, reason], ...]
-- ARGV[11] reason recorded for groups of the task the submission does not mention
-- ARGV[12] track rollouts for retention ("1") or keep them all ("0")
-- a refused late or repeated submission (STALE, CANCELLED, DUPLICATE of a finished rollout) puts its
-- rollout object, possibly written again just now, back under retention
-- returns {"OK", current} | {"DUPLICATE", current} | {"STALE", current} (groups requeued)
--   | {"CANCELLED"} | {"UNKNOWN_TASK"} | {"BAD_ROLLOUT", message} (nothing changed) | {"NO_STATE"}"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, max_staleness, ttl, tid = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4], ARGV[5]
local track = ARGV[12]
local tk = key(TASK, tid)
local tstate = redis.call('HGET', tk, 'state')
local current = num(KEYS[1], 'current_version', -1)
if not tstate then return {'UNKNOWN_TASK'} end
if tstate == 'admitted' then
  redis.call('HINCRBY', KEYS[2], 'rollouts_duplicate', 1)
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
local version = tonumber(ARGV[7])
if version > current then
  return {'BAD_ROLLOUT', 'rollout version v' .. version .. ' is newer than the current version v' .. current}
end
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
local stale = current - version > max_staleness
local admitted, rejected, dropped = {}, 0, 0
for _, gid in ipairs(task_groups) do
  local f = fate[gid] or ARGV[11]
  if f == true then
    if stale then
      end_group(gid, 'stale', now, ttl, KEYS[4])
      dropped = dropped + 1
    else
      redis.call('HSET', key(GROUP, gid), 'state', 'buffered', 'version', version, 'admitted_ms', now)
      admitted[#admitted + 1] = gid
    end
  else
    redis.call('HSET', key(GROUP, gid), 'reason', f)
    end_group(gid, 'rejected', now, ttl, nil)
    redis.call('HINCRBY', KEYS[3], f, 1)
    rejected = rejected + 1
  end
end
redis.call('ZREM', KEYS[5], tid)
redis.call('HINCRBY', KEYS[1], 'groups_inflight', -#task_groups)
redis.call('HINCRBY', KEYS[2], 'groups_rejected', rejected)
if stale then
  redis.call('HSET', tk, 'state', 'stale', 'version', version, 'worker_id', ARGV[6], 'ended_ms', now)
  retire(tk, ttl)
  redis.call('HINCRBY', KEYS[2], 'rollouts_stale', 1)
  redis.call('HINCRBY', KEYS[2], 'groups_stale', dropped)
  retain_until(KEYS[7], track, tid, current)
  return {'STALE', current}
end
redis.call('HSET', tk, 'state', 'admitted', 'version', version, 'worker_id', ARGV[6], 'ended_ms', now)
if #admitted > 0 then
  redis.call('HSET', key(ROLLOUT, tid), 'ref', ARGV[8], 'version', version, 'admitted_ms', now,
    'group_ids', ARGV[9], 'groups', #admitted, 'worker_id', ARGV[6], 'state', 'buffered')
  redis.call('RPUSH', KEYS[6], tid)
  redis.call('HINCRBY', KEYS[1], 'groups_buffered', #admitted)
else
  -- every group rejected: nothing of this rollout will be trained
  retire(tk, ttl)
  retain_until(KEYS[7], track, tid, current)
end
redis.call('HINCRBY', KEYS[2], 'rollouts_admitted', 1)
redis.call('HINCRBY', KEYS[2], 'groups_admitted', #admitted)
return {'OK', current}
"""
)

CLAIM_STEP = (
    """-- claim_step: drop too-stale buffered rollouts, then claim the oldest ones for step current+1
-- (or claim the init step 0 from base -1 when no version exists yet).
-- KEYS[1] state  KEYS[2] counters  KEYS[3] requeue  KEYS[4] buffer  KEYS[5] rollout_retention
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] groups_needed  ARGV[4] max_staleness  ARGV[5] record_ttl_s
-- ARGV[6] track rollouts for retention ("1") or keep them all ("0")
-- returns {"OK", step, base_version, rollouts_json, claimed "version:admitted_ms:groups,...", dropped}
--   | {"NOT_READY", why, dropped} | {"NO_STATE"}"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, needed, max_staleness, ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
if num(KEYS[1], 'step_inflight', -1) >= 0 then return {'NOT_READY', 'a step is in flight', 0} end
local current = num(KEYS[1], 'current_version', -1)
if current < 0 then
  redis.call('HSET', key(STEP, 0), 'step', 0, 'base_version', -1, 'rollouts', '[]', 'claimed_ms', now,
    'sent_ms', 0, 'state', 'claimed', 'groups', 0)
  redis.call('HSET', KEYS[1], 'step_inflight', 0)
  redis.call('HINCRBY', KEYS[2], 'steps_claimed', 1)
  return {'OK', 0, -1, '[]', '', 0}
end
local dropped = 0
for _, tid in ipairs(redis.call('LRANGE', KEYS[4], 0, -1)) do
  local rk = key(ROLLOUT, tid)
  if current - num(rk, 'version', 0) > max_staleness then
    redis.call('LREM', KEYS[4], 1, tid)
    local gids = cjson.decode(redis.call('HGET', rk, 'group_ids'))
    for _, gid in ipairs(gids) do end_group(gid, 'stale', now, ttl, KEYS[3]) end
    redis.call('HINCRBY', KEYS[1], 'groups_buffered', -#gids)
    redis.call('HINCRBY', KEYS[2], 'groups_stale', #gids)
    redis.call('HINCRBY', KEYS[2], 'rollouts_stale', 1)
    redis.call('HSET', rk, 'state', 'stale')
    retire(rk, ttl)
    retire(key(TASK, tid), ttl)
    retain_until(KEYS[5], ARGV[6], tid, current)
    dropped = dropped + #gids
  end
end
if num(KEYS[1], 'groups_buffered', 0) < needed then return {'NOT_READY', 'too few groups buffered', dropped} end
local step = current + 1
local refs, claimed, total = {}, {}, 0
while total < needed do
  local tid = redis.call('LPOP', KEYS[4])
  if not tid then break end
  local rk = key(ROLLOUT, tid)
  local gids = cjson.decode(redis.call('HGET', rk, 'group_ids'))
  for _, gid in ipairs(gids) do redis.call('HSET', key(GROUP, gid), 'state', 'claimed', 'step', step) end
  refs[#refs + 1] = redis.call('HGET', rk, 'ref')
  local r = redis.call('HMGET', rk, 'version', 'admitted_ms')
  claimed[#claimed + 1] = r[1] .. ':' .. r[2] .. ':' .. #gids
  redis.call('HSET', rk, 'state', 'claimed', 'step', step)
  total = total + #gids
end
local rollouts = '[' .. table.concat(refs, ',') .. ']'
redis.call('HINCRBY', KEYS[1], 'groups_buffered', -total)
redis.call('HSET', key(STEP, step), 'step', step, 'base_version', current, 'rollouts', rollouts, 'claimed_ms', now,
  'sent_ms', 0, 'state', 'claimed', 'groups', total)
redis.call('HSET', KEYS[1], 'step_inflight', step)
redis.call('HINCRBY', KEYS[2], 'steps_claimed', 1)
redis.call('HINCRBY', KEYS[2], 'groups_claimed', total)
return {'OK', step, current, rollouts, table.concat(claimed, ','), dropped}
"""
)

MARK_STEP_SENT = (
    """-- mark_step_sent: the optimize task of a claimed step was handed to the broker.
-- KEYS[1] state  KEYS[2] counters
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] step  ARGV[4] resend ("1": a re-send after a timeout)
-- returns {"OK"} | {"NOT_CLAIMED"} (published or unknown meanwhile) | {"NO_STATE"}"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local sk = key(STEP, ARGV[3])
if redis.call('HGET', sk, 'state') ~= 'claimed' then return {'NOT_CLAIMED'} end
redis.call('HSET', sk, 'sent_ms', ARGV[2])
redis.call('HINCRBY', sk, 'sends', 1)
if ARGV[4] == '1' then redis.call('HINCRBY', KEYS[2], 'optimize_resent', 1) end
return {'OK'}
"""
)

PUBLISH_VERSION = (
    """-- publish_version: compare-and-set current == base_version -> version (the fencing token).
-- KEYS[1] state  KEYS[2] counters  KEYS[3] versions  KEYS[4] rollout_retention
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] version  ARGV[4] base_version  ARGV[5] step  ARGV[6] manifest_sha256
-- ARGV[7] worker_id  ARGV[8] record_ttl_s  ARGV[9] track rollouts for retention ("1") or keep them all ("0")
-- returns {"OK", current} | {"ALREADY", current} (this worker already published this very manifest: a retry)
--   | {"BAD_VERSION", current} | {"CAS_LOST", current} | {"STEP_NOT_CLAIMED", current} | {"NO_STATE"}"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, version, base, step, ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[8]
local current = num(KEYS[1], 'current_version', -1)
local sk = key(STEP, step)
if redis.call('HGET', KEYS[3], ARGV[3]) == ARGV[6] and redis.call('HGET', sk, 'worker_id') == ARGV[7] then
  return {'ALREADY', current}
end
local code = nil
if version ~= base + 1 or step ~= version then code = 'BAD_VERSION'
elseif current ~= base then code = 'CAS_LOST'
elseif redis.call('HGET', sk, 'state') ~= 'claimed' or num(sk, 'base_version', -2) ~= base then
  code = 'STEP_NOT_CLAIMED'
end
if code then
  redis.call('HINCRBY', KEYS[2], 'conflicts', 1)
  return {code, current}
end
redis.call('HSET', KEYS[1], 'current_version', version, 'step_inflight', -1, 'last_publish_ms', now)
redis.call('HSET', KEYS[3], version, ARGV[6])
redis.call('HSET', sk, 'state', 'published', 'published_ms', now, 'worker_id', ARGV[7])
retire(sk, ttl)
local trained = 0
for _, ref in ipairs(cjson.decode(redis.call('HGET', sk, 'rollouts'))) do
  for _, gid in ipairs(ref['group_ids']) do
    end_group(gid, 'trained', now, ttl, nil)
    trained = trained + 1
  end
  redis.call('HSET', key(ROLLOUT, ref['task_id']), 'state', 'trained')
  retire(key(ROLLOUT, ref['task_id']), ttl)
  retire(key(TASK, ref['task_id']), ttl)
  retain_until(KEYS[4], ARGV[9], ref['task_id'], version)
end
redis.call('HINCRBY', KEYS[2], 'publish', 1)
redis.call('HINCRBY', KEYS[2], 'groups_trained', trained)
return {'OK', version}
"""
)

GRANT_LEASE = (
    """-- grant_lease: lease the current version to a worker until now + ttl (renewable).
-- KEYS[1] state  KEYS[2] counters  KEYS[3] leases  KEYS[4] versions
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] ttl_ms  ARGV[4] lease_id  ARGV[5] worker_id  ARGV[6] task_id
-- returns {"OK", version, manifest_sha256, expires_ms} | {"NO_VERSION"} | {"NO_STATE"}"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local current = num(KEYS[1], 'current_version', -1)
if current < 0 then return {'NO_VERSION'} end
local expires = tonumber(ARGV[2]) + tonumber(ARGV[3])
local lk = key(LEASE, ARGV[4])
redis.call('HSET', lk, 'version', current, 'worker_id', ARGV[5], 'task_id', ARGV[6], 'expires_ms', expires,
  'granted_ms', ARGV[2])
redis.call('PEXPIRE', lk, ARGV[3])
redis.call('ZADD', KEYS[3], expires, ARGV[4])
redis.call('HINCRBY', KEYS[2], 'leases_granted', 1)
return {'OK', current, redis.call('HGET', KEYS[4], current), expires}
"""
)

RENEW_LEASE = (
    """-- renew_lease: push a live lease's expiry to now + ttl.
-- KEYS[1] state  KEYS[2] leases  KEYS[3] versions
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] ttl_ms  ARGV[4] lease_id
-- returns {"OK", version, manifest_sha256, expires_ms} | {"LEASE_LOST"} (expired or unknown) | {"NO_STATE"}"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local lk = key(LEASE, ARGV[4])
local now = tonumber(ARGV[2])
if num(lk, 'expires_ms', 0) <= now then return {'LEASE_LOST'} end
local expires = now + tonumber(ARGV[3])
redis.call('HSET', lk, 'expires_ms', expires)
redis.call('PEXPIRE', lk, ARGV[3])
redis.call('ZADD', KEYS[2], expires, ARGV[4])
local version = redis.call('HGET', lk, 'version')
return {'OK', version, redis.call('HGET', KEYS[3], version), expires}
"""
)

RELEASE_LEASE = (
    """-- release_lease: drop a lease (idempotent).
-- KEYS[1] counters  KEYS[2] leases
-- ARGV[1] prefix  ARGV[2] lease_id
-- returns {"OK", released (1) or already gone (0)}"""
    + _HELPERS
    + """
local released = redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('DEL', key(LEASE, ARGV[2]))
redis.call('HINCRBY', KEYS[1], 'leases_released', released)
return {'OK', released}
"""
)

EXPIRE_LEASES = (
    """-- expire_leases: forget every lease whose expiry is at or before now, counting them.
-- KEYS[1] counters  KEYS[2] leases
-- ARGV[1] prefix  ARGV[2] now_ms
-- returns {"OK", expired}"""
    + _HELPERS
    + """
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
for _, id in ipairs(ids) do
  redis.call('DEL', key(LEASE, id))
  redis.call('ZREM', KEYS[2], id)
end
redis.call('HINCRBY', KEYS[1], 'leases_expired', #ids)
return {'OK', #ids}
"""
)

RECORD_HEARTBEAT = (
    """-- record_heartbeat: remember a worker's last report; forget workers silent for a long time.
-- KEYS[1] workers
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] worker_id  ARGV[4] report json  ARGV[5] forget_after_ms
-- ARGV[6] record_ttl_s
-- returns {"OK", forgotten}"""
    + _HELPERS
    + """
local wk = key(WORKER, ARGV[3])
redis.call('HSET', wk, 'report', ARGV[4], 'last_seen_ms', ARGV[2])
retire(wk, ARGV[6])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
local forgotten = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[5]))
return {'OK', forgotten}
"""
)

ADD_COUNTER = (
    """-- add_counter: count an event decided outside Redis (e.g. a publish refused for its manifest).
-- KEYS[1] state  KEYS[2] counters
-- ARGV[1] prefix  ARGV[2] counter name  ARGV[3] amount
-- returns {"OK", new value} | {"NO_STATE"}"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
return {'OK', redis.call('HINCRBY', KEYS[2], ARGV[2], ARGV[3])}
"""
)

RESTORE_STATE = (
    """-- restore_state: write a whole run state (fresh or rebuilt from the bucket) iff the run has none.
-- KEYS[1] state
-- ARGV[1] prefix  ARGV[2] ops json: [[command, key, args...], ...] with command in HSET, RPUSH, ZADD,
--   PEXPIRE, EXPIRE and every key under the prefix; the ops must write KEYS[1]
-- returns {"OK", ops applied} | {"EXISTS"} (a state is already there; nothing written)"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'EXISTS'} end
local allowed = {HSET = true, RPUSH = true, ZADD = true, PEXPIRE = true, EXPIRE = true}
local ops = cjson.decode(ARGV[2])
for i, op in ipairs(ops) do
  if not allowed[op[1]] then return redis.error_reply('restore_state: op ' .. i .. ' uses ' .. tostring(op[1])) end
  if string.sub(op[2], 1, #PREFIX) ~= PREFIX then
    return redis.error_reply('restore_state: op ' .. i .. ' writes ' .. op[2] .. ' outside the run')
  end
end
for _, op in ipairs(ops) do redis.call(unpack(op)) end
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('restore_state: the ops wrote no state') end
return {'OK', #ops}
"""
)

READ_SNAPSHOT = (
    """-- read_snapshot: read, atomically, everything a rebuild needs (no writes).
-- KEYS[1] state  KEYS[2] counters  KEYS[3] rejected_reasons  KEYS[4] versions  KEYS[5] requeue  KEYS[6] buffer
-- KEYS[7] tasks_inflight  KEYS[8] leases  KEYS[9] rollout_retention
-- ARGV[1] prefix
-- returns {"OK", state, counters, reasons, versions, requeue, buffer, tasks, step, leases, retention}
--   | {"NO_STATE"}
--   where hashes are flat [field, value, ...]; buffer = [[task_id, rollout, [[group_id, group], ...]], ...];
--   tasks = [[task_id, task, groups], ...]; step = [] or [step, groups]; leases = [[lease_id, lease], ...];
--   retention = flat [task_id, version, ...]"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local function groups_of(ids_json)
  local out = {}
  for _, gid in ipairs(cjson.decode(ids_json)) do out[#out + 1] = {gid, redis.call('HGETALL', key(GROUP, gid))} end
  return out
end
local buffer = {}
for _, tid in ipairs(redis.call('LRANGE', KEYS[6], 0, -1)) do
  local rk = key(ROLLOUT, tid)
  buffer[#buffer + 1] = {tid, redis.call('HGETALL', rk), groups_of(redis.call('HGET', rk, 'group_ids'))}
end
local tasks = {}
for _, tid in ipairs(redis.call('ZRANGE', KEYS[7], 0, -1)) do
  local tk = key(TASK, tid)
  tasks[#tasks + 1] = {tid, redis.call('HGETALL', tk), groups_of(redis.call('HGET', tk, 'group_ids'))}
end
local step = {}
local inflight = num(KEYS[1], 'step_inflight', -1)
if inflight >= 0 then
  local sk = key(STEP, inflight)
  local ids = {}
  for _, ref in ipairs(cjson.decode(redis.call('HGET', sk, 'rollouts'))) do
    for _, gid in ipairs(ref['group_ids']) do ids[#ids + 1] = {gid, redis.call('HGETALL', key(GROUP, gid))} end
  end
  step = {redis.call('HGETALL', sk), ids}
end
local leases = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[8], 0, -1)) do
  leases[#leases + 1] = {id, redis.call('HGETALL', key(LEASE, id))}
end
return {'OK', redis.call('HGETALL', KEYS[1]), redis.call('HGETALL', KEYS[2]), redis.call('HGETALL', KEYS[3]),
  redis.call('HGETALL', KEYS[4]), redis.call('LRANGE', KEYS[5], 0, -1), buffer, tasks, step, leases,
  redis.call('ZRANGE', KEYS[9], 0, -1, 'WITHSCORES')}
"""
)

DUE_ROLLOUTS = (
    """-- due_rollouts: rollouts whose retention is over (score <= max_version), minus any still needed.
-- KEYS[1] state  KEYS[2] rollout_retention
-- ARGV[1] prefix  ARGV[2] max_version (current - async.rollout_retention_versions)  ARGV[3] at most this many
-- returns {"OK", due task ids, protected task ids} | {"NO_STATE"}
--   protected: buffered, claimed or in the step in flight; they leave the queue and are never deleted
--   (a publish puts them back once trained). A correct run has none."""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local in_step = {}
local inflight = num(KEYS[1], 'step_inflight', -1)
if inflight >= 0 then
  local refs = redis.call('HGET', key(STEP, inflight), 'rollouts')
  if refs then
    for _, ref in ipairs(cjson.decode(refs)) do in_step[ref['task_id']] = true end
  end
end
local due, protected = {}, {}
for _, tid in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[2], 'LIMIT', 0, ARGV[3])) do
  local rstate = redis.call('HGET', key(ROLLOUT, tid), 'state')
  if in_step[tid] or rstate == 'buffered' or rstate == 'claimed' then
    redis.call('ZREM', KEYS[2], tid)
    protected[#protected + 1] = tid
  else
    due[#due + 1] = tid
  end
end
return {'OK', due, protected}
"""
)

FORGET_ROLLOUTS = (
    """-- forget_rollouts: drop deleted rollouts from the retention queue and count them.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] rollout_retention
-- ARGV[1] prefix  ARGV[2] max_version the deletion was decided under  ARGV[3..] task ids whose objects are gone
-- returns {"OK", forgotten} | {"NO_STATE"}
--   an entry re-scored above max_version meanwhile (its object was written again) stays queued"""
    + _HELPERS
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local max_version, forgotten = tonumber(ARGV[2]), 0
for i = 3, #ARGV do
  local score = redis.call('ZSCORE', KEYS[3], ARGV[i])
  if score and tonumber(score) <= max_version then
    redis.call('ZREM', KEYS[3], ARGV[i])
    forgotten = forgotten + 1
  end
end
redis.call('HINCRBY', KEYS[2], 'rollouts_deleted', forgotten)
return {'OK', forgotten}
"""
)
