-- Commit a result: if this consumer still owns the entry, write the final event and the
-- status, acknowledge and delete the entry, and announce it, all at once.
-- Otherwise it has been fenced out and writes nothing.
-- KEYS: stream, status, reply
-- ARGV: group, consumer, entry_id, state, final_json, now, status_ttl, reply_ttl,
--       done_channel, rid
local owner = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #owner == 0 or owner[1][2] ~= ARGV[2] then
  return 0
end
redis.call('XADD', KEYS[3], '*', 'kind', 'final', 'data', ARGV[5])
redis.call('EXPIRE', KEYS[3], ARGV[8])
redis.call('HSET', KEYS[2], 'state', ARGV[4], 'result', ARGV[5], 'finished_at', ARGV[6])
redis.call('EXPIRE', KEYS[2], ARGV[7])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
redis.call('PUBLISH', ARGV[9], ARGV[10])
return 1
