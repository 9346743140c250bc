-- unattended_groups: the groups of generate tasks in flight that no worker is known to work on: leased, and none
-- of the task's leases is live (its holder stopped renewing for async.lease_ttl_s, though it was not found dead
-- or restarted). The paced limit does not count them (async.queue_maxsize still does), so such a ghost does not
-- hold the room the next step's groups need; it still ends at its deadline, and a late submission of it is
-- admitted as usual. Reads only.
-- KEYS[1] tasks_inflight  KEYS[2] leases
-- ARGV[1] prefix  ARGV[2] now_ms
-- returns {"OK", groups:int, tasks:int}
local now = tonumber(ARGV[2])
local groups, tasks = 0, 0
for _, tid in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local tk = key(TASK, tid)
  local holder, leases, group_ids = unpack(redis.call('HMGET', tk, 'worker_id', 'leases', 'group_ids'))
  if holder and leases and group_ids then
    local live = false
    for entry in string.gmatch(leases, '%S+') do
      local lid = string.match(entry, '^(.+):%d+$')
      local expires = lid and redis.call('ZSCORE', KEYS[2], lid)
      if expires and tonumber(expires) > now then live = true break end
    end
    if not live then
      groups = groups + #cjson.decode(group_ids)
      tasks = tasks + 1
    end
  end
end
return {'OK', groups, tasks}
