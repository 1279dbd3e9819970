-- Guard a fetched entry before it runs. Skips (and acknowledges) an entry that is not the
-- request's current one (a duplicate), or whose request is already final, cancelled or
-- past its deadline; otherwise marks it running (the lease the worker holds from its fetch
-- goes on: lease_held() refreshes it, and a start that lost it is fenced here). A
-- quarantined start (a redelivered entry running alone) is charged to the request: past N
-- charges it becomes a dead letter.
-- KEYS: stream, status, cancel (unused: the status says it), reply
-- ARGV: group, consumer, entry_id, now, deadline, attempt, status_ttl, reply_ttl, done_channel, rid,
--       quarantined (1 or 0), result_ttl
if not owns(KEYS[1], ARGV[1], ARGV[3], ARGV[2]) then
  return 'fenced'
end
local function finish(state, err)
  write_final(KEYS[2], KEYS[4], state, bare_final(KEYS[2], state, err, tonumber(ARGV[6]), ARGV[4]),
              ARGV[4], ARGV[12], ARGV[8], ARGV[9], ARGV[10])
  ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
  return state
end
local known = redis.call('HMGET', KEYS[2], 'state', 'entry', 'cancel')  -- is_final's question, the current entry
if is_final_state(known[1]) then
  ack_and_delete(KEYS[1], ARGV[1], ARGV[3])
  return 'final'
end
local current = known[2]
if current and current ~= ARGV[3] then
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
redis.call('EXPIRE', KEYS[2], ARGV[7])
return 'run'
