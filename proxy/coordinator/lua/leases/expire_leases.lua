-- expire_leases: forget every lease whose expiry is at or before now, counting them.
-- KEYS[1] counters  KEYS[2] leases
-- ARGV[1] prefix  ARGV[2] now_ms
-- returns {"OK", expired:int}
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[2])
for _, id in ipairs(ids) do
  call('DEL', key(LEASE, id))
  call('ZREM', KEYS[2], id)
end
call('HINCRBY', KEYS[1], 'leases_expired', #ids)
return {'OK', #ids}
