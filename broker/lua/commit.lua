-- Commit a result: unless the worker was fenced out (see fenced in _lib.lua: a later start holds
-- the request now, or its status is gone), write the request's last token deltas (those not
-- flushed yet ride on the commit: one call, not a flush and then a commit), the final event and
-- the status (unless the request is final already), acknowledge and delete the entry, and
-- announce it, all at once. Otherwise it has been fenced out and writes nothing.
-- A worker placing by prefix (docs/prefix-affinity.md) counts one more free slot in
-- `<tag>:aff:slots` at its commit: the request a client sends on seeing this final must find
-- its owner free, not full until the owner's next fetch says otherwise.
-- KEYS: stream, status, reply
-- ARGV: group, consumer, entry_id, state, final_json, now, result_ttl, reply_ttl,
--       done_channel, rid, rows (the request's row count), n (how many counts follow), then n
--       counts (per row, the tokens the worker sent to the reply stream; none: not checked),
--       then fence (the worker's fencing token), then the deltas to write first (JSON, as
--       reply.lua's)
-- Returns 1 (committed), 2 (acknowledged; the request was final already), 0 (fenced), or
-- {row, next index, ...} when the reply stream holds fewer tokens of a row than were sent (a
-- failover lost its tail) or a delta was refused past a hole: the final is not written, the
-- worker sends the tokens again from there and commits then. A commit never goes through
-- over a hole.
local stream, status, reply = KEYS[1], KEYS[2], KEYS[3]
local group, consumer, entry_id, state, final, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local result_ttl, reply_ttl, done_channel, rid = ARGV[7], ARGV[8], ARGV[9], ARGV[10]
local rows, n = tonumber(ARGV[11]), tonumber(ARGV[12])
local COUNTS = 13  -- ARGV[13 .. 12 + n]: the counts
local fence = ARGV[COUNTS + n]
local FIRST_DELTA = COUNTS + n + 1

-- Read once: is_final's question, the retention, the fencing token, the token counts.
local fields = {'state', 'retain_s', 'attempt', 'fence', 'hook'}  -- hook: the webhook mark (write_final)
for row = 0, n - 1 do
  fields[#fields + 1] = 'next:' .. row
end
local got = redis.call('HMGET', status, unpack(fields))
if fenced(got[4], fence) then
  return 0
end
local known = {state = got[1], retain_s = got[2], attempt = got[3]}
for row = 0, n - 1 do
  known['next:' .. row] = tonumber(got[row + 6]) or 0
end
local deltas = {}
for i = FIRST_DELTA, #ARGV do
  deltas[#deltas + 1] = ARGV[i]
end
local gaps, moved = write_deltas(status, reply, deltas, known)
if #gaps == 0 and known.state and not is_final_state(known.state) then
  for row = 0, n - 1 do  -- a status without its tail, not yet final: short of the tokens sent?
    if known['next:' .. row] < tonumber(ARGV[COUNTS + row]) then
      gaps[#gaps + 1] = row
      gaps[#gaps + 1] = known['next:' .. row]
    end
  end
end
if #gaps > 0 then  -- no final: the deltas written keep their counts, and the stream its TTL
  if #moved > 0 then
    redis.call('HSET', status, unpack(moved))
  end
  -- (never the short after-final TTL: a retry resumes from the stream; a stream these deltas
  -- created lives as long as its status)
  if redis.call('TTL', reply) == -1 then
    redis.call('EXPIRE', reply, math.max(redis.call('TTL', status), 1))
  end
  return gaps
end
-- (the counts need no writing: the final drops them)
local written = write_final(status, reply, state, final, now, result_ttl, reply_ttl, done_channel, rid,
                            rows, {known.state, known.retain_s, got[5]})
ack_and_delete(stream, group, entry_id)
local slots = tag_of(stream) .. SUFFIX.affinity_slots
local free, seen = slots_field(redis.call('HGET', slots, consumer))
if free then
  redis.call('HSET', slots, consumer, (free + 1) .. '|' .. seen)
end
if written then
  return 1
end
return 2
