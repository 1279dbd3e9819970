-- Prefix affinity: the owners of the groups requested lately, as recomputed by
-- broker/delivery/affinity.py (rendezvous with bounded loads; the groups not requested lately keep their
-- live owners, up to GROUPS_MAX groups), replacing the table at once. A group the
-- table does not name is placed by its rank-1 live worker (dispatch.lua).
-- KEYS: the interactive lane stream (its tag names the affinity keys)
-- ARGV: ttl_ms (the table outlives a few intervals without a recompute, then goes), then
--       group, owners (comma-separated consumers, best first) pairs
local owners, ttl_ms = tag_of(KEYS[1]) .. SUFFIX.affinity_owners, tonumber(ARGV[1])
redis.call('DEL', owners)
for i = 2, #ARGV, 2 do
  redis.call('HSET', owners, ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', owners, ttl_ms)
return #ARGV / 2
