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
--       keep_s, then rid, data for each request
-- Returns the entry ids ('' for one final already; the first ones on a re-run), or false when
-- the bound refuses them.
local n = (#ARGV - 9) / 2
local keep_s = tonumber(ARGV[9])
local entries = {}
if redis.call('EXISTS', KEYS[3]) == 1 then
  for i = 3, 2 + n do
    entries[#entries + 1] = redis.call('HGET', KEYS[i], 'entry') or ''
  end
  return entries
end
local here = redis.call('XLEN', KEYS[1])
if here + redis.call('XLEN', KEYS[2]) + n > tonumber(ARGV[1]) or here + n > tonumber(ARGV[2]) then
  return false
end
for i = 1, n do
  local rid, status = ARGV[8 + 2 * i], KEYS[2 + i]
  local entry = redis.call('XADD', KEYS[1], '*', 'id', rid, 'data', ARGV[9 + 2 * i])
  -- retain_s: how long the result is kept once final (write_final reads it)
  redis.call('HSET', status, 'state', 'queued', 'model', ARGV[5], 'enqueued_at', ARGV[4],
             'lane', ARGV[6], 'entry', entry, 'stream', KEYS[1], 'retain_s', ARGV[8])
  if ARGV[7] ~= '' then
    redis.call('HSET', status, 'owner', ARGV[7])
  end
  redis.call('EXPIRE', status, ARGV[3])
  if keep_s > 0 then
    redis.call('SET', KEYS[2 + n + i], '1', 'EX', keep_s)
  end
  entries[i] = entry
end
return entries
