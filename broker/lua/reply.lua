-- Append token deltas to a request's reply stream (write_deltas), unless the writer was fenced
-- out (see fenced in _lib.lua: a later start holds the request now, or its status is gone): a
-- worker frozen past its lease and then woken, or one whose start a failover lost, must not
-- write tokens beside those of the worker that holds the request.
-- KEYS: stream (unused), reply, status
-- ARGV: fence (the writer's fencing token), reply_ttl (0: set already, unless a write re-creates
--       the stream: then it lives as long as its status), delta_json...
-- Returns 1 (written), 0 (fenced: nothing written) or {row, next index, ...}: the rows whose
-- deltas were refused from that index on (the others were written).
local reply, status = KEYS[2], KEYS[3]
local fence, reply_ttl = ARGV[1], ARGV[2]
local FIRST_DELTA = 3  -- ARGV[3...]: the deltas

local got = redis.call('HMGET', status, 'state', 'attempt', 'fence', 'next:0')
if fenced(got[3], fence) then
  return 0
end
local deltas = {}
for i = FIRST_DELTA, #ARGV do
  deltas[#deltas + 1] = ARGV[i]
end
local known = {state = got[1], attempt = got[2], ['next:0'] = tonumber(got[4]) or 0}
local gaps, moved = write_deltas(status, reply, deltas, known)
if #moved > 0 then
  redis.call('HSET', status, unpack(moved))
end
if reply_ttl ~= '0' then  -- the stream's TTL: on an attempt's first write (the final shortens it)
  redis.call('EXPIRE', reply, reply_ttl)
elseif #moved > 0 and redis.call('TTL', reply) == -1 then
  -- a later write that re-created the stream (a failover lost it): as long as its status
  redis.call('EXPIRE', reply, math.max(redis.call('TTL', status), 1))
end
if #gaps > 0 then
  return gaps
end
return 1
