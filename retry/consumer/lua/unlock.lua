-- unlock.lua: release orderly-consumption locks this client holds (compare-and-delete).
--
-- KEYS[1..n]  one lock per queue   STRING  holder client id
-- ARGV[1]     client id
--
-- Returns the number of locks released (a lock another client holds is left alone).

local released = 0
for _, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    redis.call('DEL', key)
    released = released + 1
  end
end
return released
