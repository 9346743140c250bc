-- forget_rollouts: drop deleted rollouts from the retention queue and count them.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] rollout_retention
-- ARGV[1] prefix  ARGV[2] max_version the deletion was decided under  ARGV[3..] task_ids whose objects are gone
-- returns {"OK", forgotten:int} | {"NO_STATE"}
--   an entry re-scored above max_version meanwhile (its object was written again) stays queued
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local max_version, forgotten = tonumber(ARGV[2]), 0
for i = 3, #ARGV do
  local score = redis.call('ZSCORE', KEYS[3], ARGV[i])
  if score and tonumber(score) <= max_version then
    call('ZREM', KEYS[3], ARGV[i])
    forgotten = forgotten + 1
  end
end
call('HINCRBY', KEYS[2], 'rollouts_deleted', forgotten)
return {'OK', forgotten}
