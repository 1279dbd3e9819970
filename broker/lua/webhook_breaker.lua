-- Webhooks: an endpoint's circuit breaker, shared by every sender (one hash per endpoint:
-- `failures` in a row, `open_until`, `probe_until`; it expires `ttl` s after its last change).
-- `check`: whether a delivery may be attempted now. Closed (fewer than `threshold` failures in a
-- row): yes. Open: no, until `open_until`. Past it: one delivery, across all senders, goes first
-- as a probe (`probe_until` = now + probe_s); the others wait for it.
-- `fail`: an attempt failed. While the circuit is open, only a probe's failure counts (attempts
-- begun before it opened do not stretch it); at `threshold` failures and at each further one,
-- it opens for base_s x 2^(failures - threshold), at most max_s.
-- `ok`: an attempt succeeded: the circuit closes (the hash is deleted).
-- KEYS: breaker
-- ARGV: op ('check' | 'fail' | 'ok'), now, threshold, probe_s (check) or was_probe ('1' or '',
--       fail), base_s, max_s, ttl
-- Returns: check: {0, is_probe (1 or 0)} to go, {1, when (string)} to wait until then;
--          fail: the failures in a row now (0: not counted); ok: 0.
local key, op, now = KEYS[1], ARGV[1], tonumber(ARGV[2])
local threshold = tonumber(ARGV[3])
local arg4 = ARGV[4]  -- probe_s (check) or was_probe (fail)
local base_s, max_s, ttl = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
if op == 'ok' then
  redis.call('DEL', key)
  return 0
end
local got = redis.call('HMGET', key, 'failures', 'open_until', 'probe_until')
local failures, open_until, probe_until = tonumber(got[1]) or 0, tonumber(got[2]) or 0, tonumber(got[3]) or 0
if op == 'check' then
  if failures < threshold then
    return {0, 0}
  end
  if now < open_until then
    return {1, tostring(open_until)}
  end
  if now < probe_until then
    return {1, tostring(probe_until)}
  end
  redis.call('HSET', key, 'probe_until', tostring(now + tonumber(arg4)))
  return {0, 1}
end
-- fail
local was_probe = arg4 == '1'
if failures >= threshold and not was_probe then
  return 0
end
failures = failures + 1
if failures >= threshold then
  local wait = math.min(base_s * 2 ^ math.min(failures - threshold, 20), max_s)
  redis.call('HSET', key, 'failures', failures, 'open_until', tostring(now + wait), 'probe_until', 0)
else
  redis.call('HSET', key, 'failures', failures)
end
redis.call('EXPIRE', key, ttl)
return failures
