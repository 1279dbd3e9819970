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
-- KEYS: stream, the other lane's stream, then one status hash per request, then (keep_s > 0)
--       one admitted mark per request
-- ARGV: max_queued, lane_max, status_ttl, now, model, lane, owner ('' for none), retain_s,
--       keep_s, hook ('1' when the owner has a webhook endpoint: each status carries the mark,
--       and write_final appends its event to the outbox; '' for none), then rid, data for each
--       request
-- Returns the entry ids ('' for one final already; the first ones on a re-run), or false when
-- the bound refuses them.
local stream, other = KEYS[1], KEYS[2]
local max_queued, lane_max, status_ttl, now = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3], ARGV[4]
local model, lane, owner, retain_s, keep_s = ARGV[5], ARGV[6], ARGV[7], ARGV[8], tonumber(ARGV[9])
local hook = ARGV[10]
local n = (#ARGV - 10) / 2
local FIRST_STATUS, FIRST_MARK = 3, 3 + n  -- KEYS[3 .. 2 + n]: statuses; KEYS[3 + n ...]: marks
local function rid_of(i) return ARGV[9 + 2 * i] end  -- ARGV[11...]: rid, data pairs
local function data_of(i) return ARGV[10 + 2 * i] end

local entries = {}
if redis.call('EXISTS', KEYS[FIRST_STATUS]) == 1 then
  for i = 1, n do
    entries[#entries + 1] = redis.call('HGET', KEYS[FIRST_STATUS + i - 1], 'entry') or ''
  end
  return entries
end
if over_bound(stream, other, n, max_queued, lane_max) then
  return false
end
for i = 1, n do
  local status = KEYS[FIRST_STATUS + i - 1]
  local entry = redis.call('XADD', stream, '*', 'id', rid_of(i), 'data', data_of(i))
  -- retain_s: how long the result is kept once final (write_final reads it)
  redis.call('HSET', status, 'state', 'queued', 'model', model, 'enqueued_at', now,
             'lane', lane, 'entry', entry, 'stream', stream, 'retain_s', retain_s)
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
return entries
