-- finish_eval_chunk: keep the summary of an eval task in flight from a worker holding a lease of it, release
-- that lease, and count down its version's chunks. Like a rollout, a result is bound to its lease: a lease of
-- another task, another worker's, or one that expired is refused and changes nothing.
-- KEYS[1] counters  KEYS[2] leases  KEYS[3] evals  KEYS[4] evals_inflight
-- ARGV[1] prefix  ARGV[2] task_id  ARGV[3] lease_id  ARGV[4] summary_json  ARGV[5] worker_id
-- returns {"OK", version:int, chunks_left:int} | {"EVAL_ENDED"} (already done, given up, or unknown)
--   | {"NOT_HOLDER", message}
local tfield = 't:' .. ARGV[2]
local raw = redis.call('HGET', KEYS[3], tfield)
if not raw then return {'EVAL_ENDED'} end
local task = cjson.decode(raw)
local lk = key(LEASE, ARGV[3])
local lease = redis.call('HMGET', lk, 'task_id', 'worker_id', 'version')
if lease[1] ~= ARGV[2] or lease[2] ~= ARGV[5] or tonumber(lease[3]) ~= task.version then
  return {'NOT_HOLDER', 'lease ' .. ARGV[3] .. ' is not a live lease of this task held by this worker'}
end
call('HDEL', KEYS[3], tfield)
call('ZREM', KEYS[4], ARGV[2])
local vfield = 'v:' .. tostring(task.version)
call('HDEL', KEYS[3], tfield)
call('ZREM', KEYS[4], ARGV[2])
local vraw = redis.call('HGET', KEYS[3], vfield)
if not vraw then return {'EVAL_ENDED'} end
local pending = cjson.decode(vraw)
pending.left = pending.left - 1
call('HSET', KEYS[3], vfield, cjson.encode(pending))
call('HSET', KEYS[3], 's:' .. ARGV[2], ARGV[4])
local released = call('ZREM', KEYS[2], ARGV[3])
call('DEL', lk)
call('HINCRBY', KEYS[1], 'leases_released', released)
call('HINCRBY', KEYS[1], 'eval_tasks_done', 1)
return {'OK', tostring(task.version), pending.left}
