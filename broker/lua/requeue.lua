-- Put a dead letter back on its stream (`sluice dlq retry`): within the stream's bound, as
-- a new entry that becomes the request's current one, with its old reply stream cleared
-- and no charges, and remove it from the dead-letter stream, all at once. Only a dead letter
-- that is still there: a second retry (or one from a stale listing) finds it gone and puts
-- nothing on the stream. The status is whole again even where it expired meanwhile: its
-- owner, model, lane and retention come with the request.
-- The bound is admit.lua's: both lanes together within max_queued, this lane within lane_max.
-- KEYS: stream, status, reply, dlq, the other lane's stream
-- ARGV: max_queued, rid, data, now, status_ttl, dlq_entry_id, lane_max, model, lane,
--       owner ('' for none), retain_s (used where the status has none), nonce (the call's own
--       random value: a client re-sending this call after its answer was lost is told the entry
--       its first run put on the stream, not that the letter is gone)
-- Returns the new entry id, false when the bound refuses it, or '' when the dead letter is
-- gone (retried or dropped already, by another call).
local stream, status, reply, dlq, other = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local max_queued, rid, data, now, status_ttl = tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local letter, lane_max, model = ARGV[6], tonumber(ARGV[7]), ARGV[8]
local lane, owner, retain_s = ARGV[9], ARGV[10], ARGV[11]
local nonce = ARGV[12] or ''

if #redis.call('XRANGE', dlq, letter, letter) == 0 then
  local by, requeued = string.match(redis.call('HGET', status, 'requeued') or '', '^(%S+) (%S+)$')
  if nonce ~= '' and by == nonce then  -- this very call, re-sent: its first run requeued the letter
    return requeued
  end
  return ''
end
if over_bound(stream, other, 1, max_queued, lane_max) then
  return false
end
-- Straight onto the lane (an operator's retry does not wait for its tenant's turn), counted to its
-- tenant; workers placing by prefix hear of it by the doorbell
local ok, request = pcall(cjson.decode, data)
local tenant = ok and type(request) == 'table' and type(request.tenant) == 'string' and request.tenant
  or 'default'
local entry = redis.call('XADD', stream, '*', 'id', rid, 'data', data, 'tenant', tenant)
count_held(stream, tenant, 1, status_ttl)
redis.call('DEL', reply)
local dropped = {'result', 'finished_at', 'started_at', 'worker', 'charges', 'attempt', 'fence'}
redis.call('HDEL', status, unpack(token_counts(status, dropped)))  -- with the cleared stream's counts
redis.call('HSET', status, 'state', 'queued', 'enqueued_at', now, 'entry', entry, 'stream', stream,
           'model', model, 'lane', lane, 'retain_s', redis.call('HGET', status, 'retain_s') or retain_s,
           'requeued', nonce .. ' ' .. entry)
if owner ~= '' then
  redis.call('HSET', status, 'owner', owner)
end
redis.call('EXPIRE', status, status_ttl)
redis.call('XDEL', dlq, letter)
if is_interactive(stream) and redis.call('HLEN', tag_of(stream) .. SUFFIX.affinity_slots) > 0 then
  ring_doorbell(stream, 1, status_ttl)  -- placing workers block on it, not on the lane
end
return entry
