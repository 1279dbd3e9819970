-- A look at a tenant's requests bucket, charging nothing (Quotas.requests_wait_s): its
-- theoretical arrival time and Redis' clock, read on the bucket's node in one call (a Redis
-- Cluster refuses TIME in a pipeline).
-- KEYS: the requests bucket
-- ARGV: none
-- Returns {the bucket's value ('0': none), TIME's {seconds, microseconds}}
local bucket = KEYS[1]
return {redis.call('GET', bucket) or '0', redis.call('TIME')}
