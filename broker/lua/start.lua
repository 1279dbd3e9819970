-- Guard a fetched entry before it runs. Skips (and acknowledges) a request that is already
-- final, cancelled or past its deadline; otherwise marks it running.
-- KEYS: stream, status, cancel, reply
-- ARGV: group, consumer, entry_id, now, deadline, attempt, status_ttl, reply_ttl, done_channel, rid
local owner = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #owner == 0 or owner[1][2] ~= ARGV[2] then
  return 'fenced'
end
local function finish(state, err)
  local final = cjson.encode({status = state, error = err, attempt = tonumber(ARGV[6]),
    timings = {enqueued = tonumber(redis.call('HGET', KEYS[2], 'enqueued_at')),
               finished = tonumber(ARGV[4])}})
  redis.call('XADD', KEYS[4], '*', 'kind', 'final', 'data', final)
  redis.call('EXPIRE', KEYS[4], ARGV[8])
  redis.call('HSET', KEYS[2], 'state', state, 'result', final, 'finished_at', ARGV[4])
  redis.call('EXPIRE', KEYS[2], ARGV[7])
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  redis.call('XDEL', KEYS[1], ARGV[3])
  redis.call('PUBLISH', ARGV[9], ARGV[10])
  return state
end
local state = redis.call('HGET', KEYS[2], 'state')
if state == 'done' or state == 'failed' or state == 'expired' or state == 'cancelled' then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
  redis.call('XDEL', KEYS[1], ARGV[3])
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
