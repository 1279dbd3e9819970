-- Admit one request: refuse when the model's stream already holds max_queued entries
-- (waiting plus pending: entries are deleted once acknowledged), else enqueue it and
-- create its status hash, in one step.
-- KEYS: stream, status   ARGV: max_queued, rid, data, status_ttl, now, model, lane
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  return false
end
local entry = redis.call('XADD', KEYS[1], '*', 'id', ARGV[2], 'data', ARGV[3])
redis.call('HSET', KEYS[2], 'state', 'queued', 'model', ARGV[6], 'enqueued_at', ARGV[5],
           'lane', ARGV[7], 'entry', entry, 'stream', KEYS[1])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return entry
