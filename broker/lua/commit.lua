-- Commit a result: if this consumer still owns the entry, write the final event and the
-- status, acknowledge and delete the entry, and announce it, all at once.
-- Otherwise it has been fenced out and writes nothing.
-- KEYS: stream, status, reply
-- ARGV: group, consumer, entry_id, state, final_json, now, status_ttl, reply_ttl,
--       done_channel, rid
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 0
end
write_final(KEYS[2], KEYS[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[10])
ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
return 1
