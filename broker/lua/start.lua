-- Guard a fetched entry before it runs. Skips (and acknowledges) an entry that is not the
-- request's current one (a duplicate), or whose request is already final (or its status gone:
-- final and expired), cancelled or past its deadline; otherwise marks it running under this
-- attempt and this entry, and takes a fresh fencing token (see fenced in _lib.lua): the writes
-- of every earlier start are fenced from now on. A start is fenced when a later attempt, or
-- this attempt under another consumer, started already; a redelivered entry (attempt > 1)
-- must also still be pending here (a takeover raced it). A fresh entry was just read by this
-- consumer: no XPENDING.
-- A quarantined start (a redelivered entry in a quarantine group of one) is charged to the request: past N
-- charges it becomes a dead letter.
-- KEYS: stream, status, cancel (unused: the status says it), reply
-- ARGV: group, consumer, entry_id, now, deadline, attempt, status_ttl, reply_ttl, done_channel, rid,
--       quarantined (1 or 0), result_ttl, nonce (the starting worker's random value)
-- Returns {'run', fencing token}, or why it does not run: 'final', 'fenced', 'duplicate',
-- 'cancelled', 'expired'.
local stream, status, reply = KEYS[1], KEYS[2], KEYS[4]
local group, consumer, entry_id, now, deadline = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local attempt, status_ttl, reply_ttl = tonumber(ARGV[6]), ARGV[7], ARGV[8]
local done_channel, rid = ARGV[9], ARGV[10]
local quarantined, result_ttl, nonce = ARGV[11] == '1', ARGV[12], ARGV[13]

if attempt > 1 and not owns(stream, group, entry_id, consumer) then
  return 'fenced'
end
local function finish(state, err)
  write_final(status, reply, state, bare_final(status, state, err, attempt, now),
              now, result_ttl, reply_ttl, done_channel, rid)
  ack_and_delete(stream, group, entry_id)
  return state
end
-- is_final's question, the current entry, the cancel mark, the attempt under way, the age
local known = redis.call('HMGET', status, 'state', 'entry', 'cancel', 'attempt', 'worker', 'enqueued_at')
-- No status (admit.lua and requeue.lua write it with the entry, in one script): the request
-- was final and its result expired (a cancel deletes the queued entry, not a copy a worker
-- fetched already), or it was lost with its entry. Nothing runs: a second final, or a run
-- under a status without its model, lane and owner, would break exactly-once.
if not known[1] or is_final_state(known[1]) then  -- whoever holds the entry now, nothing is left to do
  ack_and_delete(stream, group, entry_id)
  return 'final'
end
local current = tonumber(known[4])
if current and (current > attempt or (current == attempt and known[5] ~= consumer)) then
  return 'fenced'
end
if known[2] and known[2] ~= entry_id then
  ack_and_delete(stream, group, entry_id)
  return 'duplicate'
end
if known[3] then  -- cancel.lua marks the status too (the worker's watcher reads the flag)
  return finish('cancelled', 'cancelled by the client')
end
if tonumber(now) > tonumber(deadline) then
  return finish('expired', 'the request passed its deadline before it started')
end
local fence = redis.call('HINCRBY', status, 'starts', 1) .. ':' .. nonce
redis.call('HSET', status, 'state', 'running', 'started_at', now, 'attempt', attempt,
           'worker', consumer, 'entry', entry_id, 'fence', fence)
if quarantined then
  redis.call('HINCRBY', status, 'charges', 1)
end
-- The status's TTL (status_ttl from admission) is renewed only where the wait ate half of it,
-- or on a retry.
if attempt > 1 or not known[6] or tonumber(now) - tonumber(known[6]) > tonumber(status_ttl) / 2 then
  redis.call('EXPIRE', status, status_ttl)
end
return {'run', fence}
