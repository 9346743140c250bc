-- set_halt: halt the run's steps with a reason (proxy.coordinator.redis_store).
-- KEYS[1] state
-- ARGV[1] prefix  ARGV[2] reason  ARGV[3] by: the source, so that it clears only its own halt
-- returns {"OK"} | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
call('HSET', KEYS[1], 'halted', ARGV[2], 'halted_by', ARGV[3])
return {'OK'}
