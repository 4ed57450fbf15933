-- idem: claim a batch of business keys of ONE bucket (atomic per call).
--
-- KEYS[1]  watermark key of the bucket  idem:{<group>:<bucket>}:wm
-- ARGV[1]  key prefix of the bucket     idem:{<group>:<bucket>}:k:
-- ARGV[2]  now_ms (from the caller's clock, never Redis TIME)
-- ARGV[3]  owner token (no '|')
-- ARGV[4]  lease_ms
-- ARGV[5]  gc_ms: PX of an IN_PROGRESS value (lease + dedup window), so abandoned
--          claims do not live forever; the lease itself is the value's lease_until
-- ARGV[6]  min_version: the ledger version the bucket's index must have reached
-- ARGV[7..] business keys (the key names are built here from ARGV[1]: every one
--          shares the hash tag of KEYS[1], so the script stays in one cluster slot)
--
-- Values: IN_PROGRESS  P|<owner>|<lease_until_ms>|<attempt>
--         COMPLETED    C|<fingerprint>|<completed_at_ms>
--
-- Returns {0} when the watermark is missing or below min_version: nothing was
-- claimed, the caller must catch the index up first. Otherwise
-- {1, codes, fingerprint...}: codes has one character per key, in order:
--   N  absent                          -> claimed, attempt 1
--   R  IN_PROGRESS by the same owner   -> claimed again (replay), lease renewed, attempt kept
--   X  IN_PROGRESS, lease expired      -> claimed, attempt + 1
--   B  IN_PROGRESS by another owner, lease live -> busy, untouched
--   D  COMPLETED                       -> duplicate; its fingerprint is appended to the reply
-- Errors: a value that is neither P|... nor C|... aborts with an error reply.
-- Needs Redis >= 7.0 (SET with both NX and GET).

local wm = redis.call('GET', KEYS[1])
if not wm or tonumber(wm) < tonumber(ARGV[6]) then
  return {0}
end

local prefix = ARGV[1]
local now = tonumber(ARGV[2])
local owner = ARGV[3]
local lease_until = string.format('%d', now + tonumber(ARGV[4]))
local gc_ms = ARGV[5]
local head = 'P|' .. owner .. '|'
local fresh = head .. lease_until .. '|1'

local reply = {1, ''}
local codes = {}
for i = 7, #ARGV do
  local name = prefix .. ARGV[i]
  -- One command for the common case (a new key): SET NX GET writes only when absent
  -- and hands back what was there otherwise (Redis >= 7.0).
  local value = redis.call('SET', name, fresh, 'NX', 'GET', 'PX', gc_ms)
  if not value then
    codes[#codes + 1] = 'N'
  elseif string.byte(value, 1) == 67 then -- 'C'
    codes[#codes + 1] = 'D'
    reply[#reply + 1] = string.match(value, '^C|(.*)|')
  else
    local holder, until_ms, attempt = string.match(value, '^P|([^|]*)|(%d+)|(%d+)$')
    if not holder then
      return redis.error_reply('idem: unrecognised value at ' .. name)
    end
    if holder == owner then
      redis.call('SET', name, head .. lease_until .. '|' .. attempt, 'PX', gc_ms)
      codes[#codes + 1] = 'R'
    elseif tonumber(until_ms) > now then
      codes[#codes + 1] = 'B'
    else
      redis.call('SET', name, head .. lease_until .. '|' .. (tonumber(attempt) + 1), 'PX', gc_ms)
      codes[#codes + 1] = 'X'
    end
  end
end
reply[2] = table.concat(codes)
return reply
