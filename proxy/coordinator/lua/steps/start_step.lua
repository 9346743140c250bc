-- start_step: an optimize worker starts the step it was sent and becomes its holder (dead-trainer detection).
-- KEYS[1] state
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] step  ARGV[4] worker_id  ARGV[5] base_version
-- ARGV[6] task_ids_json: the batch the worker's message names, in order
-- ARGV[7] incarnation: of the worker process ("" when it sent none); a new one of the worker id re-sends the step
-- returns {"OK"} | {"NOT_CLAIMED"} (published, un-claimed, or claimed again with another batch: an old copy)
--   | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local sk = key(STEP, ARGV[3])
if redis.call('HGET', sk, 'state') ~= 'claimed' or redis.call('HGET', sk, 'base_version') ~= ARGV[5] then
  return {'NOT_CLAIMED'}
end
local ids = {}
for _, ref in ipairs(cjson.decode(redis.call('HGET', sk, 'rollouts'))) do ids[#ids + 1] = ref['task_id'] end
if table.concat(ids, ',') ~= table.concat(cjson.decode(ARGV[6]), ',') then return {'NOT_CLAIMED'} end
call('HSET', sk, 'holder', ARGV[4], 'started_ms', ARGV[2], 'holder_incarnation', ARGV[7])
call('HINCRBY', sk, 'starts', 1)
return {'OK'}
