-- set_logged_field: set or delete one field of a logged hash, only while the run has a state: a write that
-- lands after Redis emptied would leave a partial state the rebuild then mistakes for the run's (or skips).
-- KEYS[1] state
-- ARGV[1] prefix  ARGV[2] section (a logged hash's key name)  ARGV[3] field  ARGV[4] op ('set' | 'del')  ARGV[5] value
-- returns {"OK"} | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local hash = PREFIX .. ARGV[2]
if ARGV[4] == 'del' then call('HDEL', hash, ARGV[3]) else call('HSET', hash, ARGV[3], ARGV[5]) end
return {'OK'}
