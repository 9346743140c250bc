-- log_segment: what changed since the last segment or compaction, as the next segment of the snapshot log
-- (proxy.coordinator.snapshot_log), with the notes of lua/prelude.lua's call() cleared in the same step.
-- KEYS[1] state  KEYS[2] log  KEYS[3] log_dirty  KEYS[4] log_ops  KEYS[5] proxy_leadership
-- ARGV[1] prefix  ARGV[2] header_json (the segment's other fields, an object)  ARGV[3] epoch (the writer's; "0":
--   unfenced)
-- returns {"OK", seq:int, segment} | {"COMPACT"} (no compaction since the state was built: compact first)
--   | {"FENCED"} (the leadership is not held at that epoch: nothing taken) | {"NO_STATE"}
--   segment = the header's fields and "seq", "hashes": {section: {field: value or null}}, "whole": {section:
--   the whole hash, or {member: score} of a sorted set} (deleted keys), "lists": [[section, command, args...]]
--   (the writes to buffer and requeue, in order), "zsets": {section: {member: score or null}}, "items": {kind:
--   {id: record or null}}. Values are read now, so each is the latest; a task or rollout comes with its groups
--   and a step with its batch's groups, so one that enters the buffer, the tasks in flight or the step is whole
--   in the segment that puts it there.
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
if not leads(KEYS[5], ARGV[3]) then return {'FENCED'} end
if not redis.call('HGET', KEYS[2], 'through') then return {'COMPACT'} end
local seq = redis.call('HINCRBY', KEYS[2], 'seq', 1)
local section_key = {}
for name, logged in pairs(LOGGED) do section_key[logged[1]] = PREFIX .. name end
local function hash(k)
  local flat, out = redis.call('HGETALL', k), {}
  for i = 1, #flat, 2 do out[flat[i]] = flat[i + 1] end
  return out
end
local hashes, zsets, whole, items = {}, {}, {}, {}
local function slot(t, name)
  if not t[name] then t[name] = {} end
  return t[name]
end
local function item(kind, id)
  local record = hash(key(kind, id))
  if next(record) == nil then slot(items, kind)[id] = cjson.null else slot(items, kind)[id] = record end
  return record
end
local function groups_of(ids_json)
  if ids_json then for _, gid in ipairs(cjson.decode(ids_json)) do item(GROUP, gid) end end
end
for _, dirty in ipairs(redis.call('SMEMBERS', KEYS[3])) do
  local what, name, member = string.match(dirty, '^(%a)\t([^\t]*)\t?(.*)$')
  if what == 'h' then
    slot(hashes, name)[member] = redis.call('HGET', section_key[name], member) or cjson.null
  elseif what == 'z' then
    local score = redis.call('ZSCORE', section_key[name], member)
    slot(zsets, name)[member] = score and tonumber(score) or cjson.null
  elseif what == 'H' then
    whole[name] = hash(section_key[name])
  elseif what == 'Z' then
    local scored, members = redis.call('ZRANGE', section_key[name], 0, -1, 'WITHSCORES'), {}
    for i = 1, #scored, 2 do members[scored[i]] = tonumber(scored[i + 1]) end
    whole[name] = members
  elseif name == TASK or name == ROLLOUT then
    groups_of(item(name, member)['group_ids'])
  elseif name == STEP then
    local rollouts = item(name, member)['rollouts']
    if rollouts then for _, ref in ipairs(cjson.decode(rollouts)) do
      for _, gid in ipairs(ref['group_ids']) do item(GROUP, gid) end
    end end
  else
    item(name, member)
  end
end
local ops = redis.call('LRANGE', KEYS[4], 0, -1)
redis.call('DEL', KEYS[3], KEYS[4])
local header = ARGV[2]
local segment = string.sub(header, 1, -2) .. (#header > 2 and ',' or '')
  .. '"seq":' .. string.format('%d', seq)
  .. ',"hashes":' .. cjson.encode(hashes)
  .. ',"whole":' .. cjson.encode(whole)
  .. ',"lists":[' .. table.concat(ops, ',') .. ']'
  .. ',"zsets":' .. cjson.encode(zsets)
  .. ',"items":' .. cjson.encode(items) .. '}'
return {'OK', seq, segment}
