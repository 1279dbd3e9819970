-- Move a batch to a new status when its status is one of the expected ones, stamping
-- `<status>_at` and setting the fields that go with the move. A runner's move names its lock
-- token and happens only while the runner holds the job's lock, so a runner that lost the
-- lock changes nothing; the api's moves name no token. A move to a final status starts the
-- batch's retention, and the short one of what only a runner needed (its rows' ids and output
-- records: the output file has them), kept as long as any request's result.
-- KEYS: batch, lock, out, rids
-- ARGV: to, expected statuses (space-separated), token ('' for none), now, retention (s),
--       result retention (s), then field, value pairs
-- Returns {1, to} when moved; {0, status} when the status is not an expected one ('' for no
-- such batch); {-1, status} when the token does not hold the lock.
local status = redis.call('HGET', KEYS[1], 'status') or ''
if ARGV[3] ~= '' and redis.call('GET', KEYS[2]) ~= ARGV[3] then
  return {-1, status}
end
local expected = false
for s in string.gmatch(ARGV[2], '%S+') do
  if s == status then
    expected = true
  end
end
if not expected then
  return {0, status}
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[4])
for i = 7, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
if BATCH_FINAL[ARGV[1]] then
  redis.call('EXPIRE', KEYS[1], ARGV[5])
  redis.call('EXPIRE', KEYS[3], ARGV[6])
  redis.call('EXPIRE', KEYS[4], ARGV[6])
end
return {1, ARGV[1]}
