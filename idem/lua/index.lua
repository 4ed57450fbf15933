-- idem: load keys of ONE bucket from the Delta ledger as COMPLETED (catch-up or
-- rebuild of the Redis index), then move the bucket's watermark.
--
-- KEYS[1]  watermark of the bucket         idem:{<group>:<bucket>}:wm  "<version>|<window_ms>"
-- KEYS[2]  session key of a multi-call load  idem:{<group>:<bucket>}:s:<token>
-- KEYS[3..] the completed generation hashes this call's keys go to (see below)
-- ARGV[1]  hash tag of the bucket          idem:{<group>:<bucket>}
-- ARGV[2]  now_ms: empty for Redis's clock (TIME), a test clock's instant otherwise
-- ARGV[3]  window_ms: the dedup window
-- ARGV[4]  to_version: every ledger version <= it is in this load (with what was
--          indexed before)
-- ARGV[5]  from_version: the load holds versions (from_version, to_version]; an
--          empty string means a rebuild of the whole window
-- ARGV[6]  mode: 'all' (load then move the watermark), 'part' (load one chunk and
--          count it in the session key), 'end' (no keys: move the watermark only
--          if the session counted ARGV[7] chunks, then drop the session)
-- ARGV[7]  expected chunk count (mode 'end'), session TTL in ms (mode 'part')
-- ARGV[8..7+n]        n business keys
-- ARGV[8+n..7+2n]     their fingerprints
-- ARGV[8+2n..7+3n]    their completed_at_ms
--
-- A key goes into the generation hash of its completed_at (layout in claim.lua);
-- a key already past its window is skipped; a value of the same generation
-- completed at the same time or later is kept (the latest completion sets the
-- window). Claims are not touched: a COMPLETED key wins over any claim.
-- The watermark becomes "<max(wm, to_version)>|<window>" if (rebuild and the wm
-- is missing or written for another window) or (the wm exists for this window
-- and wm >= from_version).
--
-- Uses sliced/gathered/declared/instant from _prelude.lua (prepended when the script is loaded).
--
-- Returns {written, advanced}: keys written, and 1 if the watermark now covers
-- to_version (else 0).

local mode = ARGV[6]
local window = ARGV[3]
local written = 0

if mode ~= 'end' and #ARGV > 7 then
  local tag = ARGV[1]
  local now = instant(ARGV[2])
  local width = tonumber(window)
  local n = (#ARGV - 7) / 3
  local by_gen = {}
  for i = 8, 7 + n do
    local at = tonumber(ARGV[i + 2 * n])
    if at + width > now then
      local gen = math.floor(at / width)
      local list = by_gen[gen]
      if not list then
        list = {}
        by_gen[gen] = list
      end
      list[#list + 1] = i
    end
  end
  for gen, list in pairs(by_gen) do
    local hash = declared(tag .. ':c:' .. window .. ':' .. gen)
    local names = {}
    for j = 1, #list do
      names[j] = ARGV[list[j]]
    end
    local stored = gathered(names, function(...) return redis.call('HMGET', hash, ...) end)
    local fields = {}
    for j = 1, #list do
      local i = list[j]
      local at = tonumber(ARGV[i + 2 * n])
      local old = stored[j] and tonumber(string.match(stored[j], '|(%d+)$'))
      if not (old and old >= at) then
        fields[#fields + 1] = ARGV[i]
        fields[#fields + 1] = ARGV[i + n] .. '|' .. ARGV[i + 2 * n]
      end
    end
    if #fields > 0 then
      sliced(fields, function(...) redis.call('HSET', hash, ...) end)
      redis.call('PEXPIRE', hash, string.format('%d', (gen + 2) * width - now))
      written = written + #fields / 2
    end
  end
end

if mode == 'part' then
  redis.call('HINCRBY', KEYS[2], 'chunks', 1)
  redis.call('PEXPIRE', KEYS[2], ARGV[7])
  return {written, 0}
end

if mode == 'end' then
  local chunks = redis.call('HGET', KEYS[2], 'chunks')
  redis.call('DEL', KEYS[2])
  if tonumber(chunks or 0) ~= tonumber(ARGV[7]) then
    return {0, 0}
  end
end

local to_version = tonumber(ARGV[4])
local rebuild = ARGV[5] == ''
local wm = redis.call('GET', KEYS[1])
local indexed, indexed_window
if wm then
  indexed, indexed_window = string.match(wm, '^(%-?%d+)|(%d+)$')
end
if indexed and indexed_window == window then
  indexed = tonumber(indexed)
  if not rebuild and indexed < tonumber(ARGV[5]) then
    return {written, 0}
  end
  if indexed >= to_version then
    return {written, 1}
  end
elseif not rebuild then
  return {written, 0}
end
redis.call('SET', KEYS[1], ARGV[4] .. '|' .. window)
return {written, 1}
