-- Webhooks: take up to `count` deliveries that are due (a retry's time came, or the sender that
-- held one died and its lease ended), leasing each to the caller until `lease_until`.
-- KEYS: due   ARGV: now, lease_until, count
-- Returns the deliveries' ids.
local due, now, lease_until, count = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local ids = redis.call('ZRANGEBYSCORE', due, '-inf', now, 'LIMIT', 0, count)
for _, id in ipairs(ids) do
  redis.call('ZADD', due, 'XX', lease_until, id)
end
return ids
