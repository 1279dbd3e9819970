-- Append token deltas to a request's reply stream, only while this consumer owns the
-- entry: a worker that was fenced out (frozen past its lease, then woken) must not write
-- tokens beside those of the worker that took the request over. Idempotent: the status
-- hash keeps each row's next token index, and a delta below it is dropped, so a pipeline
-- re-sent after a lost reply (Redis died after running it) writes nothing twice; a delta of
-- an attempt older than the request's current one is dropped.
-- KEYS: stream, reply, status   ARGV: group, consumer, entry_id, reply_ttl (0: set already), delta_json...
-- Returns 1 (written) or 0 (fenced: nothing written).
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 0
end
for i = 5, #ARGV do
  local delta = cjson.decode(ARGV[i])
  local field = 'next:' .. tostring(delta.row or 0)
  local known = redis.call('HMGET', KEYS[3], 'state', field, 'attempt')
  local tracked = known[1] ~= false  -- never create a status hash without its TTL
  local next_index = tonumber(known[2]) or 0
  -- An earlier attempt's delta, still buffered in a worker that gave the request up and then
  -- took it over again under the same consumer name, is not written: the run now under way
  -- resumed from the stream as it was, and writes those indices itself.
  if delta.i >= next_index and (delta.attempt or 1) >= (tonumber(known[3]) or 0) then
    redis.call('XADD', KEYS[2], '*', 'kind', 'delta', 'data', ARGV[i])
    if tracked then
      redis.call('HSET', KEYS[3], field, delta.i + #delta.token_ids)
    end
  end
end
if ARGV[4] ~= '0' then  -- the stream's TTL: on an attempt's first write (the final shortens it)
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
return 1
