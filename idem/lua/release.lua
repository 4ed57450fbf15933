-- idem: give back claims of ONE bucket (compare-and-delete by owner).
--
-- KEYS[1]  watermark key of the bucket (not touched; it routes the call to the
--          bucket's cluster slot, which every name built from ARGV[1] shares)
-- KEYS[2..] the claim generation hashes pgen-span..pgen (see claim.lua), for every now
--          the caller's estimate of Redis's clock allows
-- ARGV[1]  hash tag of the bucket   idem:{<group>:<bucket>}
-- ARGV[2]  owner token
-- ARGV[3]  now_ms: empty for Redis's clock (TIME), a test clock's instant otherwise
-- ARGV[4]  claim generations "<width_ms>:<span>" (see claim.lua)
-- ARGV[5..] business keys
--
-- A claim (field <key> of a claim generation hash, see claim.lua) is deleted
-- only while this owner holds it (live or expired lease); COMPLETED keys live
-- elsewhere and other owners' claims are never touched. One HMGET and at most
-- one HDEL per claim generation.
-- Uses sliced/gathered/declared/instant from _prelude.lua (prepended when the script is loaded).
--
-- Returns the number of keys released.

local tag = ARGV[1]
local head = 'P|' .. ARGV[2] .. '|'
local now = instant(ARGV[3])
local pwidth, span = string.match(ARGV[4], '^(%d+):(%d+)$')
pwidth, span = tonumber(pwidth), tonumber(span)
local keys = {}
for i = 5, #ARGV do
  keys[#keys + 1] = ARGV[i]
end
if #keys == 0 then
  return 0
end
local pgen = math.floor(now / pwidth)
local released = {}
local count = 0
for i = 0, span do
  local hash = declared(tag .. ':p:' .. pwidth .. ':' .. (pgen - i))
  local values = gathered(keys, function(...) return redis.call('HMGET', hash, ...) end)
  local drop = {}
  for j = 1, #keys do
    local value = values[j]
    if value and string.find(value, head, 1, true) == 1 then
      drop[#drop + 1] = keys[j]
      if not released[j] then
        released[j] = true
        count = count + 1
      end
    end
  end
  if #drop > 0 then
    sliced(drop, function(...) redis.call('HDEL', hash, ...) end)
  end
end
return count
