-- clear_halt: lift the halt iff the given source set it.
-- KEYS[1] state
-- ARGV[1] prefix  ARGV[2] by
-- returns {"OK", cleared:int} (1 if lifted, else 0)
local cleared = 0
if redis.call('HGET', KEYS[1], 'halted_by') == ARGV[2] then
  call('HDEL', KEYS[1], 'halted', 'halted_by')
  cleared = 1
end
return {'OK', cleared}
