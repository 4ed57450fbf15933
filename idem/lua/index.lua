-- idem: load keys of ONE bucket from the Delta ledger as COMPLETED (catch-up or
-- rebuild of the Redis index), then move the bucket's watermark.
--
-- KEYS[1]  watermark key of the bucket     idem:{<group>:<bucket>}:wm
-- KEYS[2]  session key of a multi-call load  idem:{<group>:<bucket>}:s:<token>
-- ARGV[1]  key prefix of the bucket        idem:{<group>:<bucket>}:k:
-- ARGV[2]  now_ms (caller's clock)
-- ARGV[3]  window_ms: the dedup window (TTL of a COMPLETED key from its completion)
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
-- A key is written COMPLETED with PX = completed_at + window - now, so the window
-- stays exact; a key already past its window is skipped. An IN_PROGRESS claim is
-- overwritten (the ledger is the truth); a COMPLETED value completed at the same
-- time or later is kept (the latest completion sets the window).
-- The watermark becomes max(wm, to_version) if (rebuild and wm missing) or
-- (wm exists and wm >= from_version).
--
-- Returns {written, advanced}: keys written, and 1 if the watermark now covers
-- to_version (else 0).

local mode = ARGV[6]
local written = 0

if mode ~= 'end' then
  local prefix = ARGV[1]
  local now = tonumber(ARGV[2])
  local window = tonumber(ARGV[3])
  local n = (#ARGV - 7) / 3
  for i = 8, 7 + n do
    local at = tonumber(ARGV[i + 2 * n])
    local px = at + window - now
    if px > 0 then
      local name = prefix .. ARGV[i]
      local value = redis.call('GET', name)
      local keep = false
      if value and string.byte(value, 1) == 67 then -- 'C'
        local stored_at = tonumber(string.match(value, '|(%d+)$'))
        keep = stored_at ~= nil and stored_at >= at
      end
      if not keep then
        redis.call('SET', name, 'C|' .. ARGV[i + n] .. '|' .. ARGV[i + 2 * n],
          'PX', string.format('%d', px))
        written = written + 1
      end
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
local wm = redis.call('GET', KEYS[1])
if wm then
  wm = tonumber(wm)
  if ARGV[5] ~= '' and wm < tonumber(ARGV[5]) then
    return {written, 0}
  end
  if wm >= to_version then
    return {written, 1}
  end
elseif ARGV[5] ~= '' then
  return {written, 0}
end
redis.call('SET', KEYS[1], ARGV[4])
return {written, 1}
