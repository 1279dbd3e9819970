-- Release a job's lock, only by the runner that holds it.
-- KEYS: lock   ARGV: token
-- Returns 1 when released, 0 when the lock was not this runner's.
local lock = KEYS[1]
local token = ARGV[1]

if holds_lock(lock, token) then
  return redis.call('DEL', lock)
end
return 0
