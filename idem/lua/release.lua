-- idem: give back claims of ONE bucket (compare-and-delete by owner).
--
-- KEYS[1]  watermark key of the bucket (not touched; it routes the call to the
--          bucket's cluster slot, which every key built from ARGV[1] shares)
-- ARGV[1]  key prefix of the bucket   idem:{<group>:<bucket>}:k:
-- ARGV[2]  owner token
-- ARGV[3..] business keys
--
-- A key is deleted only while it is IN_PROGRESS and held by this owner (live or
-- expired lease); COMPLETED keys and other owners' claims are never touched.
-- Returns the number of keys released.

local prefix = ARGV[1]
local head = 'P|' .. ARGV[2] .. '|'
local released = 0
for i = 3, #ARGV do
  local name = prefix .. ARGV[i]
  local value = redis.call('GET', name)
  if value and string.sub(value, 1, #head) == head then
    redis.call('DEL', name)
    released = released + 1
  end
end
return released
