-- Move an entry that has used up its deliveries to the dead-letter stream (copy first,
-- then acknowledge and delete), and tell its client it failed.
-- KEYS: stream, dlq, status, reply
-- ARGV: group, consumer, entry_id, rid, data, error, attempts, now, status_ttl, reply_ttl,
--       done_channel
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 0
end
redis.call('XADD', KEYS[2], '*', 'id', ARGV[4], 'data', ARGV[5], 'error', ARGV[6],
           'attempts', ARGV[7], 'stream', KEYS[1], 'failed_at', ARGV[8])
ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
write_final(KEYS[3], KEYS[4], 'failed', bare_final(KEYS[3], 'failed', ARGV[6], tonumber(ARGV[7]), ARGV[8]),
            ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[4])
return 1
