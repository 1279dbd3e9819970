-- Store a model deployment, versioned: a changed configuration gets the next version, an
-- unchanged one (same fingerprint) keeps its own, in one step so concurrent deploys do not race.
-- A stored deployment is "<version>\n<fingerprint>\n<config json>".
-- KEYS: the models hash
-- ARGV: model name, fingerprint, config json, keep_existing ('1': a stored deployment wins)
-- Returns the stored value.
local current = redis.call('HGET', KEYS[1], ARGV[1])
local version = 1
if current then
  local nl1 = string.find(current, '\n', 1, true)
  local nl2 = string.find(current, '\n', nl1 + 1, true)
  if ARGV[4] == '1' or string.sub(current, nl1 + 1, nl2 - 1) == ARGV[2] then
    return current
  end
  version = tonumber(string.sub(current, 1, nl1 - 1)) + 1
end
local stored = version .. '\n' .. ARGV[2] .. '\n' .. ARGV[3]
redis.call('HSET', KEYS[1], ARGV[1], stored)
return stored
