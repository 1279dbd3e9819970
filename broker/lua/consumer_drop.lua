-- Remove a dead worker's consumer from the group on every stream of its model, but only if
-- no live worker holds its name (the name's lock expired) and it holds no pending entry on
-- any of them: deleting a consumer drops its pending entries, which must be reclaimed first.
-- KEYS: consumer lock, streams...   ARGV: group, consumer
-- Returns 1 when removed, 0 when it stays.
local name_lock = KEYS[1]
local FIRST_STREAM = 2  -- KEYS[2...]: the streams
local group, consumer = ARGV[1], ARGV[2]

if redis.call('EXISTS', name_lock) == 1 then
  return 0
end
for i = FIRST_STREAM, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 and
      #redis.call('XPENDING', KEYS[i], group, '-', '+', 1, consumer) > 0 then
    return 0
  end
end
for i = FIRST_STREAM, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[i], group, consumer)
  end
end
return 1
