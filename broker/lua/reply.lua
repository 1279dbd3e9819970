-- Append token deltas to a request's reply stream (write_deltas), unless a later attempt or
-- another entry superseded this one (fencing by attempt: see superseded): a worker that was
-- fenced out (frozen past its lease, then woken) must not write tokens beside those of the
-- worker that took the request over.
-- KEYS: stream (unused), reply, status
-- ARGV: attempt, consumer (unused), entry_id, reply_ttl (0: set already), strict ('1'/'0'), delta_json...
-- Returns 1 (written), 0 (fenced: nothing written) or {row, next index, ...}: the rows whose
-- deltas were refused from that index on (the others were written).
local got = redis.call('HMGET', KEYS[3], 'state', 'attempt', 'entry', 'next:0')
if superseded(got[2], got[3], ARGV[1], ARGV[3]) then
  return 0
end
local deltas = {}
for i = 6, #ARGV do
  deltas[#deltas + 1] = ARGV[i]
end
local known = {state = got[1], attempt = got[2], ['next:0'] = tonumber(got[4]) or 0}
local gaps, moved = write_deltas(KEYS[3], KEYS[2], ARGV[5] == '1', deltas, known)
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
