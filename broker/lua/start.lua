-- Guard a fetched entry before it runs. Skips (and acknowledges) a request that is already
-- final, cancelled or past its deadline; otherwise marks it running.
-- KEYS: stream, status, cancel, reply
-- ARGV: group, consumer, entry_id, now, deadline, attempt, status_ttl, reply_ttl, done_channel, rid
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 'fenced'
end
local function finish(state, err)
  write_final(KEYS[2], KEYS[4], state, bare_final(KEYS[2], state, err, tonumber(ARGV[6]), ARGV[4]),
              ARGV[4], ARGV[7], ARGV[8], ARGV[9], ARGV[10])
  ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
  return state
end
local state = redis.call('HGET', KEYS[2], 'state')
if state == 'done' or state == 'failed' or state == 'expired' or state == 'cancelled' then
  ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
  return 'final'
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return finish('cancelled', 'cancelled by the client')
end
if tonumber(ARGV[4]) > tonumber(ARGV[5]) then
  return finish('expired', 'the request passed its deadline before it started')
end
redis.call('HSET', KEYS[2], 'state', 'running', 'started_at', ARGV[4], 'attempt', ARGV[6],
           'worker', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[7])
return 'run'
