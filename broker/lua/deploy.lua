-- Store a model deployment, versioned: a changed configuration gets the next version, an
-- unchanged one (same fingerprint) keeps its own, in one step so concurrent deploys do not race.
-- A stored deployment is "<version>\n<fingerprint>\n<config json>".
-- KEYS: the models hash
-- ARGV: model name, fingerprint, config json, keep_existing ('1': a stored deployment wins)
-- Returns the stored value.
local models = KEYS[1]
local name, fingerprint, config, keep_existing = ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1'

local current = redis.call('HGET', models, name)
local version = 1
if current then
  local nl1 = string.find(current, '\n', 1, true)
  local nl2 = string.find(current, '\n', nl1 + 1, true)
  if keep_existing or string.sub(current, nl1 + 1, nl2 - 1) == fingerprint then
    return current
  end
  version = tonumber(string.sub(current, 1, nl1 - 1)) + 1
end
local stored = version .. '\n' .. fingerprint .. '\n' .. config
redis.call('HSET', models, name, stored)
return stored
