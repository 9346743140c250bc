-- prelude: prepended to every script at load time. ARGV[1] of every script is the run's key prefix; the
-- item kinds are substituted from proxy.coordinator.redis_store, so key names still come from one module.
local PREFIX = ARGV[1]
local function key(kind, id) return PREFIX .. kind .. ':' .. id end
local GROUP, TASK, ROLLOUT, STEP, LEASE, WORKER =
  '${GROUP_KIND}', '${TASK_KIND}', '${ROLLOUT_KIND}', '${STEP_KIND}', '${LEASE_KIND}', '${WORKER_KIND}'
-- The snapshot log (proxy.coordinator.snapshot_log): every write to what the snapshot holds goes through call(),
-- which notes what it touched, so that a group commit puts only what changed since the last one
-- (lua/snapshot/log_segment.lua reads the notes back). Notes in the set LOG_DIRTY: "h<TAB>section<TAB>field" (a
-- field of a logged hash), "z<TAB>section<TAB>member" (a member of a logged sorted set), "i<TAB>kind<TAB>id" (a
-- group, task, rollout, lease or step record), "H<TAB>section" / "Z<TAB>section" (the whole key was deleted).
-- A logged list's writes are ops in order in the list LOG_OPS ([section, command, args...]): LPOP's member is
-- only in its reply, so the order of the writes is what a replay needs, not the members.
local LOG_DIRTY, LOG_OPS = PREFIX .. '${LOG_DIRTY_NAME}', PREFIX .. '${LOG_OPS_NAME}'
local LOGGED = {${LOGGED_KEYS}}
local LOGGED_ITEMS = {['${GROUP_KIND}'] = true, ['${TASK_KIND}'] = true, ['${ROLLOUT_KIND}'] = true,
  ['${LEASE_KIND}'] = true, ['${STEP_KIND}'] = true}
local ZADD_FLAGS = {NX = true, XX = true, GT = true, LT = true, CH = true}
local LOGGED_COMMANDS = {
  hash = {DEL = true, HSET = true, HDEL = true, HINCRBY = true},
  zset = {DEL = true, ZADD = true, ZREM = true},
  list = {DEL = true, RPUSH = true, LPUSH = true, LPOP = true, LREM = true},
}
local function note(member) redis.call('SADD', LOG_DIRTY, member) end
local function note_write(logged, cmd, args, reply)
  local section, shape = logged[1], logged[2]
  if shape == 'hash' then
    if cmd == 'DEL' then note('H\t' .. section)
    elseif cmd == 'HSET' then for i = 1, #args, 2 do note('h\t' .. section .. '\t' .. args[i]) end
    elseif cmd == 'HINCRBY' then note('h\t' .. section .. '\t' .. args[1])
    else for i = 1, #args do note('h\t' .. section .. '\t' .. args[i]) end end
  elseif shape == 'zset' then
    if cmd == 'DEL' then note('Z\t' .. section)
    elseif cmd == 'ZREM' then for i = 1, #args do note('z\t' .. section .. '\t' .. args[i]) end
    else
      local i = 1
      while ZADD_FLAGS[args[i]] do i = i + 1 end
      for j = i + 1, #args, 2 do note('z\t' .. section .. '\t' .. args[j]) end
    end
  elseif not (cmd == 'LPOP' and not reply) then  -- an LPOP of an empty list changed nothing
    local op = {section, cmd}
    for i = 1, #args do op[#op + 1] = args[i] end
    redis.call('RPUSH', LOG_OPS, cjson.encode(op))
  end
end
-- every write of a script that changes content (not EXPIRE): redis.call, plus the note of what it touched
local function call(cmd, k, ...)
  local name = string.sub(k, #PREFIX + 1)
  local logged = LOGGED[name]
  if logged and not LOGGED_COMMANDS[logged[2]][cmd] then
    error('call: ' .. cmd .. ' on ' .. name .. ' is not one the snapshot log replays')
  end
  local reply = redis.call(cmd, k, ...)
  if logged then
    note_write(logged, cmd, {...}, reply)
  else
    local kind, id = string.match(name, '^([^:]+):(.+)$$')
    if kind and LOGGED_ITEMS[kind] then note('i\t' .. kind .. '\t' .. id) end
  end
  return reply
end
-- whether the proxy of fencing `epoch` still holds the run's leadership ("0": an unfenced caller, tests of one
-- coordinator): the log's notes are taken only by the leader, so a deposed proxy never takes its successor's
local function leads(leadership_key, epoch)
  if epoch == '0' then return true end
  local leader = redis.call('GET', leadership_key)
  return leader ~= false and cjson.decode(leader)['epoch'] == tonumber(epoch)
end
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
  if track == '1' then call('ZADD', zkey, version, tid) end
end
-- a group leaves the line for good with this fate; stale and cancelled ones put their prompt back in line
local function end_group(gid, fate, now, ttl, requeue_key)
  local gk = key(GROUP, gid)
  call('HSET', gk, 'state', fate, 'ended_ms', now)
  if requeue_key then call('RPUSH', requeue_key, redis.call('HGET', gk, 'prompt_index')) end
  retire(gk, ttl)
end
