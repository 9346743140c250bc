-- retry_evals: eval tasks past their deadline, or whose holder's heartbeats stopped, or whose holder's
-- worker id was heard from in a newer incarnation (restarted), are sent again with a new deadline; at
-- max_attempts their version's evaluation is given up (its chunks forgotten, counted).
-- KEYS[1] counters  KEYS[2] evals  KEYS[3] evals_inflight  KEYS[4] workers
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] alive_since_ms  ARGV[4] deadline_ms  ARGV[5] max_attempts
-- returns {"OK", resend_json:json, failed_json:json} (tasks to send again: [{task_id, version, start, count}];
--   versions given up: [version])
local now, alive_since = tonumber(ARGV[2]), tonumber(ARGV[3])
local resend, failed = {}, {}
local inflight = redis.call('ZRANGE', KEYS[3], 0, -1, 'WITHSCORES')
for i = 1, #inflight, 2 do
  local tid, deadline = inflight[i], tonumber(inflight[i + 1])
  local raw = redis.call('HGET', KEYS[2], 't:' .. tid)
  if not raw then
    call('ZREM', KEYS[3], tid)  -- forgotten with its version (given up earlier in this loop)
  else
    local task = cjson.decode(raw)
    local lost = false
    if task.worker ~= '' then
      local seen = redis.call('ZSCORE', KEYS[4], task.worker)
      lost = (not seen) or tonumber(seen) < alive_since or superseded(task.worker, task.incarnation)
    end
    if deadline <= now or lost then
      if task.attempts >= tonumber(ARGV[5]) then
        local vfield = 'v:' .. tostring(task.version)
        local vraw = redis.call('HGET', KEYS[2], vfield)
        local ids = vraw and cjson.decode(vraw).tasks or {tid}
        for _, other in ipairs(ids) do
          call('HDEL', KEYS[2], 't:' .. other, 's:' .. other)
          call('ZREM', KEYS[3], other)
        end
        call('HDEL', KEYS[2], vfield)
        call('HINCRBY', KEYS[1], 'eval_versions_failed', 1)
        failed[#failed + 1] = task.version
      else
        task.attempts = task.attempts + 1
        task.worker = ''
        task.incarnation = ''
        call('HSET', KEYS[2], 't:' .. tid, cjson.encode(task))
        call('ZADD', KEYS[3], ARGV[4], tid)
        call('HINCRBY', KEYS[1], 'eval_tasks_resent', 1)
        resend[#resend + 1] = {task_id = tid, version = task.version, start = task.start, count = task.count}
      end
    end
  end
end
local function array(items) if #items == 0 then return '[]' end return cjson.encode(items) end
return {'OK', array(resend), array(failed)}
