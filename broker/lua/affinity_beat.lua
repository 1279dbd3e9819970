-- Prefix affinity (docs/prefix-affinity.md): a worker's heartbeat records its free slots and
-- the time (Redis' clock) in the shard's slots hash, which says which workers are live (seen
-- within live_ms) and how free; fields of workers not seen within live_ms are dropped. Once per
-- interval (a lock under the tag, so one worker of the shard does it) it hands the caller what
-- the owners are recomputed from: the live workers, the groups requested since the last time
-- (counted by admit.lua, decayed here), the current owners and the groups' prompt sizes.
-- KEYS: the interactive lane stream (its tag names the affinity keys)
-- ARGV: consumer, free (-1: the worker leaves), live_ms, interval_ms (0: no recompute)
-- Returns {live workers, {group, count, ...}, {group, owners, ...}, {group, prompt tokens, ...}}
-- when this call is the interval's recompute, else false.
local tag = tag_of(KEYS[1])
local slots, groups = tag .. SUFFIX.affinity_slots, tag .. SUFFIX.affinity_groups
local owners = tag .. SUFFIX.affinity_owners
local sizes, lock = tag .. SUFFIX.affinity_sizes, tag .. SUFFIX.affinity_lock
local consumer, free, live_ms, interval_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
if free < 0 then
  redis.call('HDEL', slots, consumer)
  return false
end
redis.call('HSET', slots, consumer, free .. '|' .. now)
redis.call('PEXPIRE', slots, 3 * live_ms)
local live, all = {}, redis.call('HGETALL', slots)
for i = 1, #all, 2 do
  local _, seen = slots_field(all[i + 1])
  seen = tonumber(seen or '0')
  if seen < now - live_ms then
    redis.call('HDEL', slots, all[i])
  else
    live[#live + 1] = all[i]
  end
end
if interval_ms <= 0 or not redis.call('SET', lock, consumer, 'NX', 'PX', interval_ms) then
  return false
end
-- The counts decay by COUNT_DECAY at each recompute (halved every 8 intervals: a moving sum
-- over about 12), so that owners follow traffic without being drawn from a few intervals'
-- handful of requests; a count under 0.25 is dropped (one request is forgotten in 16 intervals).
local counts = redis.call('HGETALL', groups)
for i = 1, #counts, 2 do
  local left = tonumber(counts[i + 1]) * COUNT_DECAY
  if left < 0.25 then
    redis.call('HDEL', groups, counts[i])
    redis.call('HDEL', sizes, counts[i])
  else
    redis.call('HSET', groups, counts[i], left)
  end
end
return {live, counts, redis.call('HGETALL', owners), redis.call('HGETALL', sizes)}
