-- Expire an entry past its deadline that no worker will start in time (the housekeeping sweep,
-- broker/delivery/expiry.py: a model without a live worker, or one whose worker died holding it).
-- It decides atomically against start.lua: a queued request gets its `expired` final and its
-- entry is acknowledged and deleted (a worker that fetched it and starts it later finds it final
-- and runs nothing); a running one only when its worker stopped renewing its lease (the entry
-- idle past the lease timeout, as a reclaim would find it: that reclaim's start would expire it
-- too); a worker that still commits it is refused by the final already written.
-- A leftover entry (its request final already, or superseded by another entry) is acknowledged
-- and deleted; one whose status is gone (expired, lost) too: nothing can be told about it.
-- The stream may be a tenant's staging stream (fair share): its entries are all queued.
-- KEYS: stream, status, reply
-- ARGV: group, entry_id, now, deadline, lease_ms, result_ttl, reply_ttl, done_channel, rid
-- Returns 'expired', 'running' (left to its worker), 'early' (not past its deadline), or
-- 'final' / 'duplicate' / 'gone' (a leftover entry, removed).
local stream, status, reply = KEYS[1], KEYS[2], KEYS[3]
local group, entry_id, now, deadline = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease_ms, result_ttl, reply_ttl, channel, rid = tonumber(ARGV[5]), ARGV[6], ARGV[7], ARGV[8], ARGV[9]

local function remove()  -- the group may not exist yet: no worker of the model ever started
  redis.pcall('XACK', stream, group, entry_id)
  delete_entry(stream, entry_id)
end

local known = redis.call('HMGET', status, 'state', 'entry', 'attempt')
if not known[1] then
  remove()
  return 'gone'
end
if is_final_state(known[1]) then
  remove()
  return 'final'
end
if known[2] and known[2] ~= entry_id then
  remove()
  return 'duplicate'
end
if tonumber(now) <= tonumber(deadline) then
  return 'early'
end
if known[1] ~= 'queued' then  -- running: expired only once its worker stopped renewing the lease
  local p = redis.pcall('XPENDING', stream, group, entry_id, entry_id, 1)
  if type(p) == 'table' and p[1] and tonumber(p[1][3]) < lease_ms then
    return 'running'
  end
end
local err = 'the request passed its deadline before it started'
if known[1] ~= 'queued' then
  err = 'the request passed its deadline and its worker was lost'
end
write_final(status, reply, 'expired', bare_final(status, 'expired', err, tonumber(known[3]), now),
            now, result_ttl, reply_ttl, channel, rid)
remove()
return 'expired'
