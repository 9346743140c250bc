-- snapshot_json: read, atomically, everything a rebuild needs as the snapshot document's JSON; with compact,
-- also start the snapshot log anew from it (proxy.coordinator.snapshot_log): the next log number is handed to the
-- document as "log_through" (and recorded as the log's "through"), and the notes of what changed are cleared, so
-- the segments after it hold exactly what changed after this read.
-- KEYS[1] state  KEYS[2] counters  KEYS[3] rejected_reasons  KEYS[4] versions  KEYS[5] requeue  KEYS[6] buffer
-- KEYS[7] tasks_inflight  KEYS[8] leases  KEYS[9] rollout_retention  KEYS[10] prompt_attempts  KEYS[11] tracking
-- KEYS[12] log  KEYS[13] log_dirty  KEYS[14] log_ops  KEYS[15] proxy_leadership
-- ARGV[1] prefix  ARGV[2] header_json (the document's other fields, an object)  ARGV[3] compact: "1" (a compaction
--   of the log: writes only the log's keys) or "0" (a read: no writes)  ARGV[4] epoch (the compacting writer's;
--   "0": unfenced)
-- returns {"OK", document, log_through:int} (log_through: 0 on a read) | {"FENCED"} (a compaction by a proxy
--   that no longer holds the leadership at that epoch: nothing written) | {"NO_STATE"}
--   The JSON is made here (cjson) so that the proxy neither parses nor re-encodes the whole state per write.
--   Hashes become objects of strings; buffer = [{task_id, rollout, groups: {group_id: group}}], inflight_tasks
--   likewise with task; step = {record, groups} or null; leases = [{lease_id, lease}]; rollout_retention =
--   {task_id: version}; prompt_attempts = {prompt_index: failed attempts, "reason:<index>": last reason};
--   tracking = {tracker: {step: last step sent, evals: [versions whose eval was sent, ascending]}} (the hash's
--   "<tracker>:step" and "<tracker>:eval:<v>" fields, without the send times: a few bytes per eval).
--   Arrays are joined by hand: cjson writes an empty table as {}.
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
if ARGV[3] == '1' and not leads(KEYS[15], ARGV[4]) then return {'FENCED'} end
local function hash(k)
  local flat, out = redis.call('HGETALL', k), {}
  for i = 1, #flat, 2 do out[flat[i]] = flat[i + 1] end
  return out
end
local function array(items)
  if #items == 0 then return '[]' end
  return '[' .. table.concat(items, ',') .. ']'
end
-- {group_id: group} in the order of the ids (a rebuild requeues lost prompts in that order)
local function groups_json(ids)
  local parts = {}
  for _, gid in ipairs(ids) do parts[#parts + 1] = cjson.encode(gid) .. ':' .. cjson.encode(hash(key(GROUP, gid))) end
  return '{' .. table.concat(parts, ',') .. '}'
end
local function with_groups(head, ids_json)
  return string.sub(cjson.encode(head), 1, -2) .. ',"groups":' .. groups_json(cjson.decode(ids_json)) .. '}'
end
local buffer = {}
for _, tid in ipairs(redis.call('LRANGE', KEYS[6], 0, -1)) do
  local rk = key(ROLLOUT, tid)
  buffer[#buffer + 1] = with_groups({task_id = tid, rollout = hash(rk)}, redis.call('HGET', rk, 'group_ids'))
end
local tasks = {}
for _, tid in ipairs(redis.call('ZRANGE', KEYS[7], 0, -1)) do
  local tk = key(TASK, tid)
  tasks[#tasks + 1] = with_groups({task_id = tid, task = hash(tk)}, redis.call('HGET', tk, 'group_ids'))
end
local step = 'null'
local inflight = num(KEYS[1], 'step_inflight', -1)
if inflight >= 0 then
  local sk = key(STEP, inflight)
  local ids = {}
  for _, ref in ipairs(cjson.decode(redis.call('HGET', sk, 'rollouts'))) do
    for _, gid in ipairs(ref['group_ids']) do ids[#ids + 1] = gid end
  end
  step = '{"record":' .. cjson.encode(hash(sk)) .. ',"groups":' .. groups_json(ids) .. '}'

end
local leases = {}
for _, id in ipairs(redis.call('ZRANGE', KEYS[8], 0, -1)) do
  local lease = hash(key(LEASE, id))
  if next(lease) ~= nil then leases[#leases + 1] = cjson.encode({lease_id = id, lease = lease}) end
end
local requeue = {}
for _, index in ipairs(redis.call('LRANGE', KEYS[5], 0, -1)) do requeue[#requeue + 1] = cjson.encode(index) end
local retention = {}
local scored = redis.call('ZRANGE', KEYS[9], 0, -1, 'WITHSCORES')
for i = 1, #scored, 2 do retention[scored[i]] = math.floor(tonumber(scored[i + 1])) end
local trackers, names = {}, {}
local fields = redis.call('HGETALL', KEYS[11])
for i = 1, #fields, 2 do
  local name, what = string.match(fields[i], '^([^:]+):(.+)$')
  if name then
    if not trackers[name] then
      trackers[name] = {step = 0, evals = {}}
      names[#names + 1] = name
    end
    local version = string.match(what, '^eval:(%d+)$')
    if what == 'step' then
      trackers[name].step = tonumber(fields[i + 1]) or 0
    elseif version then
      trackers[name].evals[#trackers[name].evals + 1] = tonumber(version)
    end
  end
end
table.sort(names)
local tracking = {}
for _, name in ipairs(names) do
  local progress = trackers[name]
  table.sort(progress.evals)
  local evals = {}
  for _, version in ipairs(progress.evals) do evals[#evals + 1] = string.format('%d', version) end
  tracking[#tracking + 1] = cjson.encode(name) .. ':{"step":' .. string.format('%d', progress.step)
    .. ',"evals":' .. array(evals) .. '}'
end
local header, through = ARGV[2], 0
if ARGV[3] == '1' then
  through = redis.call('HINCRBY', KEYS[12], 'seq', 1)
  redis.call('HSET', KEYS[12], 'through', through)
  redis.call('DEL', KEYS[13], KEYS[14])
  header = string.sub(header, 1, -2) .. (#header > 2 and ',' or '') .. '"log_through":' .. string.format('%d', through) .. '}'
end
local document = string.sub(header, 1, -2) .. (#header > 2 and ',' or '')
  .. '"state":' .. cjson.encode(hash(KEYS[1]))
  .. ',"counters":' .. cjson.encode(hash(KEYS[2]))
  .. ',"rejected_reasons":' .. cjson.encode(hash(KEYS[3]))
  .. ',"versions":' .. cjson.encode(hash(KEYS[4]))
  .. ',"requeue":' .. array(requeue)
  .. ',"buffer":' .. array(buffer)
  .. ',"inflight_tasks":' .. array(tasks)
  .. ',"step":' .. step
  .. ',"leases":' .. array(leases)
  .. ',"rollout_retention":' .. cjson.encode(retention)
  .. ',"prompt_attempts":' .. cjson.encode(hash(KEYS[10]))
  .. ',"tracking":{' .. table.concat(tracking, ',') .. '}}'
return {'OK', document, through}
