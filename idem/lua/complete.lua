-- idem: mark keys of ONE bucket COMPLETED after their ledger commit, with fencing,
-- and advance the bucket's watermark.
--
-- KEYS[1]  watermark of the bucket     idem:{<group>:<bucket>}:wm   "<version>|<window_ms>"
-- KEYS[2]  session key of a multi-call completion  idem:{<group>:<bucket>}:s:<token>
--          (used by modes 'part' and 'end' only)
-- KEYS[3..] every hash named below that this call may read or write: the claim
--          generations pgen-span..pgen (for every now the caller's estimate of
--          Redis's clock allows) and the completed generation of ARGV[5]
-- ARGV[1]  hash tag of the bucket      idem:{<group>:<bucket>}
-- ARGV[2]  owner token
-- ARGV[3]  now_ms: empty for Redis's clock (TIME), a test clock's instant otherwise
-- ARGV[4]  claim generations "<width_ms>:<span>" (see claim.lua)
-- ARGV[5]  completed_at_ms
-- ARGV[6]  version: the ledger version that holds these keys
-- ARGV[7]  window_ms: the dedup window
-- ARGV[8]  mode:
--            'all'  the whole bucket in this call: write, then advance the watermark
--            'part' one chunk of a bigger bucket: write, count the chunk (and any
--                   fence) in the session key; the watermark is left alone
--            'end'  no keys: advance the watermark only if the session saw
--                   ARGV[9] chunks and no fence (a chunk lost by a Redis restart or
--                   failover in between is caught here), then drop the session
-- ARGV[9]  expected chunk count (mode 'end'), session TTL in ms (mode 'part')
-- ARGV[10..9+2n]   n pairs: a business key, then its value
--                   <fingerprint>|<completed_at_ms> (the fingerprint without '|';
--                   the time is ARGV[5])
--
-- Per key (see claim.lua for the layout): the key becomes COMPLETED — field
-- <key> = its value in the generation hash of completed_at, whose TTL runs to
-- the end of the next generation — and its claim is deleted from every claim
-- generation, when the newest claim is absent, this owner's, or another
-- owner's with an expired lease. A key another owner holds with a live lease
-- is fenced: nothing is written for it. C-level calls per chunk and hash
-- (HMGET, HSET, HDEL), none per key. When no claim generation exists (a sink
-- that takes no leases, or every claim already gone) the pairs go to HSET
-- straight from ARGV: no Lua table is built for them.
-- The watermark moves to max(wm, version) only if it exists for this window,
-- wm >= version - 1 and no key of the bucket was fenced.
--
-- Uses sliced/gathered/present/declared/instant from _prelude.lua (prepended when the script is loaded).
--
-- Returns {codes, advanced}: codes has one character per key, in order:
--   C  written COMPLETED     F  fenced
-- advanced is 1 when the watermark now covers version, else 0.

local mode = ARGV[8]
local fenced = false
local codes = {}
local now = instant(ARGV[3])
local window = ARGV[7]
local width = tonumber(window)

if mode ~= 'end' and #ARGV > 9 then
  local tag = ARGV[1]
  local own = 'P|' .. ARGV[2] .. '|'
  local n = (#ARGV - 9) / 2
  local pwidth, span = string.match(ARGV[4], '^(%d+):(%d+)$')
  pwidth, span = tonumber(pwidth), tonumber(span)
  local pgen = math.floor(now / pwidth)
  local hashes, found = {}, {}
  local keys = nil  -- built only when some claim generation exists
  for i = 0, span do
    local hash = declared(tag .. ':p:' .. pwidth .. ':' .. (pgen - i))
    if present(hash) then
      if keys == nil then
        keys = {}
        for j = 1, n do
          keys[j] = ARGV[8 + 2 * j]
        end
      end
      hashes[#hashes + 1] = hash
      found[#found + 1] = gathered(keys, function(...) return redis.call('HMGET', hash, ...) end)
    end
  end
  local gen = math.floor(tonumber(ARGV[5]) / width)
  local px = (gen + 2) * width - now
  local target = declared(tag .. ':c:' .. window .. ':' .. gen)
  if keys == nil then
    codes = {string.rep('C', n)}
    if px > 0 then
      for i = 10, #ARGV, SLICE do  -- SLICE is even: no pair is split
        redis.call('HSET', target, unpack(ARGV, i, math.min(i + SLICE - 1, #ARGV)))
      end
      redis.call('PEXPIRE', target, string.format('%d', px))
    end
  else
    local fields = {}
    local mine_keys = {}
    for j = 1, n do
      local value = nil
      for i = 1, #found do
        value = found[i][j]
        if value then
          break
        end
      end
      local mine = true
      if value and string.find(value, own, 1, true) ~= 1 then
        local until_ms = tonumber(string.match(value, '^P|[^|]*|(%d+)|'))
        if until_ms == nil then
          return redis.error_reply('idem: unrecognised value of the claim of ' .. keys[j])
        end
        mine = until_ms <= now
      end
      if mine then
        codes[j] = 'C'
        fields[#fields + 1] = keys[j]
        fields[#fields + 1] = ARGV[9 + 2 * j]
        mine_keys[j] = true
      else
        codes[j] = 'F'
        fenced = true
      end
    end
    if #fields > 0 and px > 0 then
      sliced(fields, function(...) redis.call('HSET', target, ...) end)
      redis.call('PEXPIRE', target, string.format('%d', px))
    end
    for i = 1, #hashes do
      local drop = {}
      for j = 1, n do
        if mine_keys[j] and found[i][j] then
          drop[#drop + 1] = keys[j]
        end
      end
      if #drop > 0 then
        sliced(drop, function(...) redis.call('HDEL', hashes[i], ...) end)
      end
    end
  end
end

if mode == 'part' then
  redis.call('HINCRBY', KEYS[2], 'chunks', 1)
  if fenced then
    redis.call('HSET', KEYS[2], 'fenced', 1)
  end
  redis.call('PEXPIRE', KEYS[2], ARGV[9])
  return {table.concat(codes), 0}
end

if mode == 'end' then
  local session = redis.call('HMGET', KEYS[2], 'chunks', 'fenced')
  redis.call('DEL', KEYS[2])
  if tonumber(session[1] or 0) ~= tonumber(ARGV[9]) or session[2] then
    return {'', 0}
  end
elseif fenced then
  return {table.concat(codes), 0}
end

local version = tonumber(ARGV[6])
local wm = redis.call('GET', KEYS[1])
if not wm then
  return {table.concat(codes), 0}
end
local indexed, indexed_window = string.match(wm, '^(%-?%d+)|(%d+)$')
if not indexed or indexed_window ~= window then
  return {table.concat(codes), 0}
end
indexed = tonumber(indexed)
if indexed >= version then
  return {table.concat(codes), 1}
end
if indexed < version - 1 then
  return {table.concat(codes), 0}
end
redis.call('SET', KEYS[1], ARGV[6] .. '|' .. window)
return {table.concat(codes), 1}
