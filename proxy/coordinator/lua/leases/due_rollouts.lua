-- due_rollouts: rollouts whose retention is over (score <= max_version), minus any still needed.
-- KEYS[1] state  KEYS[2] rollout_retention
-- ARGV[1] prefix  ARGV[2] max_version (current - async.rollout_retention_versions)
-- ARGV[3] limit (at most this many)
-- returns {"OK", due:list, protected:list} (task ids) | {"NO_STATE"}
--   protected: buffered, claimed or in the step in flight; they leave the queue and are never deleted
--   (a publish puts them back once trained). A correct run has none.
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
    call('ZREM', KEYS[2], tid)
    protected[#protected + 1] = tid
  else
    due[#due + 1] = tid
  end
end
return {'OK', due, protected}
