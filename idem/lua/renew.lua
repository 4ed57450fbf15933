-- idem: renew the leases an owner holds in ONE bucket, found through the owner's own
-- record of its keys there (for a holder that does not know its keys: a Spark driver
-- whose executors claimed them).
--
-- KEYS[1]  the owner's hash of the bucket  idem:{<group>:<bucket>}:o:<owner>  (field =
--          key; written by claim.lua in mode 'track')
-- KEYS[2..] the claim generation hashes pgen-span..pgen (see claim.lua), for every now
--          the caller's estimate of Redis's clock allows
-- ARGV[1]  hash tag of the bucket   idem:{<group>:<bucket>}
-- ARGV[2]  owner token
-- ARGV[3]  now_ms: empty for Redis's clock (TIME), a test clock's instant otherwise
-- ARGV[4]  lease_ms
-- ARGV[5]  claim generations "<width_ms>:<span>" (see claim.lua)
-- ARGV[6]  HSCAN cursor over the owner's hash ('0' to start)
-- ARGV[7]  HSCAN COUNT: about how many keys one call looks at, so a bucket holding many
--          of the owner's keys is renewed in several short calls
--
-- Per key seen: while its newest claim is this owner's (live or expired, as claim.lua's
-- 'renew' takes it), it gets the lease now + lease_ms, attempt kept, in the current claim
-- generation (moved there from an older one). A key no longer held (completed, released,
-- or taken over by another owner) is dropped from the owner's hash, so a renewal looks at
-- fewer keys as the batch settles. The owner's hash then lives one lease from now: a
-- holder that stops renewing (its process died) lets it run out with its leases.
-- C-level calls per call and hash (HMGET, HSET, HDEL), none per key.
--
-- Uses gathered/sliced/present/declared/instant/newest_claims from _prelude.lua (prepended when the script is loaded).
--
-- Returns {cursor, renewed}: the cursor of the next call ('0': the whole hash was seen)
-- and how many leases this call renewed.

local tag = ARGV[1]
local owner = ARGV[2]
local owned = declared(tag .. ':o:' .. owner)
local scan = redis.call('HSCAN', owned, ARGV[6], 'COUNT', ARGV[7])
local cursor, pairs_seen = scan[1], scan[2]
local keys = {}
for i = 1, #pairs_seen, 2 do
  keys[#keys + 1] = pairs_seen[i]
end
local n = #keys
if n == 0 then
  return {cursor, 0}
end

local now = instant(ARGV[3])
local lease_until = string.format('%d', now + tonumber(ARGV[4]))
local pwidth, span = string.match(ARGV[5], '^(%d+):(%d+)$')
pwidth, span = tonumber(pwidth), tonumber(span)
local pgen, hashes, held, where = newest_claims(tag, keys, now, pwidth, span)

local head = 'P|' .. owner .. '|'
local writes, nw = {}, 0
local moved = {}  -- per older generation: keys whose renewed claim now lives in the current one
local gone = {}
for j = 1, n do
  local value = held[j]
  local holder, attempt = nil, nil
  if value then
    holder, attempt = string.match(value, '^P|([^|]*)|%d+|(%d+)$')
    if not holder then
      return redis.error_reply('idem: unrecognised value of the claim of ' .. keys[j] .. ' in ' .. hashes[where[j]])
    end
  end
  if holder == owner then
    writes[nw + 1], writes[nw + 2] = keys[j], head .. lease_until .. '|' .. attempt
    nw = nw + 2
    if where[j] > 1 then
      local list = moved[where[j]] or {}
      list[#list + 1] = keys[j]
      moved[where[j]] = list
    end
  else
    gone[#gone + 1] = keys[j]
  end
end
if nw > 0 then
  sliced(writes, function(...) redis.call('HSET', hashes[1], ...) end)
  redis.call('PEXPIRE', hashes[1], string.format('%d', (pgen + span + 1) * pwidth - now))
end
for i, list in pairs(moved) do
  sliced(list, function(...) redis.call('HDEL', hashes[i], ...) end)
end
if #gone > 0 then
  sliced(gone, function(...) redis.call('HDEL', owned, ...) end)
end
if nw > 0 then
  redis.call('PEXPIRE', owned, ARGV[4])
end
return {cursor, nw / 2}
