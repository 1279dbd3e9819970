-- Admit one request: refuse when the model's stream already holds max_queued entries
-- (waiting plus pending: entries are deleted once acknowledged), else enqueue it and
-- create its status hash, in one step. Idempotent on the request id: a script re-run by a
-- client retrying through a dropped connection finds the status hash and enqueues nothing.
-- KEYS: stream, status   ARGV: max_queued, rid, data, status_ttl, now, model, lane, owner ('' for none)
-- Returns the entry id (the first one on a re-run), or false when the bound refuses it.
if redis.call('EXISTS', KEYS[2]) == 1 then
  return redis.call('HGET', KEYS[2], 'entry')
end
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  return false
end
local entry = redis.call('XADD', KEYS[1], '*', 'id', ARGV[2], 'data', ARGV[3])
redis.call('HSET', KEYS[2], 'state', 'queued', 'model', ARGV[6], 'enqueued_at', ARGV[5],
           'lane', ARGV[7], 'entry', entry, 'stream', KEYS[1])
if ARGV[8] ~= '' then
  redis.call('HSET', KEYS[2], 'owner', ARGV[8])
end
redis.call('EXPIRE', KEYS[2], ARGV[4])
return entry
