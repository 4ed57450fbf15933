-- idem: after a bulk load, finish Redis's incremental rehash of ONE big hash.
--
-- KEYS[1]  a completed-generation hash   idem:{<group>:<bucket>}:c:<window>:<gen>
-- ARGV[1]  lookups to make at most in this call
--
-- A Redis hash that outgrows its table starts moving its entries to a table
-- twice the size, one bucket per later command on it. Until that is done every
-- lookup searches both tables and every write moves entries too: the first live
-- claims after a window rebuild of millions of keys paid ~0.1 s per 100k keys
-- for it (bench/claim.py at 10M keys). Each lookup advances the move by at
-- least one bucket and the old table has at most HLEN buckets, so HLEN lookups
-- of a field that is never stored (the empty string: keys are never empty)
-- finish it. Reads only; the reply does not depend on the hash's contents.
--
-- Uses SLICE from _prelude.lua (prepended when the script is loaded).
--
-- Returns HLEN of the hash (the caller sizes its later calls on it).

local size = redis.call('HLEN', KEYS[1])
local todo = math.min(size, tonumber(ARGV[1]))
if todo > 0 then
  local absent = {}
  for i = 1, math.min(todo, SLICE) do
    absent[i] = ''
  end
  while todo > 0 do
    local n = math.min(todo, SLICE)
    redis.call('HMGET', KEYS[1], unpack(absent, 1, n))
    todo = todo - n
  end
end
return size
