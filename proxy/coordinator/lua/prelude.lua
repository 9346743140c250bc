-- prelude: prepended to every script at load time. ARGV[1] of every script is the run's key prefix; the
-- item kinds are substituted from proxy.coordinator.redis_store, so key names still come from one module.
local PREFIX = ARGV[1]
local function key(kind, id) return PREFIX .. kind .. ':' .. id end
local GROUP, TASK, ROLLOUT, STEP, LEASE, WORKER =
  '${GROUP_KIND}', '${TASK_KIND}', '${ROLLOUT_KIND}', '${STEP_KIND}', '${LEASE_KIND}', '${WORKER_KIND}'
local function num(k, field, default)
  local v = redis.call('HGET', k, field)
  if v then return tonumber(v) end
  return default
end
local function retire(k, ttl) redis.call('EXPIRE', k, ttl) end
-- work bound to `incarnation` of worker `worker_id` is the dead process's: a newer one of the id was heard
-- (its unit restarted it under the same id); false when either is unknown ("" or no record)
local function superseded(worker_id, incarnation)
  if not incarnation or incarnation == '' then return false end
  local latest = redis.call('HGET', key(WORKER, worker_id), 'incarnation')
  return latest ~= false and latest ~= incarnation
end
-- the rollout of task tid will never be trained (again): its object may go once `version` is old enough
local function retain_until(zkey, track, tid, version)
  if track == '1' then redis.call('ZADD', zkey, version, tid) end
end
-- a group leaves the line for good with this fate; stale and cancelled ones put their prompt back in line
local function end_group(gid, fate, now, ttl, requeue_key)
  local gk = key(GROUP, gid)
  redis.call('HSET', gk, 'state', fate, 'ended_ms', now)
  if requeue_key then redis.call('RPUSH', requeue_key, redis.call('HGET', gk, 'prompt_index')) end
  retire(gk, ttl)
end
