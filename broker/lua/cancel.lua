-- Cancel: set the flag the worker watches; a request still queued ends cancelled at once
-- (the worker that later fetches it acknowledges it without running it).
-- KEYS: status, cancel, reply   ARGV: now, cancel_ttl, result_ttl, reply_ttl, done_channel, rid
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return false
end
if is_final(KEYS[1]) then
  return state
end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[2])  -- the flag running workers watch
redis.call('HSET', KEYS[1], 'cancel', '1')  -- what a (re)start reads
if state == 'queued' then
  local final = bare_final(KEYS[1], 'cancelled', 'cancelled by the client', nil, ARGV[1])
  write_final(KEYS[1], KEYS[3], 'cancelled', final, ARGV[1], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
  return 'cancelled'
end
return 'cancelling'
