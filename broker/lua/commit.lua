-- Commit a result: unless a later attempt or another entry superseded this one (see superseded:
-- fencing by attempt), write the request's last token deltas (those not flushed yet ride on the
-- commit: one call, not a flush and then a commit), the final event and the status (unless the
-- request is final already), acknowledge and delete the entry, and announce it, all at once.
-- Otherwise it has been fenced out and writes nothing.
-- KEYS: stream, status, reply
-- ARGV: group, consumer, entry_id, state, final_json, now, result_ttl, reply_ttl,
--       done_channel, rid, rows (the request's row count), strict ('1'/'0', for the deltas),
--       n (how many counts follow), then n counts (per row, the tokens the worker sent to the
--       reply stream; none: not checked), then attempt, then the deltas to write first (JSON,
--       as reply.lua's)
-- Returns 1 (committed), 2 (acknowledged; the request was final already), 0 (fenced), or
-- {row, next index, ...} when the reply stream holds fewer tokens of a row than were sent (a
-- failover lost its tail) or a delta was refused past a hole: the final is not written, the
-- worker sends the tokens again from there and commits then.
local n = tonumber(ARGV[13])  -- the rows whose token counts are checked
local attempt = ARGV[14 + n]
-- Read once: is_final's question, the retention, the fencing token, the token counts.
local fields = {'state', 'retain_s', 'attempt', 'entry'}
for row = 0, n - 1 do
  fields[#fields + 1] = 'next:' .. row
end
local got = redis.call('HMGET', KEYS[2], unpack(fields))
if superseded(got[3], got[4], attempt, ARGV[3]) then
  return 0
end
local known = {state = got[1], retain_s = got[2], attempt = got[3]}
for row = 0, n - 1 do
  known['next:' .. row] = tonumber(got[row + 5]) or 0
end
local deltas = {}
for i = 15 + n, #ARGV do
  deltas[#deltas + 1] = ARGV[i]
end
local gaps, moved = write_deltas(KEYS[2], KEYS[3], ARGV[12] == '1', deltas, known)
if #gaps == 0 and known.state and not is_final_state(known.state) then
  for row = 0, n - 1 do  -- a status without its tail, not yet final: short of the tokens sent?
    if known['next:' .. row] < tonumber(ARGV[14 + row]) then
      gaps[#gaps + 1] = row
      gaps[#gaps + 1] = known['next:' .. row]
    end
  end
end
if #gaps > 0 then  -- no final: the deltas written keep their counts, and the stream its TTL
  if #moved > 0 then
    redis.call('HSET', KEYS[2], unpack(moved))
  end
  redis.call('EXPIRE', KEYS[3], ARGV[8])
  return gaps
end
-- (the counts need no writing: the final drops them)
local written = write_final(KEYS[2], KEYS[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10],
                           tonumber(ARGV[11]), {known.state, known.retain_s})
ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
if written then
  return 1
end
return 2
