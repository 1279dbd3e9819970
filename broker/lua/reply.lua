-- Append token deltas to a request's reply stream, only while this consumer owns the
-- entry: a worker that was fenced out (frozen past its lease, then woken) must not write
-- tokens beside those of the worker that took the request over.
-- KEYS: stream, reply   ARGV: group, consumer, entry_id, reply_ttl, delta_json...
-- Returns 1 (written) or 0 (fenced: nothing written).
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 0
end
for i = 5, #ARGV do
  redis.call('XADD', KEYS[2], '*', 'kind', 'delta', 'data', ARGV[i])
end
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
