-- add_counter: count an event decided outside Redis (e.g. a publish refused for its manifest).
-- KEYS[1] state  KEYS[2] counters
-- ARGV[1] prefix  ARGV[2] counter (field name)  ARGV[3] amount
-- returns {"OK", value:int} (the new value) | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
return {'OK', call('HINCRBY', KEYS[2], ARGV[2], ARGV[3])}
