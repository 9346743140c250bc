-- read_snapshot: read, atomically, everything a rebuild needs (no writes).
-- KEYS[1] state  KEYS[2] counters  KEYS[3] rejected_reasons  KEYS[4] versions  KEYS[5] requeue  KEYS[6] buffer
-- KEYS[7] tasks_inflight  KEYS[8] leases  KEYS[9] rollout_retention
-- ARGV[1] prefix
-- returns {"OK", state, counters, reasons, versions, requeue, buffer, tasks, step, leases, retention}
--   | {"NO_STATE"}
--   where hashes are flat [field, value, ...]; buffer = [[task_id, rollout, [[group_id, group], ...]], ...];
--   tasks = [[task_id, task, groups], ...]; step = [] or [step, groups]; leases = [[lease_id, lease], ...];
--   retention = flat [task_id, version, ...]
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
