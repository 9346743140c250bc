-- finish_eval_chunk: keep the summary of an evaluate task in flight (from whichever worker ran it), release
-- the lease it names, and count down its version's chunks.
-- KEYS[1] counters  KEYS[2] leases  KEYS[3] evals  KEYS[4] evals_inflight
-- ARGV[1] prefix  ARGV[2] task_id  ARGV[3] lease_id ('' for none)  ARGV[4] summary_json
-- returns {"OK", version, chunks_left} | {"EVAL_ENDED"} (already done, given up, or unknown)
local tfield = 't:' .. ARGV[2]
local raw = redis.call('HGET', KEYS[3], tfield)
if not raw then return {'EVAL_ENDED'} end
local task = cjson.decode(raw)
local vfield = 'v:' .. tostring(task.version)
redis.call('HDEL', KEYS[3], tfield)
redis.call('ZREM', KEYS[4], ARGV[2])
local vraw = redis.call('HGET', KEYS[3], vfield)
if not vraw then return {'EVAL_ENDED'} end
local pending = cjson.decode(vraw)
pending.left = pending.left - 1
redis.call('HSET', KEYS[3], vfield, cjson.encode(pending))
redis.call('HSET', KEYS[3], 's:' .. ARGV[2], ARGV[4])
if ARGV[3] ~= '' then
  local released = redis.call('ZREM', KEYS[2], ARGV[3])
  redis.call('DEL', key(LEASE, ARGV[3]))
  redis.call('HINCRBY', KEYS[1], 'leases_released', released)
end
redis.call('HINCRBY', KEYS[1], 'eval_tasks_done', 1)
return {'OK', tostring(task.version), pending.left}
