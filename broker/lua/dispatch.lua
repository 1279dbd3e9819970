-- Fair share (docs/delivery.md): move up to `count` staged entries onto the lane stream, each
-- from the backlogged tenant with the smallest virtual token counter, charging that tenant the
-- entry's cost; then read for this consumer (XREADGROUP `>`, non-blocking), as the fetch did
-- before. Only as many are moved as the read can take beside the entries already waiting on
-- the lane (admitted straight onto it while nothing waited): nothing is moved that no worker
-- can start, so the order stays open to later arrivals of other tenants until a slot frees.
-- Each moved request's status names its new entry and stream (when it still names the staged
-- one), so cancel, expiry and start find it where it is. A moved entry keeps its fields (id,
-- data, tenant): from here on it is an ordinary lane entry (leases, reclaim, fencing, commit).
-- The tenant reserve: a worker's last `reserve` free slots go only to a tenant running fewer
-- than its part of the worker (the capacity shared by weight among the tenants active on the
-- lane: admitted within ACTIVE_S), while more than one is active: a light tenant's request then starts at once instead
-- of waiting for a heavy tenant's to end (no request is ever preempted). With one tenant active
-- it takes every slot.
-- KEYS: the lane stream
-- ARGV: consumer, count, reserve, capacity, now, then tenant, running pairs (what this worker
--       runs, by tenant)
-- Returns XREADGROUP's answer (false when nothing was read).
local stream = KEYS[1]
local consumer, count, reserve = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local capacity, now = tonumber(ARGV[4]), tonumber(ARGV[5])
local FIRST_RUNNING = 6  -- ARGV[6 ...]: tenant, running pairs
local running = {}
for i = FIRST_RUNNING, #ARGV, 2 do
  running[ARGV[i]] = tonumber(ARGV[i + 1])
end
local tag, backlog = tag_of(stream), backlog_key(stream)
local vtc = tag .. ':vtc:' .. lane_of(stream)

-- The tenants admitted within ACTIVE_S and their weights (`@<tenant>`: its last admission,
-- `~<tenant>`: its weight, both kept by admit.lua), read once, when the reserve is reached.
local active, weights, total = nil, {}, 0
local function active_tenants()
  if active == nil then
    active = 0
    local seen = redis.call('HGETALL', vtc)
    local fields = {}
    for i = 1, #seen, 2 do
      fields[seen[i]] = seen[i + 1]
    end
    for field, value in pairs(fields) do
      if string.sub(field, 1, 1) == '@' and tonumber(value) >= now - ACTIVE_S then
        local tenant = string.sub(field, 2)
        weights[tenant] = tonumber(fields['~' .. tenant]) or 1
        total = total + weights[tenant]
        active = active + 1
      end
    end
  end
  return active
end

-- The backlogged tenant to serve next, with its counter: the smallest counter; within the
-- reserve, the smallest among those running fewer than their part of this worker (its weight's
-- part of the capacity, among the active tenants); none: nil.
local function next_tenant(room)
  if room > reserve or active_tenants() <= 1 then
    local low = redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES')
    return low[1], tonumber(low[2])
  end
  local all = redis.call('ZRANGE', backlog, 0, -1, 'WITHSCORES')
  for i = 1, #all, 2 do
    local part = capacity * (weights[all[i]] or 0) / total
    if (running[all[i]] or 0) < part then
      return all[i], tonumber(all[i + 1])
    end
  end
  return nil, nil
end

local function undelivered()
  local len = redis.call('XLEN', stream)
  if len == 0 then
    return 0
  end
  return len - tonumber(redis.call('XPENDING', stream, GROUP)[1])
end

local room = count - undelivered()
while room > 0 do
  local tenant, counter = next_tenant(room)
  if not tenant then
    break
  end
  local staged = staged_key(stream, tenant)
  local first = redis.call('XRANGE', staged, '-', '+', 'COUNT', 1)
  if #first == 0 then  -- emptied meanwhile (a cancel, an expiry)
    unstage_if_empty(staged)
  else
    local staged_id, fields = first[1][1], first[1][2]
    local f = {}
    for i = 1, #fields, 2 do
      f[fields[i]] = fields[i + 1]
    end
    local entry = redis.call('XADD', stream, '*', 'id', f.id, 'data', f.data, 'tenant', tenant)
    redis.call('XDEL', staged, staged_id)  -- still counted: the tenant holds it on the lane now
    local status = tag .. ':status:' .. f.id
    if redis.call('HGET', status, 'entry') == staged_id then
      redis.call('HSET', status, 'entry', entry, 'stream', stream)
    end
    counter = counter + (tonumber(f.cost) or 0)
    redis.call('HSET', vtc, tenant, counter)
    redis.call('ZADD', backlog, counter, tenant)
    unstage_if_empty(staged)
    running[tenant] = (running[tenant] or 0) + 1
    room = room - 1
  end
end
redis.call('EXPIRE', vtc, VTC_TTL_S)
return redis.call('XREADGROUP', 'GROUP', GROUP, consumer, 'COUNT', count, 'STREAMS', stream, '>')
