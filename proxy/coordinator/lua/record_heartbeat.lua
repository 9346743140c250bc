-- record_heartbeat: remember a worker's last report; forget workers silent for a long time.
-- KEYS[1] workers
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] worker_id  ARGV[4] report_json  ARGV[5] forget_after_ms
-- ARGV[6] record_ttl_s
-- returns {"OK", forgotten}
local wk = key(WORKER, ARGV[3])
redis.call('HSET', wk, 'report', ARGV[4], 'last_seen_ms', ARGV[2])
retire(wk, ARGV[6])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[3])
local forgotten = redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[5]))
return {'OK', forgotten}
