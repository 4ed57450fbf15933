-- idem.spark: count an attempt at one micro-batch; a second attempt is a Spark replay.
--
-- Spark runs a micro-batch again, with the same id, when the driver died before
-- the batch reached its commit log. Counting attempts at the start of the batch
-- (before anything else) tells the report how many batches were replayed, even
-- when the first attempt died before it could record anything.
--
-- KEYS[1]  attempts of the batch     idem:{<group>}:spark:attempts:<query id>:<batch id>
-- KEYS[2]  the group's totals hash   idem:{<group>}:spark:totals
-- ARGV[1]  TTL of the counter in ms (the dedup window)
--
-- Returns the attempt number (1 for the first run of the batch).

local n = redis.call('INCR', KEYS[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]))
if n > 1 then
  redis.call('HINCRBY', KEYS[2], 'replayed_batches', 1)
end
return n
