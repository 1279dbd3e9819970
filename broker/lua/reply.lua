-- Append token deltas to a request's reply stream, only while this consumer owns the
-- entry: a worker that was fenced out (frozen past its lease, then woken) must not write
-- tokens beside those of the worker that took the request over. Idempotent: the status
-- hash keeps each row's next token index, and a delta below it is dropped, so a pipeline
-- re-sent after a lost reply (Redis died after running it) writes nothing twice; a delta of
-- an attempt older than the request's current one is dropped.
-- No holes: a delta that starts past its row's next index, or straddles it, is refused (in
-- strict mode). That happens after a failover: the old primary acknowledged deltas its replica
-- never had (or a flush that did land was joined with later deltas and sent again), and the
-- writer, told the index the stream now ends at, sends them again from there.
-- KEYS: stream, reply, status
-- ARGV: group, consumer, entry_id, reply_ttl (0: set already), strict ('1'/'0'), delta_json...
-- Returns 1 (written), 0 (fenced: nothing written) or {row, next index, ...}: the rows whose
-- deltas were refused from that index on (the others were written).
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 0
end
local strict = ARGV[5] == '1'
local refused = {}  -- row -> its next index, once a delta of it was refused
local gaps = {}
for i = 6, #ARGV do
  local delta = cjson.decode(ARGV[i])
  local row = delta.row or 0
  local field = 'next:' .. tostring(row)
  if refused[row] == nil then
    local known = redis.call('HMGET', KEYS[3], 'state', field, 'attempt')
    local tracked = known[1] ~= false  -- never create a status hash without its TTL
    local next_index = tonumber(known[2]) or 0
    -- An earlier attempt's delta, still buffered in a worker that gave the request up and then
    -- took it over again under the same consumer name, is not written: the run now under way
    -- resumed from the stream as it was, and writes those indices itself.
    if (delta.attempt or 1) >= (tonumber(known[3]) or 0) then
      local ends = delta.i + #delta.token_ids
      if strict and tracked and (delta.i > next_index or (delta.i < next_index and ends > next_index)) then
        refused[row] = next_index
        gaps[#gaps + 1] = row
        gaps[#gaps + 1] = next_index
      elseif delta.i >= next_index then
        redis.call('XADD', KEYS[2], '*', 'kind', 'delta', 'data', ARGV[i])
        if tracked then
          redis.call('HSET', KEYS[3], field, ends)
        end
      end
    end
  end
end
if ARGV[4] ~= '0' then  -- the stream's TTL: on an attempt's first write (the final shortens it)
  redis.call('EXPIRE', KEYS[2], ARGV[4])
end
if #gaps > 0 then
  return gaps
end
return 1
