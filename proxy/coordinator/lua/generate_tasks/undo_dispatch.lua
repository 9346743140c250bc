-- undo_dispatch: take back generate tasks that were never sent (the snapshot naming them was not written):
-- no cancellation is counted, and their prompts go back to the front of the line in their order.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] requeue  KEYS[4] tasks_inflight
-- ARGV[1] prefix  ARGV[2..] task_ids, in the order they were dispatched (only tasks still in flight are undone)
-- returns {"OK", tasks_undone:int, groups_undone:int} | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local tasks, groups = 0, 0
for i = #ARGV, 2, -1 do
  local tk = key(TASK, ARGV[i])
  if redis.call('HGET', tk, 'state') == 'inflight' then
    local gids = cjson.decode(redis.call('HGET', tk, 'group_ids'))
    for j = #gids, 1, -1 do
      local gk = key(GROUP, gids[j])
      call('LPUSH', KEYS[3], redis.call('HGET', gk, 'prompt_index'))
      call('DEL', gk)
    end
    call('DEL', tk)
    call('ZREM', KEYS[4], ARGV[i])
    call('HINCRBY', KEYS[1], 'groups_inflight', -#gids)
    call('HINCRBY', KEYS[2], 'tasks_dispatched', -1)
    call('HINCRBY', KEYS[2], 'groups_dispatched', -#gids)
    tasks, groups = tasks + 1, groups + #gids
  end
end
call('HINCRBY', KEYS[2], 'tasks_undone', tasks)
return {'OK', tasks, groups}
