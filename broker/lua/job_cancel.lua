-- Cancel a batch. One that is being run becomes `cancelling`, and its runner ends it
-- `cancelled` with the output of what finished; one that no runner has started (validating,
-- no lock) is `cancelled` at once. A batch finalizing or final keeps its status, which is the
-- answer: its runner no longer looks for a cancel, so `cancelling` would never end. A batch
-- with the `hook` mark appends the event of a cancel at once to its outbox (as job_move.lua).
-- KEYS: batch, lock   ARGV: now, retention (s) of a batch cancelled at once
-- Returns the batch's status afterwards (false for no such batch).
local batch, lock = KEYS[1], KEYS[2]
local now, retention = ARGV[1], ARGV[2]

local status = redis.call('HGET', batch, 'status')
if status ~= 'validating' and status ~= 'in_progress' then
  return status
end
if status == 'validating' and redis.call('EXISTS', lock) == 0 then
  redis.call('HSET', batch, 'status', 'cancelled', 'cancelling_at', now, 'cancelled_at', now)
  redis.call('EXPIRE', batch, retention)
  local got = redis.call('HMGET', batch, 'hook', 'owner', 'id')
  if got[1] then
    local outbox = batch_outbox(lock)
    redis.call('XADD', outbox, 'MAXLEN', '~', OUTBOX_MAX_LEN, '*', 'id', got[3], 'state', 'cancelled',
               'owner', got[2] or '', 'at', now)
    redis.call('EXPIRE', outbox, retention)
  end
  return 'cancelled'
end
redis.call('HSET', batch, 'status', 'cancelling', 'cancelling_at', now)
return 'cancelling'
