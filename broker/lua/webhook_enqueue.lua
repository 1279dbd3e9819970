-- Webhooks: an outbox event's deliveries, one per endpoint that wants it, created at once and
-- leased to the sender that read the event (due again, to any sender, when the lease ends).
-- Idempotent: a delivery that exists already (the event read again after a sender died before
-- acknowledging it) is left as it is. Every key is in the `{webhooks}` slot.
-- KEYS: due, then one delivery hash per delivery
-- ARGV: lease_until, now, then endpoint, event_id, body for each delivery
-- Returns the ids (the delivery hash keys) of the deliveries created.
local due, lease_until, now = KEYS[1], ARGV[1], ARGV[2]
local created = {}
for i = 2, #KEYS do  -- the delivery KEYS[i] takes the i - 1th triple of ARGV (from the third)
  local key, at = KEYS[i], 3 * (i - 2) + 3
  if redis.call('EXISTS', key) == 0 then
    redis.call('HSET', key, 'endpoint', ARGV[at], 'event_id', ARGV[at + 1], 'body', ARGV[at + 2],
               'attempts', 0, 'first_at', now)
    redis.call('ZADD', due, lease_until, key)
    created[#created + 1] = key
  end
end
return created
