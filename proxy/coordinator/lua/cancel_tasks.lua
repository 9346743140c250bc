-- cancel_tasks: generate tasks presumed lost; their groups are cancelled and their prompts requeued.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] requeue  KEYS[4] tasks_inflight  KEYS[5] rollout_retention
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] record_ttl_s  ARGV[4] force ("1": even before the deadline)
-- ARGV[5] track: rollouts for retention ("1") or keep them all ("0")
-- ARGV[6..] task_ids (only tasks still in flight, and past their deadline unless forced, are cancelled)
-- returns {"OK", tasks_cancelled, groups_requeued} | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, ttl, force, track = tonumber(ARGV[2]), ARGV[3], ARGV[4] == '1', ARGV[5]
local current = num(KEYS[1], 'current_version', -1)
local tasks, groups = 0, 0
for i = 6, #ARGV do
  local tid = ARGV[i]
  local tk = key(TASK, tid)
  if redis.call('HGET', tk, 'state') == 'inflight' and (force or num(tk, 'deadline_ms', 0) <= now) then
    for _, gid in ipairs(cjson.decode(redis.call('HGET', tk, 'group_ids'))) do
      if redis.call('HGET', key(GROUP, gid), 'state') == 'inflight' then
        end_group(gid, 'cancelled', now, ttl, KEYS[3])
        groups = groups + 1
        redis.call('HINCRBY', KEYS[1], 'groups_inflight', -1)
      end
    end
    redis.call('HSET', tk, 'state', 'cancelled', 'ended_ms', now)
    retire(tk, ttl)
    redis.call('ZREM', KEYS[4], tid)
    -- the worker may have written its rollout before it was lost
    retain_until(KEYS[5], track, tid, current)
    tasks = tasks + 1
  end
end
redis.call('HINCRBY', KEYS[2], 'tasks_cancelled', tasks)
redis.call('HINCRBY', KEYS[2], 'groups_cancelled', groups)
return {'OK', tasks, groups}
