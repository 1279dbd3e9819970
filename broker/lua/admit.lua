-- Admit one request, or several at once (the prompts x n of one completion call: all or
-- none). Refuse when the model's two lanes together would hold more than max_queued entries
-- (waiting plus pending: entries are deleted once acknowledged), or this lane more than its
-- own bound: bulk gets a share of max_queued, so a job can never take interactive's part.
-- Otherwise enqueue each request and create its status hash, in one step. Idempotent on the
-- request ids: a script re-run by a client retrying through a dropped connection finds the
-- first status hash and enqueues nothing.
-- With `keep_s` > 0 (an Idempotency-Key names the request), each request also leaves a mark
-- that it was admitted, kept `keep_s` (as long as the key): a repeat that finds the mark and no
-- status knows the result expired, and never runs the request again under its id; a repeat that
-- finds neither knows this admission never happened (or a failover lost it with its mark).
-- Tenants (docs/delivery.md, "Fair share"): while another tenant has work queued on this shard,
-- a tenant may hold at most share_max entries (staged or on a stream, both lanes); within that
-- share it is admitted even where the model's bounds are reached, up to share_max past them, so
-- one tenant never refuses another. With fair share on, a request goes to its tenant's staging
-- stream whenever work is waiting (the lane has entries no worker has read, or a tenant has
-- staged ones: dispatch.lua moves them onto the lane in fair order); when nothing waits it goes
-- straight onto the lane, and a worker blocked on it wakes at once. Either way the tenant's
-- virtual token counter is charged (here, or by dispatch.lua as it moves the entry).
-- KEYS: stream, the other lane's stream, then one status hash per request, then (keep_s > 0)
--       one admitted mark per request
-- ARGV: max_queued, lane_max, status_ttl, now, model, lane, owner ('' for none), retain_s,
--       keep_s, hook ('1' when the owner has a webhook endpoint: each status carries the mark,
--       and write_final appends its event to the outbox; '' for none), tenant, share_max,
--       fair ('1': fair share on; '' for plain FIFO), weight, then rid, data, cost (its
--       expected tokens over the tenant's weight), group (its prefix group, '' for none),
--       prompt tokens (its prefix_tokens: what its prompt leaves in a prefix cache) for each request
-- Prefix affinity (docs/prefix-affinity.md): while workers of the shard place by prefix (their
-- fetches keep `<tag>:aff:slots`), an interactive request is staged even when nothing waits, so
-- that dispatch.lua places it (with two or more such workers), its group is counted (and its
-- prompt's size noted) for the owners' next recompute, and the call rings the shard's doorbell
-- (`<tag>:aff:wake`, a capped stream) that those workers block on instead of the lane.
-- Returns the entry ids ('' for one final already; the first ones on a re-run), false when
-- the bound refuses them, or 'share' when the tenant's share of it does.
local stream, other = KEYS[1], KEYS[2]
local max_queued, lane_max, status_ttl, now = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4]
local model, lane, owner, retain_s, keep_s = ARGV[5], ARGV[6], ARGV[7], ARGV[8], tonumber(ARGV[9])
local hook, tenant, share_max = ARGV[10], ARGV[11], tonumber(ARGV[12])
local fair, weight = ARGV[13] == '1', ARGV[14]
local n = (#ARGV - 14) / 5
local FIRST_STATUS, FIRST_MARK = 3, 3 + n  -- KEYS[3 .. 2 + n]: statuses; KEYS[3 + n ...]: marks
local function rid_of(i) return ARGV[10 + 5 * i] end  -- ARGV[15...]: rid, data, cost, group, size fives
local function data_of(i) return ARGV[11 + 5 * i] end
local function cost_of(i) return tonumber(ARGV[12 + 5 * i]) end
local function group_of(i) return ARGV[13 + 5 * i] end
local function size_of(i) return ARGV[14 + 5 * i] end

local entries = {}
if redis.call('EXISTS', KEYS[FIRST_STATUS]) == 1 then
  for i = 1, n do
    entries[#entries + 1] = redis.call('HGET', KEYS[FIRST_STATUS + i - 1], 'entry') or ''
  end
  return entries
end
local refused, mine = refusal(stream, other, n, max_queued, lane_max, tenant, share_max)
if refused == 'share' then
  return 'share'
elseif refused then
  return false
end

local backlog, vtc = backlog_key(stream), tag_of(stream) .. SUFFIX.counters .. lane_of(stream)
-- Whether work waits on this lane: a tenant's staged entries, or entries no worker has read
-- (a lane without its group yet: no worker has read any).
local function undelivered()
  local len = redis.call('XLEN', stream)
  if len == 0 then
    return 0
  end
  local pending = redis.pcall('XPENDING', stream, GROUP)
  return pending.err and len or len - tonumber(pending[1])
end
-- Whether the request waits its turn: the lane holds entries no worker has read, or tenants
-- have staged ones, unless this tenant is the one fair share serves first anyway: it has none
-- staged, and either no larger counter than the smallest staged one's or fewer entries (`held`:
-- what it runs, here) than every tenant with staged ones. Then it goes onto the lane, and a
-- worker blocked on it (one keeping its tenant reserve, see dispatch.lua) starts it at once.
local function waiting(held)
  if undelivered() > 0 then
    return true
  end
  local low = redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES')
  if #low == 0 then
    return false
  end
  if redis.call('ZSCORE', backlog, tenant) then
    return true
  end
  if tonumber(redis.call('HGET', vtc, tenant) or '0') <= tonumber(low[2]) then
    return false
  end
  for _, other in ipairs(redis.call('ZRANGE', backlog, 0, -1)) do
    if tonumber(redis.call('HGET', tag_of(stream) .. SUFFIX.held, other) or '0') <= held then
      return true
    end
  end
  return false
end
-- The tenant's counter as it joins the backlog, or is served while nobody waits: lifted to the
-- smallest backlogged tenant's (the floor when none is), so that an idle tenant banks no credit.
local function lifted()
  local own = tonumber(redis.call('HGET', vtc, tenant) or '0')
  local low = redis.call('ZRANGE', backlog, 0, 0, 'WITHSCORES')
  local floor = tonumber(low[2] or redis.call('HGET', vtc, ':floor') or '0')
  return math.max(own, floor)
end

local placing = fair and is_interactive(stream) and
  redis.call('HLEN', tag_of(stream) .. SUFFIX.affinity_slots) or 0
local groups, sizes = tag_of(stream) .. SUFFIX.affinity_groups, tag_of(stream) .. SUFFIX.affinity_sizes
for i = 1, n do
  local status = KEYS[FIRST_STATUS + i - 1]
  local staged, entry = nil, nil
  if fair and (placing > 1 or waiting(mine + i - 1)) then  -- its turn comes by dispatch.lua
    staged = staged_key(stream, tenant)
    entry = redis.call('XADD', staged, '*', 'id', rid_of(i), 'data', data_of(i), 'tenant', tenant,
                       'cost', cost_of(i), 'group', group_of(i))
    local group = group_of(i)
    if placing > 1 and group ~= '' and (redis.call('HEXISTS', groups, group) == 1 or
                                        redis.call('HLEN', groups) < AFFINITY_GROUPS_MAX) then
      redis.call('HINCRBYFLOAT', groups, group, 1)
      redis.call('HSET', sizes, group, size_of(i))
      redis.call('EXPIRE', groups, status_ttl)
      redis.call('EXPIRE', sizes, status_ttl)
    end
    if not redis.call('ZSCORE', backlog, tenant) then
      redis.call('ZADD', backlog, lifted(), tenant)
    end
    -- no longer than the requests it holds can live (their status TTL)
    redis.call('EXPIRE', staged, status_ttl)
    redis.call('EXPIRE', backlog, status_ttl)
  else
    entry = redis.call('XADD', stream, '*', 'id', rid_of(i), 'data', data_of(i), 'tenant', tenant)
    if fair then
      redis.call('HSET', vtc, tenant, lifted() + cost_of(i))
    end
  end
  -- retain_s: how long the result is kept once final (write_final reads it)
  redis.call('HSET', status, 'state', 'queued', 'model', model, 'enqueued_at', now,
             'lane', lane, 'entry', entry, 'stream', staged or stream, 'retain_s', retain_s, 'tenant', tenant)
  if fair then  -- what the final's actual token count corrects (settle.lua)
    redis.call('HSET', status, 'charged', cost_of(i), 'weight', weight)
  end
  if owner ~= '' then
    redis.call('HSET', status, 'owner', owner)
  end
  if hook ~= '' then
    redis.call('HSET', status, 'hook', hook)
  end
  redis.call('EXPIRE', status, status_ttl)
  if keep_s > 0 then
    redis.call('SET', KEYS[FIRST_MARK + i - 1], '1', 'EX', keep_s)
  end
  entries[i] = entry
end
count_held(stream, tenant, n, status_ttl)
if placing > 0 then  -- the doorbell: a worker placing by prefix blocks on it, not on the lane
  ring_doorbell(stream, n, status_ttl)
end
if fair then
  -- active, with its weight: the tenant reserve shares a worker out among the active (dispatch.lua)
  redis.call('HSET', vtc, '@' .. tenant, now, '~' .. tenant, weight)
  redis.call('EXPIRE', vtc, VTC_TTL_S)
end
return entries
