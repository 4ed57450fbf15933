-- lock.lua: take or renew the orderly-consumption locks of some message queues, atomically.
--
-- A queue is consumed orderly by one instance at a time (the broker's
-- RebalanceLockManager). A lock is free when its key is missing (never taken, released,
-- or expired by its TTL); the holder renews it before the TTL runs out.
--
-- KEYS[1..n]  one lock per queue   STRING  holder client id, with a TTL
--             (all under the group's hash tag rmq:lock:{<group>}:...)
-- ARGV[1]     client id
-- ARGV[2]     ttl_ms
--
-- Returns {1|0, ...}: per key, 1 = held by this client now (taken or renewed), 0 = another
-- client holds it.

local reply = {}
for i, key in ipairs(KEYS) do
  local holder = redis.call('GET', key)
  if not holder or holder == ARGV[1] then
    redis.call('SET', key, ARGV[1], 'PX', ARGV[2])
    reply[i] = 1
  else
    reply[i] = 0
  end
end
return reply
