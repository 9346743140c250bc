-- grant_lease: lease the current version to a worker until now + ttl (renewable).
-- KEYS[1] state  KEYS[2] counters  KEYS[3] leases  KEYS[4] versions
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] ttl_ms  ARGV[4] lease_id  ARGV[5] worker_id  ARGV[6] task_id
-- returns {"OK", version, manifest_sha256, expires_ms} | {"NO_VERSION"} | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local current = num(KEYS[1], 'current_version', -1)
if current < 0 then return {'NO_VERSION'} end
local expires = tonumber(ARGV[2]) + tonumber(ARGV[3])
local lk = key(LEASE, ARGV[4])
redis.call('HSET', lk, 'version', current, 'worker_id', ARGV[5], 'task_id', ARGV[6], 'expires_ms', expires,
  'granted_ms', ARGV[2])
redis.call('PEXPIRE', lk, ARGV[3])
redis.call('ZADD', KEYS[3], expires, ARGV[4])
redis.call('HINCRBY', KEYS[2], 'leases_granted', 1)
return {'OK', current, redis.call('HGET', KEYS[4], current), expires}
