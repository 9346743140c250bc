-- record_heartbeat: remember a worker's last report; forget workers silent for a long time. A new incarnation of
-- a known worker id (its unit restarted it under the same id) ends the old incarnation's leases here; its tasks,
-- eval tasks and step are ended by the next housekeeping round, which compares incarnations.
-- KEYS[1] workers  KEYS[2] workers_generate  KEYS[3] workers_optimize  KEYS[4] counters  KEYS[5] leases
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] worker_id  ARGV[4] report_json  ARGV[5] forget_after_ms
-- ARGV[6] record_ttl_s  ARGV[7] role  ARGV[8] incarnation ("" from a worker that sends none)
-- returns {"OK", forgotten:int, restarted:int, leases_ended:int}
--   (restarted: 1 for a new incarnation of a known worker id)
local wk = key(WORKER, ARGV[3])
local incarnation = ARGV[8]
local restarted, ended = 0, 0
if incarnation ~= '' then
  local known = redis.call('HGET', wk, 'incarnation')
  if known ~= incarnation then
    call('HSET', wk, 'incarnation', incarnation, 'incarnation_ms', ARGV[2])
    if known then
      restarted = 1
      call('HINCRBY', wk, 'restarts', 1)
      call('HINCRBY', KEYS[4], 'worker_restarts', 1)
      -- a scan of every lease, but only when a worker restarts: never on the lease or submit path
      for _, lid in ipairs(redis.call('ZRANGE', KEYS[5], 0, -1)) do
        local lk = key(LEASE, lid)
        local holder, of = unpack(redis.call('HMGET', lk, 'worker_id', 'incarnation'))
        if holder == ARGV[3] and of ~= incarnation then
          call('DEL', lk)
          call('ZREM', KEYS[5], lid)
          ended = ended + 1
        end
      end
      call('HINCRBY', KEYS[4], 'leases_ended_by_restart', ended)
    end
  end
end
call('HSET', wk, 'report', ARGV[4], 'last_seen_ms', ARGV[2])
retire(wk, ARGV[6])
call('ZADD', KEYS[1], ARGV[2], ARGV[3])
-- the per-role sets let /metrics count live workers without reading each one
local mine, other = KEYS[2], KEYS[3]
if ARGV[7] == 'optimize' then mine, other = KEYS[3], KEYS[2] end
call('ZADD', mine, ARGV[2], ARGV[3])
call('ZREM', other, ARGV[3])
local horizon = tonumber(ARGV[2]) - tonumber(ARGV[5])
local forgotten = call('ZREMRANGEBYSCORE', KEYS[1], '-inf', horizon)
call('ZREMRANGEBYSCORE', KEYS[2], '-inf', horizon)
call('ZREMRANGEBYSCORE', KEYS[3], '-inf', horizon)
return {'OK', forgotten, restarted, ended}
