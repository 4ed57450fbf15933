-- idem: claim a batch of business keys of ONE bucket (atomic per call).
--
-- KEYS[1]  watermark of the bucket      idem:{<group>:<bucket>}:wm   "<version>|<window_ms>"
-- ARGV[1]  hash tag of the bucket       idem:{<group>:<bucket>}
-- ARGV[2]  now_ms (from the caller's clock, never Redis TIME)
-- ARGV[3]  owner token (no '|')
-- ARGV[4]  lease_ms
-- ARGV[5]  gc_ms: PX of a claim (lease + dedup window), so abandoned claims do
--          not live forever; the lease itself is the value's lease_until
-- ARGV[6]  min_version: the ledger version the bucket's index must have reached
-- ARGV[7]  window_ms: the dedup window (also names the completed generations)
-- ARGV[8..] business keys (every name built here from ARGV[1] shares the hash
--          tag of KEYS[1], so the script stays in one cluster slot)
--
-- Layout: COMPLETED keys live in generation hashes  <tag>:c:<window>:<gen>
-- (field = key, value = <fingerprint>|<completed_at_ms>, gen = completed_at div
-- window); a key is COMPLETED while completed_at + window > now, so the current
-- and the previous generation hold every live one. Claims are plain keys
--   <tag>:k:<key>  P|<owner>|<lease_until_ms>|<attempt>
--
-- Uses sliced/gathered from _prelude.lua (prepended when the script is loaded).
--
-- Returns {0} when the watermark is missing, below min_version or written for
-- another window: nothing was claimed, the caller must catch the index up first.
-- Otherwise {1, codes, fingerprint...}: codes has one character per key, in order:
--   N  absent                          -> claimed, attempt 1
--   R  IN_PROGRESS by the same owner   -> claimed again (replay), lease renewed, attempt kept
--   X  IN_PROGRESS, lease expired      -> claimed, attempt + 1
--   B  IN_PROGRESS by another owner, lease live -> busy, untouched
--   D  COMPLETED                       -> duplicate; its fingerprint is appended to the reply
-- Errors: a claim value that is not P|... aborts with an error reply.
-- Needs Redis >= 7.0 (SET with both NX and GET).

local wm = redis.call('GET', KEYS[1])
if not wm then
  return {0}
end
local version, window = string.match(wm, '^(%-?%d+)|(%d+)$')
if not version or window ~= ARGV[7] or tonumber(version) < tonumber(ARGV[6]) then
  return {0}
end

local tag = ARGV[1]
local now = tonumber(ARGV[2])
local owner = ARGV[3]
local lease_until = string.format('%d', now + tonumber(ARGV[4]))
local gc_ms = ARGV[5]
local width = tonumber(window)
local gen = math.floor(now / width)
local head = 'P|' .. owner .. '|'
local fresh = head .. lease_until .. '|1'
local claims = tag .. ':k:'

-- Two C-level lookups for the whole chunk (not one call per key).
local keys = {}
for i = 8, #ARGV do
  keys[#keys + 1] = ARGV[i]
end
local current = tag .. ':c:' .. window .. ':' .. gen
local previous = tag .. ':c:' .. window .. ':' .. (gen - 1)
local cur = gathered(keys, function(...) return redis.call('HMGET', current, ...) end)
local prev = gathered(keys, function(...) return redis.call('HMGET', previous, ...) end)

local reply = {1, ''}
local codes = {}
for j = 1, #ARGV - 7 do
  local done = false
  local stored = cur[j] or prev[j]
  if stored then
    local fingerprint, at = string.match(stored, '^(.*)|(%d+)$')
    if at and tonumber(at) + width > now then
      codes[j] = 'D'
      reply[#reply + 1] = fingerprint
      done = true
    end
  end
  if not done then
    local name = claims .. ARGV[j + 7]
    -- One command for the common case (a new key): SET NX GET writes only when
    -- absent and hands back what was there otherwise.
    local value = redis.call('SET', name, fresh, 'NX', 'GET', 'PX', gc_ms)
    if not value then
      codes[j] = 'N'
    else
      local holder, until_ms, attempt = string.match(value, '^P|([^|]*)|(%d+)|(%d+)$')
      if not holder then
        return redis.error_reply('idem: unrecognised value at ' .. name)
      end
      if holder == owner then
        redis.call('SET', name, head .. lease_until .. '|' .. attempt, 'PX', gc_ms)
        codes[j] = 'R'
      elseif tonumber(until_ms) > now then
        codes[j] = 'B'
      else
        redis.call('SET', name, head .. lease_until .. '|' .. (tonumber(attempt) + 1), 'PX', gc_ms)
        codes[j] = 'X'
      end
    end
  end
end
reply[2] = table.concat(codes)
return reply
