-- mark_step_sent: the optimize task of a claimed step was handed to the broker.
-- KEYS[1] state  KEYS[2] counters
-- ARGV[1] prefix  ARGV[2] now_ms  ARGV[3] step  ARGV[4] resend ("1": a re-send)
-- ARGV[5] target: the worker whose own queue it went to ("": the shared queue)
-- A (re-)sent step has no holder until a worker starts it again.
-- returns {"OK"} | {"NOT_CLAIMED"} (published or unknown meanwhile) | {"NO_STATE"}
if redis.call('EXISTS', KEYS[1]) == 0 then return {'NO_STATE'} end
local sk = key(STEP, ARGV[3])
if redis.call('HGET', sk, 'state') ~= 'claimed' then return {'NOT_CLAIMED'} end
call('HSET', sk, 'sent_ms', ARGV[2])
call('HINCRBY', sk, 'sends', 1)
call('HDEL', sk, 'holder', 'started_ms', 'holder_incarnation')
if ARGV[5] == '' then call('HDEL', sk, 'target') else call('HSET', sk, 'target', ARGV[5]) end
if ARGV[4] == '1' then call('HINCRBY', KEYS[2], 'optimize_resent', 1) end
return {'OK'}
