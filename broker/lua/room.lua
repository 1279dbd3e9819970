-- Whether `n` more entries of `tenant` fit on `stream` now (read-only): the api's hint before a
-- call's per-row work, so a call that cannot fit is refused at once. admit.lua decides again,
-- atomically, with the same function (refusal in _lib.lua: the bounds, staged entries counted,
-- and the tenant's share).
-- KEYS: stream, the other lane's stream
-- ARGV: n, max_queued, lane_max, tenant, share_max
-- Returns '' when they fit, else 'bound' or 'share'.
local stream, other = KEYS[1], KEYS[2]
local n, max_queued, lane_max = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tenant, share_max = ARGV[4], tonumber(ARGV[5])
return refusal(stream, other, n, max_queued, lane_max, tenant, share_max) or ''
