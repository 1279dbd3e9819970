-- Keep a job's lock for another TTL, only for the runner that holds it.
-- KEYS: lock   ARGV: token, ttl_ms
-- Returns 1 when refreshed, 0 when the lock has lapsed or another runner holds it.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
