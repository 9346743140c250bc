-- release_lease: drop a lease (idempotent).
-- KEYS[1] counters  KEYS[2] leases
-- ARGV[1] prefix  ARGV[2] lease_id
-- returns {"OK", released:int} (1, or 0 if it was already gone)
local released = call('ZREM', KEYS[2], ARGV[2])
call('DEL', key(LEASE, ARGV[2]))
call('HINCRBY', KEYS[1], 'leases_released', released)
return {'OK', released}
