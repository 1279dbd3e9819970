-- Cancel: set the flag the worker watches; a request still queued ends cancelled at once, and
-- its entry is acknowledged and deleted, so that it stops counting against the queue bound (a
-- worker that fetched it and starts it later finds it final and runs nothing). A request
-- staged for its tenant's turn (fair share) leaves its staging stream.
-- KEYS: status, cancel, reply, the request's shard's interactive stream, its bulk stream
-- ARGV: now, cancel_ttl, result_ttl, reply_ttl, done_channel, rid, group
local status, flag, reply, interactive, bulk = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local now, cancel_ttl, result_ttl, reply_ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local done_channel, rid, group = ARGV[5], ARGV[6], ARGV[7]
local known = redis.call('HMGET', status, 'state', 'entry', 'stream')
local state = known[1]
if not state then
  return false
end
if is_final_state(state) then
  return state
end
redis.call('SET', flag, '1', 'EX', cancel_ttl)  -- the flag running workers watch
redis.call('HSET', status, 'cancel', '1')  -- what a (re)start reads
if state == 'queued' then
  local final = bare_final(status, 'cancelled', 'cancelled by the client', nil, now)
  write_final(status, reply, 'cancelled', final, now, result_ttl, reply_ttl, done_channel, rid)
  local stream = known[3]
  if known[2] and (stream == interactive or stream == bulk) then
    redis.pcall('XACK', stream, group, known[2])  -- no group yet: no worker of the model ever started
    delete_entry(stream, known[2])
  elseif known[2] and stream and string.find(stream, tag_of(interactive) .. SUFFIX.staged, 1, true) == 1 then
    delete_entry(stream, known[2])  -- staged (fair share): it leaves its tenant's staging stream
  end
  return 'cancelled'
end
return 'cancelling'
