-- grant_lease: lease the current version to a worker until now + ttl (renewable), for a generate task in flight.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] leases  KEYS[4] versions
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] ttl_ms  ARGV[4] lease_id  ARGV[5] worker_id  ARGV[6] task_id
-- ARGV[7] task_prefix: the form of this run's task ids; an unknown id of that form was forgotten
-- returns {"OK", version, manifest_sha256, expires_ms} | {"NO_VERSION"} | {"TASK_ENDED", task_state}
--   (the task was cancelled, ended or forgotten: its work is not wanted) | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local current = num(KEYS[1], 'current_version', -1)
if current < 0 then return {'NO_VERSION'} end
local tk = key(TASK, ARGV[6])
local tstate = redis.call('HGET', tk, 'state')
if tstate and tstate ~= 'inflight' then return {'TASK_ENDED', tstate} end
if not tstate and string.sub(ARGV[6], 1, #ARGV[7]) == ARGV[7] then return {'TASK_ENDED', 'unknown'} end
local expires = tonumber(ARGV[2]) + tonumber(ARGV[3])
local lk = key(LEASE, ARGV[4])
redis.call('HSET', lk, 'version', current, 'worker_id', ARGV[5], 'task_id', ARGV[6], 'expires_ms', expires,
  'granted_ms', ARGV[2])
redis.call('PEXPIRE', lk, ARGV[3])
redis.call('ZADD', KEYS[3], expires, ARGV[4])
redis.call('HINCRBY', KEYS[2], 'leases_granted', 1)
-- the task's holder: proxy.coordinator.generate_tasks cancels it when the holder's heartbeats stop
if tstate then redis.call('HSET', tk, 'worker_id', ARGV[5], 'leased_ms', ARGV[2]) end
return {'OK', current, redis.call('HGET', KEYS[4], current), expires}
