-- idem.spark: record the counters of one micro-batch, once per (query, batch id).
--
-- Spark replays a micro-batch after a driver crash; the replay must not count
-- the batch's messages twice, but the evidence of the replay (claims re-taken,
-- i.e. possible repeats of a non-transactional sink) must be counted every time.
--
-- KEYS[1]  marker of the batch       idem:{<group>}:spark:batch:<query id>:<batch id>
-- KEYS[2]  the group's totals hash   idem:{<group>}:spark:totals
-- ARGV[1]  marker TTL in ms (the dedup window: a replay later than that is a new batch)
-- ARGV[2]  n = number of (field, increment) pairs counted once per batch
-- ARGV[3 .. 2+2n]   those pairs
-- ARGV[3+2n ..]     (field, increment) pairs counted on every attempt
--
-- Returns 1 when this attempt was the first to record the batch, 0 for a replay
-- (then only the every-attempt pairs are added; replays are counted by begin_batch.lua).

local first = redis.call('SET', KEYS[1], '1', 'NX', 'PX', tonumber(ARGV[1]))
local n = tonumber(ARGV[2])
local always_from = 3 + 2 * n
if first then
  for i = 3, always_from - 1, 2 do
    redis.call('HINCRBY', KEYS[2], ARGV[i], tonumber(ARGV[i + 1]))
  end
end
for i = always_from, #ARGV, 2 do
  redis.call('HINCRBY', KEYS[2], ARGV[i], tonumber(ARGV[i + 1]))
end
if first then
  return 1
end
return 0
