-- Refresh the idle time of entries this consumer still owns; an entry another consumer
-- has reclaimed is left alone (XCLAIM with min-idle 0 would steal it back).
-- KEYS: stream   ARGV: group, consumer, entry ids...   Returns the ids this consumer lost.
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p == 1 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
