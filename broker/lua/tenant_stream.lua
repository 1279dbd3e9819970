-- A tenant's open SSE streams (broker/intake/tenant_streams.py): its set scores each open stream with
-- its lease's expiry (ms, Redis' clock). An api takes a lease as a stream opens, refreshes the
-- leases of its open streams while they are open and removes each as it closes, so the streams
-- of an api that died leave the count once their leases expire. The set expires with its last.
-- KEYS: the tenant's streams set
-- ARGV: lease_ms, limit (0: refresh), then the streams (one to take; those to refresh)
-- Returns 1 (taken, or refreshed) or 0 (the tenant is at its limit).
local key, lease_ms, limit, taken = KEYS[1], tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local now = now_ms()
if limit == 0 then
  for i = 3, #ARGV do
    redis.call('ZADD', key, 'XX', now + lease_ms, ARGV[i])
  end
  redis.call('PEXPIRE', key, lease_ms)
  return 1
end
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
if redis.call('ZCARD', key) >= limit then
  return 0
end
redis.call('ZADD', key, now + lease_ms, taken)
redis.call('PEXPIRE', key, lease_ms)
return 1
