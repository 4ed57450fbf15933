-- reset_offsets.lua: an operator moves a group's offsets (resetOffset), with a durable mark.
--
-- KEYS[1]  the group's offsets       HASH    rmq:offset:{<group>}        <topic>:<queue> -> offset
-- KEYS[2]  the group's reset marks   HASH    rmq:offset-reset:{<group>}  <topic>:<queue> -> "<epoch>:<offset>"
-- KEYS[3]  the group's reset epoch   STRING  rmq:offset-reset-epoch:{<group>}
-- ARGV[1]  now_ms (the operator's clock)
-- ARGV[2..] pairs: queue, offset
--
-- The offsets are written and each queue is marked with a new epoch, so an
-- instance that misses the reset's notice cannot write its old offset back
-- (persist_offsets.lua refuses it and hands the instance the reset instead).
-- An epoch is never lower than now_ms: if Redis loses the counter (FLUSHALL, an
-- older AOF, a lagging replica), the next reset's epoch is still above every one
-- the running instances remember. Returns the epoch.

local last = tonumber(redis.call('GET', KEYS[3]) or '0')
local epoch = string.format('%d', math.max(last + 1, tonumber(ARGV[1])))
redis.call('SET', KEYS[3], epoch)
for i = 2, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
  redis.call('HSET', KEYS[2], ARGV[i], epoch .. ':' .. ARGV[i + 1])
end
return epoch
