-- Guard a fetched entry before it runs. Skips (and acknowledges) an entry that is not the
-- request's current one (a duplicate), or whose request is already final, cancelled or
-- past its deadline; otherwise marks it running under this attempt (the fencing token: see
-- superseded) and this entry. A start is fenced when a later attempt, or this attempt under
-- another consumer, started already; a redelivered entry (attempt > 1) must also still be
-- pending here (a takeover raced it). A fresh entry was just read by this consumer: no XPENDING.
-- A quarantined start (a redelivered entry running alone) is charged to the request: past N
-- charges it becomes a dead letter.
-- KEYS: stream, status, cancel (unused: the status says it), reply
-- ARGV: group, consumer, entry_id, now, deadline, attempt, status_ttl, reply_ttl, done_channel, rid,
--       quarantined (1 or 0), result_ttl
local attempt = tonumber(ARGV[6])
if attempt > 1 and not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 'fenced'
end
local function finish(state, err)
  write_final(KEYS[2], KEYS[4], state, bare_final(KEYS[2], state, err, attempt, ARGV[4]),
              ARGV[4], ARGV[12], ARGV[8], ARGV[9], ARGV[10])
  ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
  return state
end
-- is_final's question, the current entry, the cancel mark, the attempt under way, the age
local known = redis.call('HMGET', KEYS[2], 'state', 'entry', 'cancel', 'attempt', 'worker', 'enqueued_at')
if is_final_state(known[1]) then  -- whoever holds the entry now, it has nothing left to do
  ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
  return 'final'
end
local current = tonumber(known[4])
if current and (current > attempt or (current == attempt and known[5] ~= ARGV[2])) then
  return 'fenced'
end
if known[2] and known[2] ~= ARGV[3] then
  ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
  return 'duplicate'
end
if known[3] then  -- cancel.lua marks the status too (the worker's watcher reads the flag)
  return finish('cancelled', 'cancelled by the client')
end
if tonumber(ARGV[4]) > tonumber(ARGV[5]) then
  return finish('expired', 'the request passed its deadline before it started')
end
redis.call('HSET', KEYS[2], 'state', 'running', 'started_at', ARGV[4], 'attempt', ARGV[6],
           'worker', ARGV[2], 'entry', ARGV[3])
if ARGV[11] == '1' then
  redis.call('HINCRBY', KEYS[2], 'charges', 1)
end
-- The status's TTL (status_ttl from admission) is renewed only where the wait ate half of it,
-- on a retry, or where the hash was not there to carry one.
if attempt > 1 or not known[6] or tonumber(ARGV[4]) - tonumber(known[6]) > tonumber(ARGV[7]) / 2 then
  redis.call('EXPIRE', KEYS[2], ARGV[7])
end
return 'run'
