-- record_heartbeat: remember a worker's last report; forget workers silent for a long time.
-- KEYS[1] workers  KEYS[2] workers_generate  KEYS[3] workers_optimize
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] worker_id  ARGV[4] report_json  ARGV[5] forget_after_ms
-- ARGV[6] record_ttl_s  ARGV[7] role
-- returns {"OK", forgotten}
local wk = key(WORKER, ARGV[3])
redis.call('HSET', wk, 'report', ARGV[4], 'last_seen_ms', ARGV[2])
retire(wk, ARGV[6])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
-- the per-role sets let /metrics count live workers without reading each one
local mine, other = KEYS[2], KEYS[3]
if ARGV[7] == 'optimize' then mine, other = KEYS[3], KEYS[2] end
redis.call('ZADD', mine, ARGV[2], ARGV[3])
redis.call('ZREM', other, ARGV[3])
local horizon = tonumber(ARGV[2]) - tonumber(ARGV[5])
local forgotten = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', horizon)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', horizon)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', horizon)
return {'OK', forgotten}
