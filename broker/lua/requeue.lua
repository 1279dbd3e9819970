-- Put a dead letter back on its stream (`sluice dlq retry`): within the stream's bound, as
-- a new entry that becomes the request's current one, with its old reply stream cleared
-- and no charges, and remove it from the dead-letter stream, all at once.
-- The bound is admit.lua's: both lanes together within max_queued, this lane within lane_max.
-- KEYS: stream, status, reply, dlq, the other lane's stream
-- ARGV: max_queued, rid, data, now, status_ttl, dlq_entry_id, lane_max
-- Returns the new entry id, or false when the bound refuses it.
local here = redis.call('XLEN', KEYS[1])
if here + redis.call('XLEN', KEYS[5]) >= tonumber(ARGV[1]) or here >= tonumber(ARGV[7]) then
  return false
end
local entry = redis.call('XADD', KEYS[1], '*', 'id', ARGV[2], 'data', ARGV[3])
redis.call('DEL', KEYS[3])
redis.call('HDEL', KEYS[2], 'result', 'finished_at', 'started_at', 'worker', 'charges', 'attempt', 'fence')
for _, field in ipairs(redis.call('HKEYS', KEYS[2])) do
  if string.sub(field, 1, 5) == 'next:' then  -- reply.lua's token counts of the cleared stream
    redis.call('HDEL', KEYS[2], field)
  end
end
redis.call('HSET', KEYS[2], 'state', 'queued', 'enqueued_at', ARGV[4], 'entry', entry, 'stream', KEYS[1])
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('XDEL', KEYS[4], ARGV[6])
return entry
