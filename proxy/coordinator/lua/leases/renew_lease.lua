-- renew_lease: push a live lease's expiry to now + ttl.
-- KEYS[1] state  KEYS[2] leases  KEYS[3] versions
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] ttl_ms  ARGV[4] lease_id
-- returns {"OK", version:int, manifest_sha256, expires_ms:int} | {"LEASE_LOST"} (expired or unknown) | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local lk = key(LEASE, ARGV[4])
local now = tonumber(ARGV[2])
if num(lk, 'expires_ms', 0) <= now then return {'LEASE_LOST'} end
local expires = now + tonumber(ARGV[3])
call('HSET', lk, 'expires_ms', expires)
redis.call('PEXPIRE', lk, ARGV[3])
call('ZADD', KEYS[2], expires, ARGV[4])
local version = redis.call('HGET', lk, 'version')
return {'OK', version, redis.call('HGET', KEYS[3], version), expires}
