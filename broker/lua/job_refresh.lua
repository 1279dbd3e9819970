-- Keep a job's lock for another TTL, only for the runner that holds it.
-- KEYS: lock   ARGV: token, ttl_ms
-- Returns 1 when refreshed, 0 when the lock has lapsed or another runner holds it.
local lock = KEYS[1]
local token, ttl_ms = ARGV[1], ARGV[2]

if holds_lock(lock, token) then
  return redis.call('PEXPIRE', lock, ttl_ms)
end
return 0
