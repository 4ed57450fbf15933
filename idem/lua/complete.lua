-- idem: mark keys of ONE bucket COMPLETED after their ledger commit, with fencing,
-- and advance the bucket's watermark.
--
-- KEYS[1]  watermark key of the bucket     idem:{<group>:<bucket>}:wm
-- KEYS[2]  session key of a multi-call completion  idem:{<group>:<bucket>}:s:<token>
--          (used by modes 'part' and 'end' only)
-- ARGV[1]  key prefix of the bucket        idem:{<group>:<bucket>}:k:
-- ARGV[2]  owner token
-- ARGV[3]  now_ms (caller's clock)
-- ARGV[4]  px_ms: TTL of the COMPLETED values (completed_at + dedup window - now, >= 1)
-- ARGV[5]  completed_at_ms
-- ARGV[6]  version: the ledger version that holds these keys
-- ARGV[7]  window_ms: the dedup window (to restore a fenced claim's TTL)
-- ARGV[8]  mode:
--            'all'  the whole bucket in this call: write, then advance the watermark
--            'part' one chunk of a bigger bucket: write, count the chunk (and any
--                   fence) in the session key; the watermark is left alone
--            'end'  no keys: advance the watermark only if the session saw
--                   ARGV[9] chunks and no fence (a chunk lost by a Redis restart or
--                   failover in between is caught here), then drop the session
-- ARGV[9]  expected chunk count (mode 'end'), session TTL in ms (mode 'part')
-- ARGV[10..9+n]     n business keys
-- ARGV[10+n..9+2n]  their fingerprints (no '|')
--
-- Per key: COMPLETED is written when the key is absent, claimed by this owner,
-- claimed by anyone whose lease has expired, or already COMPLETED (the latest
-- completion sets the window, as in index.lua); a key another owner holds with a
-- live lease is fenced: its claim is left as it was. (The common case costs one
-- SET ... GET; a fenced claim is put back with its own TTL, lease_until + window - now,
-- inside the same atomic call, so nobody sees the overwrite.)
-- The watermark moves to max(wm, version) only if it exists, wm >= version - 1 and
-- no key of the bucket was fenced.
--
-- Returns {codes, advanced}: codes has one character per key, in order:
--   C  written COMPLETED     A  was COMPLETED already (rewritten)     F  fenced
-- advanced is 1 when the watermark now covers version, else 0.

local mode = ARGV[8]
local fenced = false
local codes = {}

if mode ~= 'end' then
  local prefix = ARGV[1]
  local own = 'P|' .. ARGV[2] .. '|'
  local now = tonumber(ARGV[3])
  local px = ARGV[4]
  local tail = '|' .. ARGV[5]
  local window = tonumber(ARGV[7])
  local n = (#ARGV - 9) / 2
  for i = 10, 9 + n do
    local name = prefix .. ARGV[i]
    local value = redis.call('SET', name, 'C|' .. ARGV[i + n] .. tail, 'PX', px, 'GET')
    if not value or string.find(value, own, 1, true) == 1 then
      codes[#codes + 1] = 'C'
    elseif string.byte(value, 1) == 67 then -- 'C'
      codes[#codes + 1] = 'A'
    else
      local until_ms = tonumber(string.match(value, '^P|[^|]*|(%d+)|'))
      if until_ms and until_ms > now then
        redis.call('SET', name, value, 'PX', string.format('%d', until_ms - now + window))
        fenced = true
        codes[#codes + 1] = 'F'
      else
        codes[#codes + 1] = 'C'
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
wm = tonumber(wm)
if wm >= version then
  return {table.concat(codes), 1}
end
if wm < version - 1 then
  return {table.concat(codes), 0}
end
redis.call('SET', KEYS[1], ARGV[6])
return {table.concat(codes), 1}
