-- dispatch_generate: create one generate task; requeued prompts first, then the epoch permutation.
-- A requeued prompt that already failed an attempt goes alone in its task, so that a poison prompt does not
-- use up the attempts of the prompts it happened to share a task with (invariant 9).
-- KEYS[1] state  KEYS[2] counters  KEYS[3] requeue  KEYS[4] tasks_inflight  KEYS[5] prompt_attempts
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] deadline_ms  ARGV[4] groups_per_task  ARGV[5] queue_maxsize
-- ARGV[6] epoch (expected)  ARGV[7] epoch_pos (expected)  ARGV[8] num_prompts  ARGV[9] run
-- ARGV[10..] candidates: the prompt indices of the permutation from (epoch, epoch_pos) on, groups_per_task
--   plus as many as there are quarantined prompts (prompt_attempts "quarantined:<index>": rejected after
--   async.max_group_attempts failed attempts), which are skipped: a poison prompt never comes back
-- returns {"OK", task_id, groups_json:json} | {"NO_ROOM"} (buffer full) | {"RETRY"} (epoch_pos moved)
--   | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local now, k, n = ARGV[2], tonumber(ARGV[4]), tonumber(ARGV[8])
if #ARGV - 9 < k then return redis.error_reply('dispatch_generate: fewer candidates than groups_per_task') end
local inflight, buffered = num(KEYS[1], 'groups_inflight', 0), num(KEYS[1], 'groups_buffered', 0)
local head = redis.call('LINDEX', KEYS[3], 0)
local alone = head and redis.call('HEXISTS', KEYS[5], head) == 1
  and redis.call('HEXISTS', KEYS[5], 'quarantined:' .. head) == 0
if alone then k = 1 end
if inflight + buffered + k > tonumber(ARGV[5]) then return {'NO_ROOM'} end
local epoch, pos = num(KEYS[1], 'epoch', 0), num(KEYS[1], 'epoch_pos', 0)
if epoch ~= tonumber(ARGV[6]) or pos ~= tonumber(ARGV[7]) then return {'RETRY'} end
local indices, from_requeue, used = {}, 0, 0
local short = alone
while #indices < k do
  local idx = call('LPOP', KEYS[3])
  if not idx then break end
  -- a quarantined prompt requeued before its quarantine (e.g. a stale drop): that group ended; it stays out
  if redis.call('HEXISTS', KEYS[5], 'quarantined:' .. idx) == 0 then
    if #indices > 0 and redis.call('HEXISTS', KEYS[5], idx) == 1 then
      -- it goes alone in the next task; this one stays short, so requeued prompts keep going first, in order
      call('LPUSH', KEYS[3], idx)
      short = true
      break
    end
    indices[#indices + 1] = idx
    from_requeue = from_requeue + 1
  end
end
while not short and #indices < tonumber(ARGV[4]) and used < #ARGV - 9 do
  used = used + 1
  local idx = ARGV[9 + used]
  if redis.call('HEXISTS', KEYS[5], 'quarantined:' .. idx) == 0 then indices[#indices + 1] = idx end
end
-- nothing popped from the requeue line and every candidate quarantined: no task (nothing changed)
if #indices == 0 then return {'NO_ROOM'} end
local seq = call('HINCRBY', KEYS[1], 'task_seq', 1)
local task_id = 'gen-' .. ARGV[9] .. '-' .. num(KEYS[1], 'incarnation', 0) .. '-' .. string.format('%08d', seq)
pos = pos + used
while pos >= n do pos = pos - n; epoch = epoch + 1 end
k = #indices
local gids, parts = {}, {}
for i, idx in ipairs(indices) do
  local gid = task_id .. '.' .. (i - 1)
  gids[i] = gid
  call('HSET', key(GROUP, gid), 'prompt_index', idx, 'state', 'inflight', 'task_id', task_id,
    'dispatched_ms', now)
  parts[i] = '{"group_id":"' .. gid .. '","prompt_index":' .. idx .. '}'
end
call('HSET', key(TASK, task_id), 'state', 'inflight', 'group_ids', '["' .. table.concat(gids, '","') .. '"]',
  'dispatched_ms', now, 'deadline_ms', ARGV[3])
call('ZADD', KEYS[4], ARGV[3], task_id)
call('HINCRBY', KEYS[1], 'groups_inflight', k)
call('HSET', KEYS[1], 'epoch', epoch, 'epoch_pos', pos)
call('HINCRBY', KEYS[2], 'tasks_dispatched', 1)
call('HINCRBY', KEYS[2], 'groups_dispatched', k)
call('HINCRBY', KEYS[2], 'groups_requeue_served', from_requeue)
return {'OK', task_id, '[' .. table.concat(parts, ',') .. ']'}
