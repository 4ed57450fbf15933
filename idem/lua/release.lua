-- idem: give back claims of ONE bucket (compare-and-delete by owner).
--
-- KEYS[1]  watermark key of the bucket (not touched; it routes the call to the
--          bucket's cluster slot, which every name built from ARGV[1] shares)
-- ARGV[1]  hash tag of the bucket   idem:{<group>:<bucket>}
-- ARGV[2]  owner token
-- ARGV[3..] business keys
--
-- A claim (<tag>:k:<key>, see claim.lua) is deleted only while this owner holds
-- it (live or expired lease); COMPLETED keys live elsewhere and other owners'
-- claims are never touched. One MGET and at most one DEL per call.
-- Uses sliced/gathered from _prelude.lua (prepended when the script is loaded).
--
-- Returns the number of keys released.

local claims = ARGV[1] .. ':k:'
local head = 'P|' .. ARGV[2] .. '|'
local names = {}
for i = 3, #ARGV do
  names[#names + 1] = claims .. ARGV[i]
end
if #names == 0 then
  return 0
end
local values = gathered(names, function(...) return redis.call('MGET', ...) end)
local drop = {}
for j = 1, #names do
  local value = values[j]
  if value and string.find(value, head, 1, true) == 1 then
    drop[#drop + 1] = names[j]
  end
end
if #drop > 0 then
  sliced(drop, function(...) redis.call('DEL', ...) end)
end
return #drop
