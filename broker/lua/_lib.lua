-- Shared by the scripts below (Scripts.register prepends it, after the final states of
-- protocol/states.py): ownership, fencing, acknowledgement, finality, the queue bound, a job's
-- lock, and writing a request's final event and status in one place.

-- Whether `consumer` owns pending entry `id` (otherwise it has been fenced out).
local function owns(stream, group, id, consumer)
  local p = redis.call('XPENDING', stream, group, id, id, 1)
  return #p == 1 and p[1][2] == consumer
end

-- Fencing (DESIGN.md step 5): every start takes a fresh fencing token, `<n>:<nonce>`, where n
-- counts the request's starts (the status's `starts`, raised by start.lua) and the nonce is the
-- starting worker's own random value; the status's `fence` names the token of the start under
-- way. A worker writes tokens (reply.lua) or a final (commit.lua) only while the status's
-- `fence` is its own token: any later start, of a later attempt or of the same attempt by
-- another worker, or a `dlq retry` (which clears it), fences it out. The nonce keeps two
-- starts apart even where a failover lost the first one's counter (both then count 1). A
-- status without a `fence` (lost, or expired) fences every writer: nothing is written
-- without the key that carries its TTL. No XPENDING on the per-token and commit paths.
local function fenced(current, token)  -- current: the status's `fence` (false when absent)
  return current ~= token
end

-- The `next:<row>` fields of a status hash (reply.lua's token counts), appended to `into`.
local function token_counts(status, into)
  for _, field in ipairs(redis.call('HKEYS', status)) do
    if string.sub(field, 1, 5) == 'next:' then
      into[#into + 1] = field
    end
  end
  return into
end

-- Tenants' fair share (docs/delivery.md, "Fair share"): a lane stream `<tag>:<lane>` (`req`
-- or `bulk`) has, in its slot, a staging stream per tenant whose requests wait their turn
-- (`<tag>:staged:<lane>:<tenant>`), the backlogged tenants by virtual token counter
-- (`<tag>:backlog:<lane>`, a sorted set), every tenant's counter (`<tag>:vtc:<lane>`, a hash;
-- field `:floor` holds the counter of the last tenant to leave the backlog) and, per shard, how
-- many entries each tenant holds, staged or on a lane stream (`<tag>:held`).
local function tag_of(key)  -- 'sluice:{m:M}' of any of the model's keys on that shard
  return string.match(key, '^(.-})')
end
local function lane_of(stream)  -- 'req' or 'bulk'
  return string.match(stream, ':(%a+)$')
end
local function is_interactive(stream)  -- the lane `<tag>:req` (not `<tag>:bulk`)
  return string.sub(stream, -#SUFFIX.requests) == SUFFIX.requests
end
local function backlog_key(stream)
  return tag_of(stream) .. SUFFIX.backlog .. lane_of(stream)
end
local function staged_key(stream, tenant)
  return tag_of(stream) .. SUFFIX.staged .. lane_of(stream) .. ':' .. tenant
end

-- Entries of a lane waiting in its tenants' staging streams.
local function staged_len(stream)
  local n = 0
  for _, tenant in ipairs(redis.call('ZRANGE', backlog_key(stream), 0, -1)) do
    n = n + redis.call('XLEN', staged_key(stream, tenant))
  end
  return n
end

-- The queue bound (admission's and `dlq retry`'s): whether `n` more entries on `stream` would
-- take the model's two lanes together past max_queued (entries waiting, staged or on the lane
-- stream, plus pending: entries are deleted once acknowledged), or this lane past its own bound.
local function over_bound(stream, other, n, max_queued, lane_max)
  local here = redis.call('XLEN', stream) + staged_len(stream)
  return here + redis.call('XLEN', other) + staged_len(other) + n > max_queued or here + n > lane_max
end

-- Whether `n` more entries of `tenant` on `stream` are refused (admit.lua decides with it, and
-- room.lua, the api's read-only hint before a call's per-row work): 'share' when the tenant
-- holds its share (share_max entries, staged or on a stream, both lanes) while another tenant
-- has work queued; 'bound' when the model's bounds are reached, unless the tenant is within
-- its share while another tenant's entries fill them (then up to share_max past them, so one
-- tenant never refuses another); nil when they fit. Second: the entries the tenant holds.
local function refusal(stream, other, n, max_queued, lane_max, tenant, share_max)
  local held = tag_of(stream) .. SUFFIX.held
  local mine = tonumber(redis.call('HGET', held, tenant) or '0')
  local others = redis.call('HLEN', held) - (mine > 0 and 1 or 0)
  local within = mine + n <= share_max
  if not within and others > 0 then
    return 'share', mine
  end
  if over_bound(stream, other, n, max_queued, lane_max) and (not within or others == 0 or
      over_bound(stream, other, n, max_queued + share_max, lane_max + share_max)) then
    return 'bound', mine
  end
  return nil, mine
end

-- Prefix affinity's doorbell (docs/prefix-affinity.md): a worker placing by prefix blocks on
-- `<tag>:aff:wake`, not on the lane, so whatever adds work for it rings (admission, a retry).
-- A placing worker's field of `<tag>:aff:slots` ('<free slots>|<ms seen, Redis' clock>', written by
-- dispatch.lua, affinity_beat.lua and commit.lua): its free slots and when it was seen, or nil.
local function slots_field(value)
  local free, seen = string.match(value or '', '^(%-?%d+)|(%d+)$')
  if free then
    return tonumber(free), seen
  end
  return nil
end

local function ring_doorbell(stream, n, ttl)
  local wake = tag_of(stream) .. SUFFIX.affinity_wake
  redis.call('XADD', wake, 'MAXLEN', '~', 64, '*', 'n', n)
  redis.call('EXPIRE', wake, ttl)
end

-- A tenant holds `by` more (or fewer) entries of the shard of `key`; a tenant holding none
-- leaves the hash, so it holds only tenants with work queued. `ttl` (with an increment: the
-- status TTL of the entries counted) keeps the hash no longer than they can live.
local function count_held(key, tenant, by, ttl)
  local held = tag_of(key) .. SUFFIX.held
  if redis.call('HINCRBY', held, tenant, by) <= 0 then
    redis.call('HDEL', held, tenant)
  elseif ttl then
    redis.call('EXPIRE', held, ttl)
  end
end

-- A staging stream that has become empty is deleted and its tenant leaves the backlog; the
-- floor (what a tenant joining an empty backlog is lifted to) keeps the highest counter that left.
local function unstage_if_empty(staged)
  if redis.call('XLEN', staged) > 0 then
    return
  end
  redis.call('DEL', staged)
  local tag, lane, tenant = string.match(staged, '^(.-})' .. SUFFIX.staged .. '(%a+):(.*)$')
  local backlog = tag .. SUFFIX.backlog .. lane
  local score = redis.call('ZSCORE', backlog, tenant)
  if score then
    redis.call('ZREM', backlog, tenant)
    local vtc = tag .. SUFFIX.counters .. lane
    if tonumber(score) > tonumber(redis.call('HGET', vtc, ':floor') or '0') then
      redis.call('HSET', vtc, ':floor', score)
    end
  end
end

-- Delete a request entry (of a lane or a staging stream) and uncount it from its tenant (the
-- entry's `tenant` field; an entry without one was never counted).
local function delete_entry(stream, id)
  local got = redis.call('XRANGE', stream, id, id)
  if #got == 0 then
    return
  end
  redis.call('XDEL', stream, id)
  local fields = got[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 'tenant' then
      count_held(stream, fields[i + 1], -1)
    end
  end
  if string.find(stream, SUFFIX.staged, 1, true) then
    unstage_if_empty(stream)
  end
end

-- Whether the runner whose lock token is `token` holds a job's lock (bulk jobs: a runner that
-- lost it changes nothing).
local function holds_lock(lock, token)
  return redis.call('GET', lock) == token
end
-- A batch's webhook outbox, beside its lock: `{sluice:batch:<id>}:outbox` of `{sluice:batch:<id>}:lock`.
local function batch_outbox(lock)
  return string.sub(lock, 1, -#SUFFIX.batch_lock - 1) .. SUFFIX.outbox
end

-- HSET the field, value pairs whose value is known (not ''): `hset_known(key, f1, v1, ...)`.
local function hset_known(key, ...)
  local pairs_in, fields = {...}, {}
  for i = 1, #pairs_in, 2 do
    if pairs_in[i + 1] ~= '' then
      fields[#fields + 1] = pairs_in[i]
      fields[#fields + 1] = pairs_in[i + 1]
    end
  end
  if #fields > 0 then
    redis.call('HSET', key, unpack(fields))
  end
end

local function ack_and_delete(stream, group, id)
  redis.call('XACK', stream, group, id)
  delete_entry(stream, id)
end

-- The one place that decides whether a request already has its final result: every script
-- that writes a final asks it first, so no request ever gets a second one. FINAL_STATES (and
-- BATCH_FINAL, a batch's) come from protocol/states.py: Scripts.register puts them in front.
local function is_final_state(state)  -- a status hash's `state` field (false when absent)
  return state ~= false and state ~= nil and FINAL_STATES[state] == true
end
local function is_final(status)
  return is_final_state(redis.call('HGET', status, 'state'))
end

-- Webhooks (docs/webhooks.md): one event on the outbox of the status's slot (`<tag>:outbox`, the
-- status's own hash tag: cluster-safe), bounded by OUTBOX_MAX_LEN (the prelude's), for the
-- sender group to deliver. Called only for a request that carries the `hook` mark.
local function append_event(status, rid, state, now)
  local outbox = string.match(status, '^(.*)' .. SUFFIX.status) .. SUFFIX.outbox
  local got = redis.call('HMGET', status, 'owner', 'model')
  redis.call('XADD', outbox, 'MAXLEN', '~', OUTBOX_MAX_LEN, '*', 'id', rid, 'state', state,
             'owner', got[1] or '', 'model', got[2] or '', 'at', now)
end

-- Tenants' token buckets (broker/intake/quotas.py, quota.lua): a bucket is a string holding its
-- theoretical arrival time in ms (GCRA), `interval` ms per unit; moving it by `units` (negative:
-- a refund) never takes it below now, and it expires when full. Redis' own clock, never a caller's.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function move_bucket(bucket, units, interval, now)
  local tat = math.max(tonumber(redis.call('GET', bucket)) or now, now) + units * interval
  if tat > now then
    redis.call('SET', bucket, string.format('%.0f', tat), 'PX', math.ceil(tat - now))
  else
    redis.call('DEL', bucket)
  end
  return tat
end
-- The charge quota.lua recorded for request `rid` (`<bucket>\n<tokens>\n<interval>`) settled:
-- the bucket corrected from the tokens charged to `used`, the record gone. Idempotent: a second
-- settlement finds no record.
local function settle_charge(record, used)
  local charge = redis.call('GET', record)
  if not charge then
    return
  end
  redis.call('DEL', record)
  local bucket, charged, interval = string.match(charge, '^(.*)\n(%d+)\n([%d.]+)$')
  move_bucket(bucket, used - tonumber(charged), tonumber(interval), now_ms())
end
-- At the final (write_final): the tokens used, from the final's usage (none: nothing ran).
local function settle_final_charge(status, final)
  local prefix, rid = string.match(status, '^(.*)' .. SUFFIX.status .. '(.*)$')
  local record = prefix .. SUFFIX.charge .. rid
  if redis.call('EXISTS', record) == 1 then
    local usage = cjson.decode(final).usage
    local used = 0
    if type(usage) == 'table' then
      used = (tonumber(usage.prompt_tokens) or 0) + (tonumber(usage.completion_tokens) or 0)
    end
    settle_charge(record, used)
  end
end

-- The final event on the reply stream, the status hash, both with their TTLs, and the
-- announcement that wakes long-polling readers. Refuses (returns false) when the request
-- is final already (the announcement: the request's id, then a newline and the final when it
-- is at most 4 KiB). Retention: the status keeps the result for its model's retention
-- (`retain_s`, set at admission; `result_ttl` when absent), the reply stream only for the
-- short `reply_ttl` (readers fall back to the status hash), and the delivery bookkeeping
-- nobody reads after the final is dropped: what a finished request costs is mostly its text.
-- `rows` (the request's row count, when the caller knows it) names reply.lua's token counts
-- to drop; without it they are looked up (HKEYS). `known`: {state, retain_s, hook} if read already.
-- Webhooks: a request whose owner had an endpoint at admission carries `hook` (admit.lua), and
-- its final appends one event to its slot's outbox in this same call (append_event); a request
-- without it costs nothing more here.
local function write_final(status, reply, state, final, now, result_ttl, reply_ttl, channel, rid, rows, known)
  -- is_final's question, the retention and the webhook mark (`known`: the caller read them already)
  known = known or redis.call('HMGET', status, 'state', 'retain_s', 'hook')
  if is_final_state(known[1]) then
    return false
  end
  if known[3] then
    append_event(status, rid, state, now)
  end
  redis.call('XADD', reply, '*', 'kind', 'final', 'data', final)
  redis.call('EXPIRE', reply, reply_ttl)
  settle_final_charge(status, final)  -- a tenant's tokens per minute, charged at admission
  local dropped = {'entry', 'stream', 'charges', 'cancel'}
  if rows then
    for row = 0, rows - 1 do
      dropped[#dropped + 1] = 'next:' .. row
    end
  else
    token_counts(status, dropped)
  end
  redis.call('HDEL', status, unpack(dropped))
  redis.call('HSET', status, 'state', state, 'result', final, 'finished_at', now)
  redis.call('EXPIRE', status, known[2] or result_ttl)
  -- The announcement carries a small final itself (a waiter shows it without reading the status)
  if #final <= 4096 then
    redis.call('SPUBLISH', channel, rid .. '\n' .. final)
  else
    redis.call('SPUBLISH', channel, rid)
  end
  return true
end

-- A final without output (cancelled, expired, failed), timed from the status hash.
local function bare_final(status, state, err, attempt, now)
  return cjson.encode({status = state, error = err, attempt = attempt,
    timings = {enqueued = tonumber(redis.call('HGET', status, 'enqueued_at')), finished = tonumber(now)}})
end

-- Append token deltas (JSON strings) to a request's reply stream: reply.lua's flushes, and the
-- last deltas that ride on a commit (both fenced first: the status is there). Idempotent: the
-- status hash keeps each row's next token index, and a delta below it is dropped, so a pipeline
-- re-sent after a lost reply (Redis died after running it) writes nothing twice; a delta of an
-- attempt older than the request's current one is dropped. No holes: a delta that starts past
-- its row's next index, or straddles it, is refused: after a failover the old primary
-- acknowledged deltas its replica never had, and the writer, told the index the stream now ends
-- at, sends them again from there. `known`: the status's `state`, `attempt` and `next:<row>`
-- fields read already (updated here). Returns {row, next index, ...} for the refused rows (the
-- others are written), the new `next:<row>` values as HSET arguments (the caller writes them), and
-- whether a write created the stream (it was not there: the caller gives it its TTL).
local function write_deltas(status, reply, deltas, known)
  local refused, gaps, moved, created = {}, {}, {}, false
  for _, data in ipairs(deltas) do
    local delta = cjson.decode(data)
    local row = delta.row or 0
    local field = 'next:' .. tostring(row)
    if refused[row] == nil then
      if known[field] == nil then
        local got = redis.call('HMGET', status, 'state', field, 'attempt')
        known.state, known[field], known.attempt = got[1], tonumber(got[2]) or 0, got[3]
      end
      local next_index = known[field]
      -- An earlier attempt's delta, still buffered in a worker that gave the request up and then
      -- took it over again under the same consumer name, is not written: the run now under way
      -- resumed from the stream as it was, and writes those indices itself.
      -- Nor is a delta written after the final (cancelled or expired meanwhile: readers stop there).
      if (delta.attempt or 1) >= (tonumber(known.attempt) or 0) and not is_final_state(known.state) then
        local ends = delta.i + #delta.token_ids
        if delta.i > next_index or (delta.i < next_index and ends > next_index) then
          refused[row] = next_index
          gaps[#gaps + 1] = row
          gaps[#gaps + 1] = next_index
        elseif delta.i == next_index then
          -- (NOMKSTREAM: whether the stream was there costs no command of its own)
          if not redis.call('XADD', reply, 'NOMKSTREAM', '*', 'kind', 'delta', 'data', data) then
            redis.call('XADD', reply, '*', 'kind', 'delta', 'data', data)
            created = true
          end
          known[field] = ends
          moved[field] = ends
        end
      end
    end
  end
  local fields = {}
  for field, ends in pairs(moved) do
    fields[#fields + 1] = field
    fields[#fields + 1] = ends
  end
  return gaps, fields, created
end
