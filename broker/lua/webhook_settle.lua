-- Webhooks: the outcome of one attempt. `ok`: the delivery is done (removed); `retry`: due
-- again at `next_at`, its attempt counted; `later`: due again at `next_at`, no attempt counted
-- (the endpoint was at its concurrency limit); `dead`: past its retry period, moved to the
-- dead-letter list (newest first, capped). A delivery already gone (another sender, whose lease
-- had passed to it, settled it) is left gone. `counted` (delivered, retried, dead, dropped; ''
-- for none) is added to the minute's outcome counts (the dashboard's), kept `counts_ttl` s.
-- KEYS: due, delivery, dead, the minute's outcome counts
-- ARGV: outcome, next_at, error, now, dead_max, counted, counts_ttl
-- Returns 1, or 0 when the delivery was gone.
local due, delivery, dead, counts = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local outcome, next_at, err, now, dead_max = ARGV[1], ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5])
local counted, counts_ttl = ARGV[6], ARGV[7]
if redis.call('EXISTS', delivery) == 0 then
  redis.call('ZREM', due, delivery)
  return 0
end
if counted ~= '' then
  redis.call('HINCRBY', counts, counted, 1)
  redis.call('EXPIRE', counts, counts_ttl)
end
if outcome == 'ok' then
  redis.call('ZREM', due, delivery)
  redis.call('DEL', delivery)
elseif outcome == 'dead' then
  local d = redis.call('HGETALL', delivery)
  local letter = {id = delivery, error = err, dead_at = tonumber(now)}
  for i = 1, #d, 2 do
    letter[d[i]] = d[i + 1]
  end
  redis.call('LPUSH', dead, cjson.encode(letter))
  redis.call('LTRIM', dead, 0, dead_max - 1)
  redis.call('ZREM', due, delivery)
  redis.call('DEL', delivery)
else
  if outcome == 'retry' then
    redis.call('HINCRBY', delivery, 'attempts', 1)
    redis.call('HSET', delivery, 'last_error', err, 'last_at', now)
  end
  redis.call('ZADD', due, next_at, delivery)
end
return 1
