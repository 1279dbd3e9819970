-- Append token deltas to the reply streams of many requests in one call (one flush of a worker:
-- every request's tokens since its last flush, the requests of one slot: a model shard's hash
-- tag). Each request's deltas go through write_deltas under its own fencing token (see fenced in
-- _lib.lua: a later start holds the request now, or its status is gone): a worker frozen past
-- its lease and then woken, or one whose start a failover lost, writes nothing of that request,
-- while the other requests of the same call are written. Idempotent per request (write_deltas:
-- a call sent again after a lost answer writes no delta twice).
-- KEYS: per request: reply, status
-- ARGV: per request, in the order of KEYS: fence (the writer's fencing token), reply_ttl (0:
--       set already, unless a write creates the stream: then it lives as long as its status),
--       n (how many deltas follow), then n deltas (JSON)
-- Returns, per request in the order of KEYS: 1 (written), 2 (written, and the request has a
-- cancel: cancel.lua marks its status, so the worker's cancel watch needs no read of its own for
-- a request whose tokens it writes), 0 (fenced: nothing written) or {row, next index, ...}: the
-- rows whose deltas were refused from that index on (the others were written).

local function write_request(reply, status, fence, reply_ttl, deltas)
  local got = redis.call('HMGET', status, 'state', 'attempt', 'fence', 'next:0', 'cancel')
  if fenced(got[3], fence) then
    return 0
  end
  local known = {state = got[1], attempt = got[2], ['next:0'] = tonumber(got[4]) or 0}
  local gaps, moved, created = write_deltas(status, reply, deltas, known)
  if #moved > 0 then
    redis.call('HSET', status, unpack(moved))
  end
  if reply_ttl ~= '0' then  -- the stream's TTL: on an attempt's first write (the final shortens it)
    redis.call('EXPIRE', reply, reply_ttl)
  elseif created then
    -- a later write that created the stream (a failover lost it): as long as its status
    redis.call('EXPIRE', reply, math.max(redis.call('TTL', status), 1))
  end
  if #gaps > 0 then
    return gaps
  end
  return got[5] and 2 or 1
end

local answers, at = {}, 1
for k = 1, #KEYS, 2 do
  local n = tonumber(ARGV[at + 2])
  local deltas = {}
  for i = at + 3, at + 2 + n do
    deltas[#deltas + 1] = ARGV[i]
  end
  answers[#answers + 1] = write_request(KEYS[k], KEYS[k + 1], ARGV[at], ARGV[at + 1], deltas)
  at = at + 3 + n
end
return answers
