-- Give back what quota.lua charged for a call whose admission was then refused (its queue was
-- full): the request it counted, and each request's tokens (settle_charge, with none used).
-- KEYS: the requests bucket, then one charge record per request
-- ARGV: requests limit (0: none)
local requests_bucket, request_limit = KEYS[1], tonumber(ARGV[1])
if request_limit > 0 then
  move_bucket(requests_bucket, -1, 60000 / request_limit, now_ms())
end
for i = 2, #KEYS do
  settle_charge(KEYS[i], 0)
end
return 1
