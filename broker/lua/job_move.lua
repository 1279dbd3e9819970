-- Move a batch to a new status when its status is one of the expected ones, stamping
-- `<status>_at` and setting the fields that go with the move. A runner's move names its lock
-- token and happens only while the runner holds the job's lock, so a runner that lost the
-- lock changes nothing; the api's moves name no token. A move to a final status (BATCH_FINAL,
-- from protocol/states.py) starts the batch's retention, and the short one of what only a
-- runner needed (its rows' ids and output records: the output file has them), kept as long as
-- any request's result. A batch created with the `hook` mark (its owner had a webhook endpoint)
-- appends its final's event to its own outbox, in its slot (broker/webhooks/outbox.py batch_outbox).
-- KEYS: batch, lock, out, rids
-- ARGV: to, expected statuses (space-separated), token ('' for none), now, retention (s),
--       result retention (s), then field, value pairs
-- Returns {1, to} when moved; {0, status} when the status is not an expected one ('' for no
-- such batch); {-1, status} when the token does not hold the lock.
local batch, lock, out, rids = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local to, expected_statuses, token, now = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local retention, result_retention = ARGV[5], ARGV[6]
local FIRST_FIELD = 7  -- ARGV[7...]: field, value pairs

local got = redis.call('HMGET', batch, 'status', 'hook', 'owner')
local status = got[1] or ''
if token ~= '' and not holds_lock(lock, token) then
  return {-1, status}
end
local expected = false
for s in string.gmatch(expected_statuses, '%S+') do
  if s == status then
    expected = true
  end
end
if not expected then
  return {0, status}
end
redis.call('HSET', batch, 'status', to, to .. '_at', now)
for i = FIRST_FIELD, #ARGV, 2 do
  redis.call('HSET', batch, ARGV[i], ARGV[i + 1])
end
if BATCH_FINAL[to] then
  redis.call('EXPIRE', batch, retention)
  redis.call('EXPIRE', out, result_retention)
  redis.call('EXPIRE', rids, result_retention)
  if got[2] then
    local outbox = batch_outbox(lock)
    redis.call('XADD', outbox, 'MAXLEN', '~', OUTBOX_MAX_LEN, '*', 'id', redis.call('HGET', batch, 'id'),
               'state', to, 'owner', got[3] or '', 'at', now)
    redis.call('EXPIRE', outbox, retention)
  end
end
return {1, to}
