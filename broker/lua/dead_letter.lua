-- Move an entry that has used up its deliveries (or cannot be read at all) to the
-- dead-letter stream (copy first, then acknowledge and delete), and tell its client it
-- failed. A request that is final already (cancelled, say) is only acknowledged: it is
-- neither copied nor given a second final, so `dlq retry` can never run it again.
-- KEYS: stream, dlq, status, reply
-- ARGV: group, consumer, entry_id, rid, data, error, attempts, now, result_ttl, reply_ttl,
--       done_channel, dlq_max_len
-- Returns 1 (dead-lettered), 2 (acknowledged; final already), 0 (fenced).
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 0
end
if is_final(KEYS[3]) then
  ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
  return 2
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[12], '*', 'id', ARGV[4], 'data', ARGV[5], 'error', ARGV[6],
           'attempts', ARGV[7], 'stream', KEYS[1], 'failed_at', ARGV[8])
ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
if redis.call('EXISTS', KEYS[3]) == 0 then
  -- the status hash expired or was lost: the final still reaches readers of the reply stream
  redis.call('HSET', KEYS[3], 'state', 'queued')
end
write_final(KEYS[3], KEYS[4], 'failed', bare_final(KEYS[3], 'failed', ARGV[6], tonumber(ARGV[7]), ARGV[8]),
            ARGV[8], ARGV[9], ARGV[10], ARGV[11], ARGV[4])
return 1
