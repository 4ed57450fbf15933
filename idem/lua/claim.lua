-- idem: claim a batch of business keys of ONE bucket (atomic per call).
--
-- KEYS[1]  watermark of the bucket      idem:{<group>:<bucket>}:wm   "<version>|<window_ms>"
-- KEYS[2..] every hash named below that this call may read or write: the current,
--          previous and next completed generations, the claim generations pgen-span..pgen
--          (for every now the caller's estimate of Redis's clock allows: at a boundary,
--          one generation more)
-- ARGV[1]  hash tag of the bucket       idem:{<group>:<bucket>}
-- ARGV[2]  now_ms: empty for Redis's clock (TIME, in production); a test clock's
--          instant otherwise (see instant() in _prelude.lua)
-- ARGV[3]  owner token (no '|')
-- ARGV[4]  lease_ms
-- ARGV[5]  claim generations "<width_ms>:<span>" (see below)
-- ARGV[6]  min_version: the ledger version the bucket's index must have reached
-- ARGV[7]  window_ms: the dedup window (also names the completed generations)
-- ARGV[8]  'hold': claim (write the leases below); 'look': the same verdicts, nothing
--          written (for a sink whose commit is the ledger's checked append: the
--          ledger, not a lease, keeps a key from being written twice); 'renew': the
--          same verdicts, only the owner's own claims (R) written, with a new lease
--          (a holder extending the keys it still works on; nothing absent is taken);
--          'track': as 'hold', and every key claimed is also recorded in the owner's
--          hash of the bucket <tag>:o:<owner> (field = key), which lives as long as a
--          lease: renew.lua extends the leases of the keys listed there, for a holder
--          that does not know its keys (a Spark driver whose executors claimed them).
--          That name is then one of KEYS too.
-- ARGV[9..] business keys (every name built here from ARGV[1] shares the hash
--          tag of KEYS[1], so the script stays in one cluster slot)
--
-- Layout: COMPLETED keys live in generation hashes  <tag>:c:<window>:<gen>
-- (field = key, value = <fingerprint>|<completed_at_ms>, gen = completed_at div
-- window); a key is COMPLETED while completed_at + window > now, so the current
-- and the previous generation hold every live one, and the next one too: a writer
-- whose clock ran ahead (an injected test clock, or a completed_at stamped by a
-- clock ahead of Redis's) may have completed a key past the boundary already
-- (every value there, and in the current one, is live). Claims live in generation
-- hashes too:  <tag>:p:<width>:<pgen>  field = key, value =
-- P|<owner>|<lease_until_ms>|<attempt>, pgen = claimed_at div width. span =
-- ceil(lease / width), so generations pgen-span .. pgen hold every live lease
-- (newest first: a renewed claim is moved to the current generation). A claim
-- hash expires when it leaves that range, so an abandoned claim is remembered
-- (as R or X below) for at least width. Every lookup and write is one C-level
-- command per chunk and hash (HMGET, HSET, HDEL), none per key.
--
-- Uses sliced/gathered/present/declared/instant/newest_claims from _prelude.lua (prepended when the script is loaded).
--
-- Returns {0} when the watermark is missing, below min_version or written for
-- another window: nothing was claimed, the caller must catch the index up first.
-- Otherwise {1, codes, fingerprint...}: codes has one character per key, in order
-- (with 'look' nothing is written, the verdicts are the same):
--   N  absent                          -> claimed, attempt 1
--   R  IN_PROGRESS by the same owner   -> claimed again (replay), lease renewed, attempt kept
--   X  IN_PROGRESS, lease expired      -> claimed, attempt + 1
--   B  IN_PROGRESS by another owner, lease live -> busy, untouched
--   D  COMPLETED                       -> duplicate; its fingerprint is appended to the reply
-- Errors: a claim value that is not P|... aborts with an error reply.

local wm = redis.call('GET', KEYS[1])
if not wm then
  return {0}
end
local version, window = string.match(wm, '^(%-?%d+)|(%d+)$')
if not version or window ~= ARGV[7] or tonumber(version) < tonumber(ARGV[6]) then
  return {0}
end

local tag = ARGV[1]
local now = instant(ARGV[2])
local owner = ARGV[3]
local lease_until = string.format('%d', now + tonumber(ARGV[4]))
local pwidth, span = string.match(ARGV[5], '^(%d+):(%d+)$')
pwidth, span = tonumber(pwidth), tonumber(span)
local width = tonumber(window)
local gen = math.floor(now / width)
local head = 'P|' .. owner .. '|'
local fresh = head .. lease_until .. '|1'

local mode = ARGV[8]
if mode ~= 'hold' and mode ~= 'look' and mode ~= 'renew' and mode ~= 'track' then
  return redis.error_reply('idem: claim mode must be hold, look, renew or track, got ' .. tostring(mode))
end
local track = mode == 'track'
local hold = mode == 'hold' or track
local renew = mode == 'renew'
local keys = {}
for i = 9, #ARGV do
  keys[#keys + 1] = ARGV[i]
end
local n = #keys
local current = declared(tag .. ':c:' .. window .. ':' .. gen)
local previous = declared(tag .. ':c:' .. window .. ':' .. (gen - 1))
local following = declared(tag .. ':c:' .. window .. ':' .. (gen + 1))
local none = {}  -- the reply of a lookup in a hash that does not exist
local function looked_up(hash)
  return present(hash) and gathered(keys, function(...) return redis.call('HMGET', hash, ...) end)
    or none
end
local cur = looked_up(current)
local prev = looked_up(previous)
local ahead = looked_up(following)  -- usually absent: one EXISTS

-- The claim generations, newest first; held[j] / where[j]: a key's newest claim.
local pgen, hashes, held, where = newest_claims(tag, keys, now, pwidth, span)

local reply = {1, ''}
local codes = {}
local writes, nw = {}, 0  -- field/value pairs to write, and how many values that is
local tracked = {}  -- 'track': field/value pairs of the owner's hash
local moved = {}  -- per older generation: keys whose renewed claim now lives in the current one
for j = 1, n do
  local done = false
  local stored = cur[j] or ahead[j] or prev[j]  -- only prev's may have run out
  if stored then
    local fingerprint, at = string.match(stored, '^(.*)|(%d+)$')
    if at and tonumber(at) + width > now then
      codes[j] = 'D'
      reply[#reply + 1] = fingerprint
      done = true
    end
  end
  if not done then
    local value = held[j]
    local write = nil
    if not value then
      codes[j], write = 'N', fresh
    else
      local holder, until_ms, attempt = string.match(value, '^P|([^|]*)|(%d+)|(%d+)$')
      if not holder then
        return redis.error_reply('idem: unrecognised value of the claim of ' .. keys[j] .. ' in ' .. hashes[where[j]])
      end
      if holder == owner then
        codes[j], write = 'R', head .. lease_until .. '|' .. attempt
      elseif tonumber(until_ms) > now then
        codes[j] = 'B'
      else
        codes[j], write = 'X', head .. lease_until .. '|' .. (tonumber(attempt) + 1)
      end
    end
    if write and not (hold or (renew and codes[j] == 'R')) then
      write = nil  -- look: the verdicts only; renew: only this owner's own claims
    end
    if write and value and where[j] > 1 then
      local list = moved[where[j]] or {}
      list[#list + 1] = keys[j]
      moved[where[j]] = list
    end
    if write then
      writes[nw + 1], writes[nw + 2] = keys[j], write
      if track then
        tracked[nw + 1], tracked[nw + 2] = keys[j], '1'
      end
      nw = nw + 2
    end
  end
end
if nw > 0 then
  sliced(writes, function(...) redis.call('HSET', hashes[1], ...) end)
  redis.call('PEXPIRE', hashes[1], string.format('%d', (pgen + span + 1) * pwidth - now))
  if track then
    local owned = declared(tag .. ':o:' .. owner)
    sliced(tracked, function(...) redis.call('HSET', owned, ...) end)
    redis.call('PEXPIRE', owned, ARGV[4])
  end
end
for i, list in pairs(moved) do
  sliced(list, function(...) redis.call('HDEL', hashes[i], ...) end)
end
reply[2] = table.concat(codes)
return reply
