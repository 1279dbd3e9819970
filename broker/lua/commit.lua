-- Commit a result: if this consumer still owns the entry, write the final event and the
-- status (unless the request is final already), acknowledge and delete the entry, and
-- announce it, all at once. Otherwise it has been fenced out and writes nothing.
-- KEYS: stream, status, reply
-- ARGV: group, consumer, entry_id, state, final_json, now, result_ttl, reply_ttl,
--       done_channel, rid, rows (the request's row count), streamed... (optional: per row, the
--       tokens the worker sent to the reply stream)
-- Returns 1 (committed), 2 (acknowledged; the request was final already), 0 (fenced), or
-- {row, next index, ...} when the reply stream holds fewer tokens of a row than were sent (a
-- failover lost its tail): nothing is written, the worker sends them again and commits then.
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 0
end
local known = nil  -- {state, retain_s}, when read here with the token counts
if #ARGV > 11 then
  local fields = {'state', 'retain_s'}
  for i = 12, #ARGV do
    fields[#fields + 1] = 'next:' .. (i - 12)
  end
  known = redis.call('HMGET', KEYS[2], unpack(fields))
  local short = {}
  if known[1] and not is_final_state(known[1]) then  -- a status without its tail, not yet final
    for i = 12, #ARGV do
      local next_index = tonumber(known[i - 9]) or 0
      if next_index < tonumber(ARGV[i]) then
        short[#short + 1] = i - 12
        short[#short + 1] = next_index
      end
    end
  end
  if #short > 0 then
    return short
  end
end
local written = write_final(KEYS[2], KEYS[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10],
                           tonumber(ARGV[11]), known)
ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
if written then
  return 1
end
return 2
