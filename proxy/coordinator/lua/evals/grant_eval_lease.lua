-- grant_eval_lease: lease the version of an eval task in flight to a worker until now + ttl (renewable and
-- released like any lease), and record the worker as the task's holder until its new deadline.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] leases  KEYS[4] versions  KEYS[5] evals  KEYS[6] evals_inflight
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] ttl_ms  ARGV[4] lease_id  ARGV[5] worker_id  ARGV[6] task_id
-- ARGV[7] deadline_ms  ARGV[8] incarnation: of the worker process ("" when it sent none)
-- returns {"OK", version:int, manifest_sha256, expires_ms:int, prompt_start:int, prompt_count:int}
--   | {"EVAL_ENDED"} (its version is evaluated or given up, or the task is unknown) | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local tfield = 't:' .. ARGV[6]
local raw = redis.call('HGET', KEYS[5], tfield)
if not raw then return {'EVAL_ENDED'} end
local task = cjson.decode(raw)
local version = tostring(task.version)
local expires = tonumber(ARGV[2]) + tonumber(ARGV[3])
local lk = key(LEASE, ARGV[4])
call('HSET', lk, 'version', version, 'worker_id', ARGV[5], 'task_id', ARGV[6], 'expires_ms', expires,
  'granted_ms', ARGV[2], 'incarnation', ARGV[8])
redis.call('PEXPIRE', lk, ARGV[3])
call('ZADD', KEYS[3], expires, ARGV[4])
call('HINCRBY', KEYS[2], 'leases_granted', 1)
task.worker = ARGV[5]
task.incarnation = ARGV[8]
call('HSET', KEYS[5], tfield, cjson.encode(task))
call('ZADD', KEYS[6], ARGV[7], ARGV[6])
return {'OK', version, redis.call('HGET', KEYS[4], version), expires, task.start, task.count}
