-- Release a job's lock, only by the runner that holds it.
-- KEYS: lock   ARGV: token
-- Returns 1 when released, 0 when the lock was not this runner's.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
