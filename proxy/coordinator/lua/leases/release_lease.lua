-- release_lease: drop a lease (idempotent). A worker's own release (it submits nothing under the lease: a task
-- handed back to the broker at a preemption or a stop after saving partial sequences) also ends its hold on the
-- task, so its silence once it exits does not cancel the task as a dead worker's and count an attempt against
-- its prompts (generate_tasks/cancel_tasks.lua, "dead"); the task's deadline still bounds it. The release by a
-- submission keeps the holder: a refused submission may be corrected and sent again.
-- KEYS[1] counters  KEYS[2] leases
-- ARGV[1] prefix  ARGV[2] lease_id  ARGV[3] ends_hold: "1" for the worker's own release, "0" for a submission's
-- returns {"OK", released:int} (1, or 0 if it was already gone)
local lk = key(LEASE, ARGV[2])
local worker, tid = redis.call('HGET', lk, 'worker_id'), redis.call('HGET', lk, 'task_id')
local released = call('ZREM', KEYS[2], ARGV[2])
call('DEL', lk)
call('HINCRBY', KEYS[1], 'leases_released', released)
if ARGV[3] == '1' and worker and tid then
  local tk = key(TASK, tid)
  if redis.call('HGET', tk, 'state') == 'inflight' and redis.call('HGET', tk, 'worker_id') == worker then
    -- the holder's other leases of the task ("<lease_id>:<version> ..."): one still live keeps it the holder
    local held = false
    for entry in string.gmatch(redis.call('HGET', tk, 'leases') or '', '%S+') do
      local lid = string.match(entry, '^(.+):%d+$')
      if lid and lid ~= ARGV[2] and redis.call('EXISTS', key(LEASE, lid)) == 1 then held = true end
    end
    if not held then call('HDEL', tk, 'worker_id', 'leased_ms', 'incarnation') end
  end
end
return {'OK', released}
