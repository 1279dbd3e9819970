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
-- lane: admitted within ACTIVE_S), while more than one is active: a light tenant's request
-- then starts at once instead of waiting for a heavy tenant's to end (no request is ever
-- preempted). With one tenant active it takes every slot.
-- Prefix affinity (docs/prefix-affinity.md; `wait_ms` given, the interactive lane, more than one
-- live worker): which staged entry of a tenant is moved, and when, follows the entry's prefix
-- `group`. Of a tenant's first `window` staged entries the oldest is moved that (1) has no group
-- or belongs to this worker, else (2) ranks this worker next after its owners while they have no
-- free slot, else (3) has waited wait_ms, else, when this worker runs nothing, (4) belongs to
-- owners with no free slot. A tenant with none passes its turn to the
-- next by counter; when no tenant has one nothing is moved, and the answer says when the first
-- looked-at entry falls due. The worker's free slots and the time go into `<tag>:aff:slots`
-- (who is live, and how free); the owners are `<tag>:aff:owners` (broker/delivery/affinity.py), else a
-- group's rank-1 live worker by rendezvous hashing (the highest sha1 of `group|worker`).
-- KEYS: the lane stream
-- ARGV: consumer, count, reserve, capacity, now, wait_ms ('' : affinity off), live_ms, window,
--       then tenant, running pairs (what this worker runs, by tenant)
-- Returns XREADGROUP's answer (false when nothing was read); with affinity asked for,
-- {the wake stream's last id, ms until a looked-at entry falls due (-1: none), the answer or {}}.
local stream = KEYS[1]
local consumer, count, reserve = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local capacity, now = tonumber(ARGV[4]), tonumber(ARGV[5])
local asked = ARGV[6] ~= '' and is_interactive(stream)
local wait_ms, live_ms, window = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local FIRST_RUNNING = 9  -- ARGV[9 ...]: tenant, running pairs
local running = {}
for i = FIRST_RUNNING, #ARGV, 2 do
  running[ARGV[i]] = tonumber(ARGV[i + 1])
end
local tag, backlog = tag_of(stream), backlog_key(stream)
local vtc = tag .. SUFFIX.counters .. lane_of(stream)

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

-- The backlogged tenants that may be served next, in turn, with their counters: by smallest
-- counter; within the reserve, only those running fewer than their part of this worker (its
-- weight's part of the capacity, among the active tenants). `limit`: how many are wanted
-- (without affinity, the first is served or nobody).
local function next_tenants(room, limit)
  local within = room <= reserve and active_tenants() > 1
  local all = redis.call('ZRANGE', backlog, 0, (not within and limit == 1) and 0 or -1, 'WITHSCORES')
  local out = {}
  for i = 1, #all, 2 do
    if not within or (running[all[i]] or 0) < capacity * (weights[all[i]] or 0) / total then
      out[#out + 1] = {all[i], tonumber(all[i + 1])}
      if #out >= limit then
        break
      end
    end
  end
  return out
end

-- Prefix affinity: the live workers (seen within live_ms) and their free slots.
local aff, clock, live, free_of = false, 0, {}, {}
local slots, wake = tag .. SUFFIX.affinity_slots, tag .. SUFFIX.affinity_wake
if asked then
  clock = now_ms()
  redis.call('HSET', slots, consumer, count .. '|' .. clock)
  redis.call('PEXPIRE', slots, 3 * live_ms)
  local all = redis.call('HGETALL', slots)
  for i = 1, #all, 2 do
    local free, seen = slots_field(all[i + 1])
    if free and tonumber(seen) >= clock - live_ms then
      live[#live + 1] = all[i]
      free_of[all[i]] = free
    end
  end
  aff = #live > 1
end

local ranked, owned = {}, {}
local function ranks(group)  -- the live workers by rendezvous rank for `group`, best first
  if not ranked[group] then
    local scored = {}
    for _, w in ipairs(live) do
      scored[#scored + 1] = {redis.sha1hex(group .. '|' .. w), w}
    end
    table.sort(scored, function(a, b) return a[1] > b[1] end)
    local r = {}
    for i, s in ipairs(scored) do
      r[i] = s[2]
    end
    ranked[group] = r
  end
  return ranked[group]
end
local function owners(group)  -- its live owners in the table, else its rank-1 live worker
  if not owned[group] then
    local o = {}
    for w in string.gmatch(redis.call('HGET', tag .. SUFFIX.affinity_owners, group) or '', '[^,]+') do
      if free_of[w] then
        o[#o + 1] = w
      end
    end
    owned[group] = #o > 0 and o or {ranks(group)[1]}
  end
  return owned[group]
end
-- How much this worker wants a staged entry (1 best .. 4; nil: not now, and the ms until it is
-- due).
local function preference(id, group)
  if not group or group == '' then
    return 1
  end
  local o, most = owners(group), 0
  for _, w in ipairs(o) do
    if w == consumer then
      return 1
    end
    most = math.max(most, free_of[w])
  end
  local r = ranks(group)
  for i = 1, math.min(#o + 1, #r) do
    if r[i] == consumer and most <= 0 then
      return 2
    end
  end
  local age = clock - tonumber(string.match(id, '^(%d+)'))
  if age >= wait_ms then
    return 3
  end
  if count >= capacity and most <= 0 then
    return 4
  end
  return nil, wait_ms - age
end
local due = -1  -- ms until the first looked-at entry falls due
-- The staged entry of `staged` this worker moves now (its id and fields), or nil.
local function preferred(staged)
  local best, best_rank = nil, 5
  for _, e in ipairs(redis.call('XRANGE', staged, '-', '+', 'COUNT', window)) do
    local group = nil
    for i = 1, #e[2], 2 do
      if e[2][i] == 'group' then
        group = e[2][i + 1]
      end
    end
    local rank, left = preference(e[1], group)
    if rank == 1 then
      return e
    elseif rank and rank < best_rank then
      best, best_rank = e, rank
    elseif not rank and (due < 0 or left < due) then
      due = left
    end
  end
  return best
end

-- The next entry to move: its tenant, that tenant's counter and the staged entry (nil: none).
local function choose(room)
  if not aff then  -- the smallest counter's oldest entry
    local low = next_tenants(room, 1)[1]
    if not low then
      return nil
    end
    local first = redis.call('XRANGE', staged_key(stream, low[1]), '-', '+', 'COUNT', 1)
    return low[1], low[2], first[1] or false
  end
  for _, t in ipairs(next_tenants(room, math.huge)) do
    local staged = staged_key(stream, t[1])
    local e = preferred(staged)
    if e then
      return t[1], t[2], e
    end
    unstage_if_empty(staged)
  end
  return nil
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
  local tenant, counter, first = choose(room)
  if not tenant then
    break
  end
  local staged = staged_key(stream, tenant)
  if not first then  -- emptied meanwhile (a cancel, an expiry)
    unstage_if_empty(staged)
  else
    local staged_id, fields = first[1], first[2]
    local f = {}
    for i = 1, #fields, 2 do
      f[fields[i]] = fields[i + 1]
    end
    local entry = redis.call('XADD', stream, '*', 'id', f.id, 'data', f.data, 'tenant', tenant)
    redis.call('XDEL', staged, staged_id)  -- still counted: the tenant holds it on the lane now
    local status = tag .. SUFFIX.status .. f.id
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
local read = redis.call('XREADGROUP', 'GROUP', GROUP, consumer, 'COUNT', count, 'STREAMS', stream, '>')
if not asked then
  return read
end
local taken = read and #read[1][2] or 0
redis.call('HSET', slots, consumer, (count - taken) .. '|' .. clock)
local last = redis.call('XREVRANGE', wake, '+', '-', 'COUNT', 1)
return {last[1] and last[1][1] or '0-0', due, read or {}}
