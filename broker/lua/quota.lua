-- Charge a tenant's quotas on a model for one call's requests, or refuse them all (charging
-- nothing): requests per minute (one per call, as OpenAI counts) and tokens per minute (each
-- request's estimate: prompt + max_tokens). Each limit is a GCRA bucket (move_bucket in
-- _lib.lua): `limit` units per minute, at most a minute's worth at once. A request charged for
-- tokens leaves its charge record, which write_final settles against its usage (settle_charge).
-- Idempotent: a re-run (a client retrying through a dropped connection) that finds the first
-- record charges nothing again.
-- KEYS: the requests bucket, the tokens bucket, then one charge record per request
-- ARGV: requests limit (0: none), tokens limit (0: none), record_ttl, then each request's tokens
-- Returns {refused ('' / 'requests' / 'tokens' / 'tokens_call': more tokens than a minute
--   holds), retry_after_ms, requests remaining, requests reset_ms, tokens remaining, tokens reset_ms}
local requests_bucket, tokens_bucket = KEYS[1], KEYS[2]
local request_limit, token_limit, record_ttl = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local first_record = KEYS[3]  -- nil for a call with no request (never made)
local MINUTE = 60000
local now = now_ms()
local total = 0
for i = 4, #ARGV do
  total = total + tonumber(ARGV[i])
end

-- A charge of `units` looked at: whether it fits, how long until it would, then (after it when
-- it fits, else as the bucket is) the units left and the time until the bucket is full.
local function look(bucket, limit, units)
  if limit == 0 then
    return true, 0, 0, 0
  end
  local interval = MINUTE / limit
  local tat = math.max(tonumber(redis.call('GET', bucket)) or now, now)
  local over = tat + units * interval - now - MINUTE
  if over <= 0 then
    tat = tat + units * interval
  end
  return over <= 0, math.max(over, 0), math.floor((MINUTE - (tat - now)) / interval + 1e-9),
    math.ceil(tat - now)
end

local charged = first_record ~= nil and redis.call('EXISTS', first_record) == 1
local rq_units, tk_units = 1, total
if charged then
  rq_units, tk_units = 0, 0
end
local rq_ok, rq_wait, rq_left, rq_reset = look(requests_bucket, request_limit, rq_units)
local tk_ok, tk_wait, tk_left, tk_reset = look(tokens_bucket, token_limit, tk_units)
local refused, wait = '', 0
if token_limit > 0 and tk_units > token_limit then
  refused, wait = 'tokens_call', MINUTE
elseif not rq_ok then
  refused, wait = 'requests', rq_wait
elseif not tk_ok then
  refused, wait = 'tokens', tk_wait
end
if refused ~= '' then  -- nothing charged: what is left is as it was
  if rq_ok and request_limit > 0 then
    rq_left, rq_reset = rq_left + rq_units, rq_reset - math.ceil(rq_units * MINUTE / request_limit)
  end
  if tk_ok and token_limit > 0 then
    tk_left, tk_reset = tk_left + tk_units, tk_reset - math.ceil(tk_units * MINUTE / token_limit)
  end
  return {refused, math.ceil(wait), rq_left, math.max(rq_reset, 0), tk_left, math.max(tk_reset, 0)}
end
if not charged then
  if request_limit > 0 then
    move_bucket(requests_bucket, 1, MINUTE / request_limit, now)
  end
  if token_limit > 0 then
    local interval = string.format('%.6f', MINUTE / token_limit)
    move_bucket(tokens_bucket, total, MINUTE / token_limit, now)
    for i = 3, #KEYS do
      redis.call('SET', KEYS[i], tokens_bucket .. '\n' .. ARGV[i + 1] .. '\n' .. interval, 'EX', record_ttl)
    end
  end
end
return {'', 0, rq_left, rq_reset, tk_left, tk_reset}
