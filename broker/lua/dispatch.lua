-- Fair share (docs/delivery.md): move up to `count` staged entries onto the lane stream, each
-- from the backlogged tenant with the smallest virtual token counter, charging that tenant the
-- entry's cost; then read for this consumer (XREADGROUP `>`, non-blocking), as the fetch did
-- before. Only as many are moved as the read can take beside the entries already waiting on
-- the lane (admitted straight onto it while nothing waited): nothing is moved that no worker
-- can start, so the order stays open to later arrivals of other tenants until a slot frees.
-- Each moved request's status names its new entry and stream (when it still names the staged
-- one), so cancel, expiry and start find it where it is. A moved entry keeps its fields (id,
-- data, tenant): from here on it is an ordinary lane entry (leases, reclaim, fencing, commit).
-- KEYS: the lane stream
-- ARGV: consumer, count
-- Returns XREADGROUP's answer (false when nothing was read).
local stream = KEYS[1]
local consumer, count = ARGV[1], tonumber(ARGV[2])
local tag, backlog = tag_of(stream), backlog_key(stream)
local vtc = tag .. ':vtc:' .. lane_of(stream)

local function undelivered()
  local len = redis.call('XLEN', stream)
  if len == 0 then
    return 0
  end
  return len - tonumber(redis.call('XPENDING', stream, GROUP)[1])
end

local room = count - undelivered()
while room > 0 do
  local low = redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES')
  if #low == 0 then
    break
  end
  local tenant, counter = low[1], tonumber(low[2])
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
    room = room - 1
  end
end
redis.call('EXPIRE', vtc, VTC_TTL_S)
return redis.call('XREADGROUP', 'GROUP', GROUP, consumer, 'COUNT', count, 'STREAMS', stream, '>')
