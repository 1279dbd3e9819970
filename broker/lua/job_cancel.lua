-- Cancel a batch. One that is being run becomes `cancelling`, and its runner ends it
-- `cancelled` with the output of what finished; one that no runner has started (validating,
-- no lock) is `cancelled` at once. A batch finalizing or final keeps its status, which is the
-- answer: its runner no longer looks for a cancel, so `cancelling` would never end.
-- KEYS: batch, lock   ARGV: now, retention (s) of a batch cancelled at once
-- Returns the batch's status afterwards (false for no such batch).
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'validating' and status ~= 'in_progress' then
  return status
end
if status == 'validating' and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'cancelling_at', ARGV[1], 'cancelled_at', ARGV[1])
  redis.call('EXPIRE', KEYS[1], ARGV[2])
  return 'cancelled'
end
redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
return 'cancelling'
