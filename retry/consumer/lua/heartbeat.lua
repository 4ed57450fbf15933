-- heartbeat.lua: one consumer instance's heartbeat into its group, and the group's members.
--
-- Instances that have not beaten for expire_ms are removed (the broker's channel scan).
-- When the membership changes (a new member, a leave, an expiry) the group's epoch is
-- incremented and published, so every member rebalances at once
-- (NOTIFY_CONSUMER_IDS_CHANGED).
--
-- KEYS[1]  members  ZSET    client id -> last heartbeat (ms, the caller's clock)
-- KEYS[2]  epoch    STRING  membership version, incremented on every change
--
-- ARGV[1]  now (ms)
-- ARGV[2]  expire_ms: a member older than now - expire_ms is gone
-- ARGV[3]  client id
-- ARGV[4]  op: "beat" (join or stay) | "leave" (clean shutdown) | "look" (read only)
-- ARGV[5]  notify channel
--
-- Returns {epoch, changed (0|1), member, member, ...} (members sorted by client id).

local now = tonumber(ARGV[1])
local changed = 0

local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. (now - tonumber(ARGV[2])))
for _, member in ipairs(expired) do
  if member ~= ARGV[3] or ARGV[4] ~= 'beat' then
    redis.call('ZREM', KEYS[1], member)
    changed = 1
  end
end

if ARGV[4] == 'beat' then
  if redis.call('ZADD', KEYS[1], now, ARGV[3]) == 1 then
    changed = 1
  end
elseif ARGV[4] == 'leave' then
  if redis.call('ZREM', KEYS[1], ARGV[3]) == 1 then
    changed = 1
  end
end

local epoch
if changed == 1 then
  epoch = redis.call('INCR', KEYS[2])
  redis.call('PUBLISH', ARGV[5], 'ids_changed:' .. epoch)
else
  epoch = tonumber(redis.call('GET', KEYS[2]) or '0')
end

local members = redis.call('ZRANGE', KEYS[1], 0, -1)
table.sort(members)
local reply = {epoch, changed}
for _, member in ipairs(members) do
  reply[#reply + 1] = member
end
return reply
