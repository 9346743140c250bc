-- close_eval: a version's eval record is in the bucket: forget its chunks and keep it as the newest summary
-- if no later version's is kept already.
-- KEYS[1] counters  KEYS[2] evals
-- ARGV[1] prefix  ARGV[2] version  ARGV[3] summary_json ({"version", "metrics"})
-- returns {"OK", closed:int} (0 when the version was not pending)
local vfield = 'v:' .. ARGV[2]
local vraw = redis.call('HGET', KEYS[2], vfield)
if not vraw then return {'OK', 0} end
for _, tid in ipairs(cjson.decode(vraw).tasks) do call('HDEL', KEYS[2], 's:' .. tid, 't:' .. tid) end
call('HDEL', KEYS[2], vfield)
local latest = tonumber(redis.call('HGET', KEYS[2], 'latest_version') or '-1')
if tonumber(ARGV[2]) > latest then
  call('HSET', KEYS[2], 'latest_version', ARGV[2], 'latest', ARGV[3])
end
call('HINCRBY', KEYS[1], 'eval_versions_done', 1)
return {'OK', 1}
