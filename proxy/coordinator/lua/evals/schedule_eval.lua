-- schedule_eval: put a due version's eval tasks in flight and move the eval cursor past the version.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] evals  KEYS[4] evals_inflight
-- ARGV[1] prefix  ARGV[2] deadline_ms  ARGV[3] version  ARGV[4] cursor (the next version to consider)
-- ARGV[5..] tasks ("<task_id>:<prompt_start>:<prompt_count>"; none: the version is passed over)
-- returns {"OK", scheduled:int} (0 when the version was already pending or had no task) | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local scheduled = 0
local vfield = 'v:' .. ARGV[3]
if #ARGV > 4 and redis.call('HEXISTS', KEYS[3], vfield) == 0 then
  local ids = {}
  for i = 5, #ARGV do
    local tid, start, count = string.match(ARGV[i], '^(.*):(%d+):(%d+)$')
    local task = {version = tonumber(ARGV[3]), start = tonumber(start), count = tonumber(count), attempts = 1,
      worker = ''}
    call('HSET', KEYS[3], 't:' .. tid, cjson.encode(task))
    call('ZADD', KEYS[4], ARGV[2], tid)
    ids[#ids + 1] = tid
  end
  call('HSET', KEYS[3], vfield, cjson.encode({left = #ids, tasks = ids}))
  call('HINCRBY', KEYS[2], 'eval_tasks_sent', #ids)
  scheduled = 1
end
call('HSET', KEYS[3], 'cursor', ARGV[4])
return {'OK', scheduled}
