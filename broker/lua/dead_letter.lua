-- Move an entry that has used up its deliveries (or cannot be read at all) to the
-- dead-letter stream (copy first, then acknowledge and delete), and tell its client it
-- failed. A request that is final already (cancelled, say) is only acknowledged: it is
-- neither copied nor given a second final, so `dlq retry` can never run it again.
-- KEYS: stream, dlq, status, reply
-- ARGV: group, consumer, entry_id, rid, data, error, attempts, now, result_ttl, reply_ttl,
--       done_channel, dlq_max_len, then the request's model, lane, owner and enqueued_at
--       ('' where unknown: an entry that cannot be read), then hook ('1' when its owner has a
--       webhook endpoint: a status re-created here keeps the mark, and its final its event)
-- Returns 1 (dead-lettered), 2 (acknowledged; final already), 0 (fenced).
local stream, dlq, status, reply = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, consumer, entry_id, rid, data, err = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local attempts, now, result_ttl, reply_ttl, done_channel = ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11]
local dlq_max_len, model, lane, owner, enqueued_at = ARGV[12], ARGV[13], ARGV[14], ARGV[15], ARGV[16]
local hook = ARGV[17] or ''

if not owns(stream, group, entry_id, consumer) then
  return 0
end
if is_final(status) then
  ack_and_delete(stream, group, entry_id)
  return 2
end
redis.call('XADD', dlq, 'MAXLEN', '~', dlq_max_len, '*', 'id', rid, 'data', data, 'error', err,
           'attempts', attempts, 'stream', stream, 'failed_at', now)
ack_and_delete(stream, group, entry_id)
if redis.call('EXISTS', status) == 0 then
  -- the status hash expired or was lost: the final still reaches readers of the reply stream,
  -- and the status is whole (its owner finds it; `dlq retry` keeps what it says)
  hset_known(status, 'state', 'queued', 'retain_s', result_ttl, 'model', model, 'lane', lane, 'owner', owner,
             'enqueued_at', enqueued_at, 'hook', hook)
end
write_final(status, reply, 'failed', bare_final(status, 'failed', err, tonumber(attempts), now),
            now, result_ttl, reply_ttl, done_channel, rid)
return 1
