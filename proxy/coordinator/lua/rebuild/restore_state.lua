-- restore_state: write a whole run state (fresh or rebuilt from the bucket) iff the run has none.
-- KEYS[1] state  KEYS[2] log  KEYS[3] log_dirty  KEYS[4] log_ops
-- ARGV[1] prefix  ARGV[2] ops_json: [[command, key, args...], ...] with command in HSET, RPUSH, ZADD,
--   PEXPIRE, EXPIRE and every key under the prefix; the ops must write the state key
-- returns {"OK", applied:int} (ops) | {"EXISTS"} (a state is already there; nothing written)
--   Idempotent on a partly evicted Redis (the state key gone, a list left): a list is emptied before its first
--   RPUSH, so restoring never duplicates buffer or requeue entries (hashes and sorted sets merge by key).
--   The snapshot log starts over: no notes, no compaction yet (the ops may set the log's "seq" above the
--   segments in the bucket), so the writer's next put is a compaction of the state written here.
if redis.call('EXISTS', KEYS[1]) == 1 then return {'EXISTS'} end
local allowed = {HSET = true, RPUSH = true, ZADD = true, PEXPIRE = true, EXPIRE = true}
local ops = cjson.decode(ARGV[2])
for i, op in ipairs(ops) do
  if not allowed[op[1]] then return redis.error_reply('restore_state: op ' .. i .. ' uses ' .. tostring(op[1])) end
  if string.sub(op[2], 1, #PREFIX) ~= PREFIX then
    return redis.error_reply('restore_state: op ' .. i .. ' writes ' .. op[2] .. ' outside the run')
  end
end
redis.call('DEL', KEYS[3], KEYS[4])
redis.call('HDEL', KEYS[2], 'through')
local emptied = {}
for _, op in ipairs(ops) do
  if op[1] == 'RPUSH' and not emptied[op[2]] then
    redis.call('DEL', op[2])
    emptied[op[2]] = true
  end
  redis.call(unpack(op))
end
if redis.call('EXISTS', KEYS[1]) == 0 then return redis.error_reply('restore_state: the ops wrote no state') end
return {'OK', #ops}
