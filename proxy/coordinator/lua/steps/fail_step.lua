-- fail_step: the optimize worker holding a step reports that it could not train it (invariant 9).
-- KEYS[1] state  KEYS[2] counters  KEYS[3] rejected_reasons  KEYS[4] buffer  KEYS[5] rollout_retention
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] step  ARGV[4] worker_id
-- ARGV[5] kind: "rollout" (task_id names the unusable rollout), "step" (no rollout named: counts an
--   attempt), "base" (the worker could not load the base version), "upload" (an unpublished manifest of
--   another batch was in the way; the proxy removed it: re-sent at once, nothing counted)
-- ARGV[6] reason (a bounded label)  ARGV[7] task_id or ""  ARGV[8] max_attempts  ARGV[9] record_ttl_s
-- ARGV[10] track: rollouts for retention ("1") or keep them all ("0")
-- A rejected rollout's groups end as rejected with the reason and the step is un-claimed: the rest of its
-- batch goes back to the front of the buffer, the step record is dropped, and the next claim makes the
-- step again with a new batch. A "step" failure is re-sent at once until max_attempts, then its whole
-- batch is rejected the same way. A "base" failure records the worker and re-sends at once.
-- returns {"OK", groups_rejected:int, groups_requeued:int} (un-claimed) | {"RETRY", attempts:int, base_failed}
--   | {"NOT_CLAIMED"} (published or un-claimed meanwhile) | {"NOT_IN_STEP"} (the rollout is not in the batch)
--   | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, step, worker, kind, reason, bad = ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local ttl, track = ARGV[9], ARGV[10]
local sk = key(STEP, step)
if redis.call('HGET', sk, 'state') ~= 'claimed' then return {'NOT_CLAIMED'} end
local refs = cjson.decode(redis.call('HGET', sk, 'rollouts'))
local reject_all = false
if kind == 'rollout' then
  local found = false
  for _, ref in ipairs(refs) do if ref['task_id'] == bad then found = true end end
  if not found then return {'NOT_IN_STEP'} end
elseif kind == 'base' then
  local failed = redis.call('HGET', sk, 'base_failed') or ''
  if not string.find(',' .. failed .. ',', ',' .. worker .. ',', 1, true) then
    failed = (failed == '' and worker) or (failed .. ',' .. worker)
  end
  call('HSET', sk, 'base_failed', failed, 'sent_ms', 0, 'last_failed', worker)
  call('HDEL', sk, 'holder', 'started_ms', 'target')
  return {'RETRY', num(sk, 'attempts', 0), failed}
elseif kind == 'upload' then
  call('HSET', sk, 'sent_ms', 0)
  call('HDEL', sk, 'holder', 'started_ms', 'target')
  return {'RETRY', num(sk, 'attempts', 0), redis.call('HGET', sk, 'base_failed') or ''}
else
  local attempts = call('HINCRBY', sk, 'attempts', 1)
  call('HINCRBY', KEYS[2], 'step_failures', 1)
  if attempts < tonumber(ARGV[8]) then
    call('HSET', sk, 'sent_ms', 0, 'last_failed', worker)
    call('HDEL', sk, 'holder', 'started_ms', 'target')
    return {'RETRY', attempts, redis.call('HGET', sk, 'base_failed') or ''}
  end
  reject_all = true
end
local current = num(KEYS[1], 'current_version', -1)
local rejected, requeued = 0, 0
-- backwards, so that LPUSH leaves the kept rollouts at the front in their claimed order
for i = #refs, 1, -1 do
  local tid = refs[i]['task_id']
  local gids = refs[i]['group_ids']
  local rk = key(ROLLOUT, tid)
  if reject_all or tid == bad then
    for _, gid in ipairs(gids) do
      call('HSET', key(GROUP, gid), 'reason', reason)
      end_group(gid, 'rejected', now, ttl, nil)
    end
    call('HINCRBY', KEYS[3], reason, #gids)
    call('HSET', rk, 'state', 'rejected', 'reason', reason)
    retire(rk, ttl)
    retire(key(TASK, tid), ttl)
    retain_until(KEYS[5], track, tid, current)
    rejected = rejected + #gids
  else
    for _, gid in ipairs(gids) do call('HSET', key(GROUP, gid), 'state', 'buffered', 'step', '') end
    call('HSET', rk, 'state', 'buffered', 'step', '')
    call('LPUSH', KEYS[4], tid)
    requeued = requeued + #gids
  end
end
call('DEL', sk)
call('HSET', KEYS[1], 'step_inflight', -1)
call('HINCRBY', KEYS[1], 'groups_buffered', requeued)
call('HINCRBY', KEYS[2], 'groups_rejected', rejected)
call('HINCRBY', KEYS[2], 'steps_unclaimed', 1)
return {'OK', rejected, requeued}
