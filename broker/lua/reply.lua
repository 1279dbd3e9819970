-- Append token deltas to a request's reply stream (write_deltas), only while this consumer
-- owns the entry: a worker that was fenced out (frozen past its lease, then woken) must not
-- write tokens beside those of the worker that took the request over.
-- KEYS: stream, reply, status
-- ARGV: group, consumer, entry_id, reply_ttl (0: set already), strict ('1'/'0'), delta_json...
-- Returns 1 (written), 0 (fenced: nothing written) or {row, next index, ...}: the rows whose
-- deltas were refused from that index on (the others were written).
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 0
end
local deltas = {}
for i = 6, #ARGV do
  deltas[#deltas + 1] = ARGV[i]
end
local gaps, moved = write_deltas(KEYS[3], KEYS[2], ARGV[5] == '1', deltas, {})
if #moved > 0 then
  redis.call('HSET', KEYS[3], unpack(moved))
end
if ARGV[4] ~= '0' then  -- the stream's TTL: on an attempt's first write (the final shortens it)
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
if #gaps > 0 then
  return gaps
end
return 1
