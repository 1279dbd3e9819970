-- Refresh the idle time of entries this consumer still owns; an entry another consumer
-- has reclaimed is left alone (XCLAIM with min-idle 0 would steal it back).
-- KEYS: stream   ARGV: group, consumer, entry ids...   Returns the ids this consumer lost.
local lost = {}
for i = 3, #ARGV do
  if owns(KEYS[1], ARGV[1], ARGV[i], ARGV[2]) then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
