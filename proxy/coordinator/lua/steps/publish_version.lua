-- publish_version: compare-and-set current == base_version -> version (the fencing token).
-- KEYS[1] state  KEYS[2] counters  KEYS[3] versions  KEYS[4] rollout_retention
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] version  ARGV[4] base_version  ARGV[5] step  ARGV[6] manifest_sha256
-- ARGV[7] worker_id  ARGV[8] record_ttl_s  ARGV[9] track: rollouts for retention ("1") or keep them all ("0")
-- returns {"OK", current:int} | {"ALREADY", current:int} (this worker already published this very manifest: a retry)
--   | {"BAD_VERSION", current:int} | {"CAS_LOST", current:int} | {"STEP_NOT_CLAIMED", current:int} | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, version, base, step, ttl = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), ARGV[8]
local current = num(KEYS[1], 'current_version', -1)
local sk = key(STEP, step)
if redis.call('HGET', KEYS[3], ARGV[3]) == ARGV[6] and redis.call('HGET', sk, 'worker_id') == ARGV[7] then
  return {'ALREADY', current}
end
local code = nil
if version ~= base + 1 or step ~= version then code = 'BAD_VERSION'
elseif current ~= base then code = 'CAS_LOST'
elseif redis.call('HGET', sk, 'state') ~= 'claimed' or num(sk, 'base_version', -2) ~= base then
  code = 'STEP_NOT_CLAIMED'
end
if code then
  call('HINCRBY', KEYS[2], 'conflicts', 1)
  return {code, current}
end
call('HSET', KEYS[1], 'current_version', version, 'step_inflight', -1, 'last_publish_ms', now)
call('HSET', KEYS[3], version, ARGV[6])
call('HSET', sk, 'state', 'published', 'published_ms', now, 'worker_id', ARGV[7])
retire(sk, ttl)
local trained = 0
for _, ref in ipairs(cjson.decode(redis.call('HGET', sk, 'rollouts'))) do
  for _, gid in ipairs(ref['group_ids']) do
    end_group(gid, 'trained', now, ttl, nil)
    trained = trained + 1
  end
  call('HSET', key(ROLLOUT, ref['task_id']), 'state', 'trained')
  retire(key(ROLLOUT, ref['task_id']), ttl)
  retire(key(TASK, ref['task_id']), ttl)
  retain_until(KEYS[4], ARGV[9], ref['task_id'], version)
end
call('HINCRBY', KEYS[2], 'publish', 1)
call('HINCRBY', KEYS[2], 'groups_trained', trained)
return {'OK', version}
