-- Fair share: correct a tenant's virtual token counter once its request is done. Admission (or
-- dispatch.lua) charged the expected cost (prompt tokens, estimated, plus twice max_tokens,
-- over the tenant's weight: the status's `charged`); the final knows the real one. Once per
-- request: the status's `charged` is dropped as it is settled. A lost settle only skews the
-- order of later dispatches, never a request's delivery.
-- KEYS: status
-- ARGV: actual cost in tokens (prompt tokens + 2 x output tokens), stream (the lane the request ran on)
-- Returns the correction made (0: none).
local status = KEYS[1]
local actual, stream = tonumber(ARGV[1]), ARGV[2]
local got = redis.call('HMGET', status, 'charged', 'weight', 'tenant')
if not got[1] or not got[3] then
  return 0
end
redis.call('HDEL', status, 'charged')
local delta = actual / (tonumber(got[2]) or 1) - tonumber(got[1])
local vtc = tag_of(stream) .. SUFFIX.counters .. lane_of(stream)
if redis.call('HEXISTS', vtc, got[3]) == 0 then
  return 0
end
local counter = tonumber(redis.call('HINCRBYFLOAT', vtc, got[3], delta))
local backlog = backlog_key(stream)
if redis.call('ZSCORE', backlog, got[3]) then
  redis.call('ZADD', backlog, counter, got[3])
end
return tostring(delta)
