-- Move an entry that has used up its deliveries to the dead-letter stream (copy first,
-- then acknowledge and delete), and tell its client it failed.
-- KEYS: stream, dlq, status, reply
-- ARGV: group, consumer, entry_id, rid, data, error, attempts, now, status_ttl, reply_ttl,
--       done_channel
local owner = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #owner == 0 or owner[1][2] ~= ARGV[2] then
  return 0
end
redis.call('XADD', KEYS[2], '*', 'id', ARGV[4], 'data', ARGV[5], 'error', ARGV[6],
           'attempts', ARGV[7], 'stream', KEYS[1], 'failed_at', ARGV[8])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
local final = cjson.encode({status = 'failed', error = ARGV[6], attempt = tonumber(ARGV[7]),
  timings = {enqueued = tonumber(redis.call('HGET', KEYS[3], 'enqueued_at')),
             finished = tonumber(ARGV[8])}})
redis.call('XADD', KEYS[4], '*', 'kind', 'final', 'data', final)
redis.call('EXPIRE', KEYS[4], ARGV[10])
redis.call('HSET', KEYS[3], 'state', 'failed', 'result', final, 'finished_at', ARGV[8])
redis.call('EXPIRE', KEYS[3], ARGV[9])
redis.call('PUBLISH', ARGV[11], ARGV[4])
return 1
