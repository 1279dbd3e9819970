-- Record one more stored file of a tenant, unless it would take the tenant past its max_files
-- or max_file_bytes (broker/jobs/tenant_files.py). The tenant's hash holds each file it stores as
-- `<bytes> <expires_at>`; a file past its expiry is dropped from it here, a deleted one by the
-- api as it deletes it (and one whose metadata is gone, by the api when a refusal is near).
-- KEYS: the tenant's files hash
-- ARGV: file id, bytes, expires_at (s), max_files (0: none), max_bytes (0: none)
-- Returns {'', files, bytes} (recorded), or {limit name, files, bytes} as they stand.
local key, file_id, size, expires_at = KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local max_files, max_bytes = tonumber(ARGV[4]), tonumber(ARGV[5])
local now = tonumber(redis.call('TIME')[1])
local files, bytes, longest = 0, 0, expires_at
local all = redis.call('HGETALL', key)
for i = 1, #all, 2 do
  local b, e = string.match(all[i + 1], '^(%d+) (%d+)$')
  if tonumber(e) <= now then
    redis.call('HDEL', key, all[i])
  else
    files, bytes, longest = files + 1, bytes + tonumber(b), math.max(longest, tonumber(e))
  end
end
if max_files > 0 and files + 1 > max_files then
  return {'max_files', files, bytes}
end
if max_bytes > 0 and bytes + size > max_bytes then
  return {'max_file_bytes', files, bytes}
end
redis.call('HSET', key, file_id, size .. ' ' .. expires_at)
redis.call('EXPIRE', key, math.max(longest - now, 1))
return {'', files + 1, bytes + size}
