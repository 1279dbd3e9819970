-- Write one field of a job once (a line's request id, a line's output record) and count it,
-- in one step and only while the runner holds the job's lock: a runner that lost the lock
-- writes nothing, and a record is never kept without its count.
-- The hash lives as long as its batch could (ttl): a job never resumed leaves nothing forever.
-- KEYS: lock, hash, batch   ARGV: token, field, value, ttl (s), then counter, increment pairs
-- Returns 1 when written, 0 when the field was already set, -1 when the token does not hold
-- the lock.
local lock, hash, batch = KEYS[1], KEYS[2], KEYS[3]
local token, field, value, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local FIRST_COUNTER = 5  -- ARGV[5...]: counter, increment pairs

if not holds_lock(lock, token) then
  return -1
end
if redis.call('HSETNX', hash, field, value) == 0 then
  return 0
end
redis.call('EXPIRE', hash, ttl)
for i = FIRST_COUNTER, #ARGV, 2 do
  redis.call('HINCRBY', batch, ARGV[i], ARGV[i + 1])
end
return 1
