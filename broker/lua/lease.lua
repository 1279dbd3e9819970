-- Refresh the idle time of entries this consumer still owns; an entry another consumer
-- has reclaimed is left alone (XCLAIM with min-idle 0 would steal it back).
-- KEYS: stream   ARGV: group, consumer, entry ids...   Returns the ids this consumer lost.
local stream = KEYS[1]
local group, consumer = ARGV[1], ARGV[2]
local FIRST_ENTRY = 3  -- ARGV[3...]: the entry ids

local lost = {}
for i = FIRST_ENTRY, #ARGV do
  if owns(stream, group, ARGV[i], consumer) then
    redis.call('XCLAIM', stream, group, consumer, 0, ARGV[i], 'JUSTID')
  else
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
