-- Cancel: set the flag the worker watches; a request still queued ends cancelled at once
-- (the worker that later fetches it acknowledges it without running it).
-- KEYS: status, cancel, reply   ARGV: now, cancel_ttl, status_ttl, reply_ttl, done_channel, rid
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return false
end
if state ~= 'queued' and state ~= 'running' then
  return state
end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[2])
if state == 'queued' then
  local final = cjson.encode({status = 'cancelled', error = 'cancelled by the client',
    timings = {enqueued = tonumber(redis.call('HGET', KEYS[1], 'enqueued_at')),
               finished = tonumber(ARGV[1])}})
  redis.call('XADD', KEYS[3], '*', 'kind', 'final', 'data', final)
  redis.call('EXPIRE', KEYS[3], ARGV[4])
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'result', final, 'finished_at', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('PUBLISH', ARGV[5], ARGV[6])
  return 'cancelled'
end
return 'cancelling'
