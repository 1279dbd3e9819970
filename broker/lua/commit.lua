-- Commit a result: if this consumer still owns the entry, write the final event and the
-- status (unless the request is final already), acknowledge and delete the entry, and
-- announce it, all at once. Otherwise it has been fenced out and writes nothing.
-- KEYS: stream, status, reply
-- ARGV: group, consumer, entry_id, state, final_json, now, result_ttl, reply_ttl,
--       done_channel, rid, rows (the request's row count)
-- Returns 1 (committed), 2 (acknowledged; the request was final already), 0 (fenced).
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 0
end
local written = write_final(KEYS[2], KEYS[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10],
                           tonumber(ARGV[11]))
ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
if written then
  return 1
end
return 2
