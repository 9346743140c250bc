-- grant_lease: lease the current version to a worker until now + ttl (renewable), for a generate task in flight.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] leases  KEYS[4] versions
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] ttl_ms  ARGV[4] lease_id  ARGV[5] worker_id  ARGV[6] task_id
-- ARGV[7] task_prefix: the form of this run's task ids; an unknown id of that form was forgotten
-- ARGV[8] incarnation: of the worker process ("" when it sent none); a new one of the worker id ends the task
-- returns {"OK", version:int, manifest_sha256, expires_ms:int} | {"NO_VERSION"} | {"TASK_ENDED", task_state}
--   (the task was cancelled, ended or forgotten: its work is not wanted) | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local MAX_TASK_LEASES = 16
local current = num(KEYS[1], 'current_version', -1)
if current < 0 then return {'NO_VERSION'} end
local tk = key(TASK, ARGV[6])
local tstate = redis.call('HGET', tk, 'state')
if tstate and tstate ~= 'inflight' then return {'TASK_ENDED', tstate} end
if not tstate and string.sub(ARGV[6], 1, #ARGV[7]) == ARGV[7] then return {'TASK_ENDED', 'unknown'} end
local expires = tonumber(ARGV[2]) + tonumber(ARGV[3])
local lk = key(LEASE, ARGV[4])
call('HSET', lk, 'version', current, 'worker_id', ARGV[5], 'task_id', ARGV[6], 'expires_ms', expires,
  'granted_ms', ARGV[2], 'incarnation', ARGV[8])
redis.call('PEXPIRE', lk, ARGV[3])
call('ZADD', KEYS[3], expires, ARGV[4])
call('HINCRBY', KEYS[2], 'leases_granted', 1)
-- the task's holder: proxy.coordinator.generate_tasks cancels it when the holder's heartbeats stop. Its
-- leases ("<lease_id>:<version> ...", the holder's only: a new holder starts the list again) bind the
-- submission (submit_rollout.lua): a renewal keeps its version, a second lease by the holder adds one.
if tstate then
  local held = ''
  if redis.call('HGET', tk, 'worker_id') == ARGV[5] then held = redis.call('HGET', tk, 'leases') or '' end
  local entries = {}
  for entry in string.gmatch(held, '%S+') do entries[#entries + 1] = entry end
  -- bounded: only a worker that keeps leasing one task without submitting gets this far
  while #entries >= MAX_TASK_LEASES do table.remove(entries, 1) end
  entries[#entries + 1] = ARGV[4] .. ':' .. current
  call('HSET', tk, 'worker_id', ARGV[5], 'leased_ms', ARGV[2], 'leased_version', current,
    'leases', table.concat(entries, ' '), 'incarnation', ARGV[8])
end
return {'OK', current, redis.call('HGET', KEYS[4], current), expires}
