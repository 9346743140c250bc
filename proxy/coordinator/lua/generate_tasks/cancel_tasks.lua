-- cancel_tasks: generate tasks presumed lost or failed; their groups are cancelled and their prompts requeued,
-- or rejected once a prompt has failed async.max_group_attempts times (invariant 9).
-- KEYS[1] state  KEYS[2] counters  KEYS[3] requeue  KEYS[4] tasks_inflight  KEYS[5] rollout_retention
-- KEYS[6] rejected_reasons  KEYS[7] prompt_attempts  KEYS[8] workers
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] record_ttl_s  ARGV[4] mode: "deadline" (past its deadline),
--   "force" (at once, no attempt counted: the broker refused it), "dead" (its lease holder was last heard
--   from before alive_since_ms, or a newer incarnation of its worker id was heard: restarted), "failed" (its
--   worker reported a failure), "failed_uncounted" (a failure the worker says is not its prompts' fault,
--   e.g. an adapter it could not load: cancelled, no attempt counted)
-- ARGV[5] track: rollouts for retention ("1") or keep them all ("0")
-- ARGV[6] max_attempts (0: never reject)  ARGV[7] reason: the reported failure ("failed" mode)
-- ARGV[8] alive_since_ms ("dead" mode)  ARGV[9] worker_id: the reporter ("failed" mode)
-- ARGV[10..] task_ids (only tasks still in flight and matching the mode are cancelled)
-- returns {"OK", tasks_cancelled:int, groups_requeued:int, groups_rejected:int} | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, ttl, mode, track = tonumber(ARGV[2]), ARGV[3], ARGV[4], ARGV[5]
local max_attempts, reported, alive_since = tonumber(ARGV[6]), ARGV[7], tonumber(ARGV[8])
local counts = mode ~= 'force' and mode ~= 'failed_uncounted'
local current = num(KEYS[1], 'current_version', -1)
local function matches(tk)
  if redis.call('HGET', tk, 'state') ~= 'inflight' then return false end
  if mode == 'force' then return true end
  if mode == 'deadline' then return num(tk, 'deadline_ms', 0) <= now end
  local holder = redis.call('HGET', tk, 'worker_id')
  if mode == 'failed' or mode == 'failed_uncounted' then return holder == false or holder == ARGV[9] end
  if not holder then return false end
  -- dead: held by an older incarnation of its worker id (restarted under the same id, so its heartbeats never
  -- stopped) ...
  if superseded(holder, redis.call('HGET', tk, 'incarnation')) then return 'restarted' end
  -- ... or leased long enough ago that a live holder must have been heard from since
  if num(tk, 'leased_ms', now) > alive_since then return false end
  local seen = redis.call('ZSCORE', KEYS[8], holder)
  return seen == false or tonumber(seen) < alive_since
end
local tasks, groups, rejected, restarted = 0, 0, 0, 0
for i = 10, #ARGV do
  local tid = ARGV[i]
  local tk = key(TASK, tid)
  local why = matches(tk)
  if why then
    if why == 'restarted' then restarted = restarted + 1 end
    for _, gid in ipairs(cjson.decode(redis.call('HGET', tk, 'group_ids'))) do
      local gk = key(GROUP, gid)
      if redis.call('HGET', gk, 'state') == 'inflight' then
        local idx = redis.call('HGET', gk, 'prompt_index')
        local quarantine = redis.call('HGET', KEYS[7], 'quarantined:' .. idx)
        local n = 0
        if counts and not quarantine then
          n = call('HINCRBY', KEYS[7], idx, 1)
          if mode == 'failed' then call('HSET', KEYS[7], 'reason:' .. idx, reported) end
        end
        if counts and not quarantine and max_attempts > 0 and n >= max_attempts then
          quarantine = redis.call('HGET', KEYS[7], 'reason:' .. idx) or ('failed_' .. n .. '_attempts')
          call('HDEL', KEYS[7], idx, 'reason:' .. idx)
          -- quarantined: never dispatched again (it would fail max_attempts more times every epoch)
          call('HSET', KEYS[7], 'quarantined:' .. idx, quarantine)
          call('HINCRBY', KEYS[7], 'quarantined', 1)
          call('HINCRBY', KEYS[2], 'prompts_quarantined', 1)
        end
        if quarantine then
          -- rejected at its last attempt; or another group of a prompt quarantined while it was in flight
          call('HSET', gk, 'reason', quarantine)
          end_group(gid, 'rejected', now, ttl, nil)
          call('HINCRBY', KEYS[6], quarantine, 1)
          rejected = rejected + 1
        else
          end_group(gid, 'cancelled', now, ttl, KEYS[3])
          groups = groups + 1
        end
        call('HINCRBY', KEYS[1], 'groups_inflight', -1)
      end
    end
    call('HSET', tk, 'state', 'cancelled', 'ended_ms', now, 'cancelled_as', why == 'restarted' and why or mode)
    retire(tk, ttl)
    call('ZREM', KEYS[4], tid)
    -- the worker may have written its rollout before it was lost
    retain_until(KEYS[5], track, tid, current)
    tasks = tasks + 1
  end
end
call('HINCRBY', KEYS[2], 'tasks_cancelled', tasks)
call('HINCRBY', KEYS[2], 'groups_cancelled', groups)
call('HINCRBY', KEYS[2], 'groups_rejected', rejected)
if mode == 'dead' then
  call('HINCRBY', KEYS[2], 'tasks_worker_lost', tasks)
  call('HINCRBY', KEYS[2], 'tasks_worker_restarted', restarted)
end
if mode == 'failed' or mode == 'failed_uncounted' then call('HINCRBY', KEYS[2], 'tasks_failed', tasks) end
return {'OK', tasks, groups, rejected}
