-- move.lua: the schedule service's step: move every due head message of the given schedule
-- queues to %RETRY%<group>, atomically (so two services never move a message twice).
--
-- Each schedule queue is ordered by due time, so only its head needs checking; a message
-- removed while scheduled (acked, dead, replaced) is dropped here when it comes due, and so is
-- an entry whose message was scheduled again since (its live state names another arrival).
--
-- KEYS[1]   heads     ZSET    queue id -> due ms of the queue's head
-- KEYS[2]   live      HASH    msg_id -> "S|<queue id>:<arrival seq>|<origin>"
--                             | "R|<stream id>|<origin>"
-- KEYS[3]   payloads  HASH    msg_id -> wire JSON of a scheduled message
-- KEYS[4]   stream    STREAM  %RETRY%<group>; entries: id, o (queue offset), d (due ms), m (wire)
-- KEYS[5]   progress  HASH    <queue id> -> due ms of the last message moved (delayOffset),
--                             <queue id>:moved -> messages moved, retry_offset -> next offset
-- KEYS[6..] schedule queues (ZSET "<arrival seq, 16 digits>:<msg_id>" -> due ms)
--
-- ARGV[1]   now (ms, the caller's clock)
-- ARGV[2]   budget: most messages to move in this call
-- ARGV[3..] queue ids, in the order of KEYS[6..]
--
-- Returns {moved, dropped, next due ms or ""} (next due: the earliest head left, any queue).

local now = tonumber(ARGV[1])
local budget = tonumber(ARGV[2])
local moved, dropped = 0, 0

for k = 6, #KEYS do
  if budget <= 0 then break end
  local queue, qid = KEYS[k], ARGV[k - 3]
  local due = redis.call('ZRANGEBYSCORE', queue, '-inf', now, 'WITHSCORES', 'LIMIT', 0, budget)
  local count = #due / 2
  if count > 0 then
    local base = redis.call('HINCRBY', KEYS[5], 'retry_offset', count) - count
    local last, queue_moved = due[#due], 0
    for j = 1, #due, 2 do
      local member, score = due[j], due[j + 1]
      local id, seq = string.sub(member, 18), string.sub(member, 1, 16)
      local state = redis.call('HGET', KEYS[2], id) or ''
      local arrival, origin = string.match(state, '^S|[^|]*:(%d+)|(.*)$')
      local wire = redis.call('HGET', KEYS[3], id)
      if arrival == seq and wire then
        local sid = redis.call('XADD', KEYS[4], '*',
          'id', id, 'o', base + (j - 1) / 2, 'd', score, 'm', wire)
        redis.call('HSET', KEYS[2], id, 'R|' .. sid .. '|' .. origin)
        redis.call('HDEL', KEYS[3], id)
        queue_moved = queue_moved + 1
      else
        dropped = dropped + 1
      end
    end
    -- ZRANGEBYSCORE returned the lowest entries, so ZPOPMIN removes exactly those
    redis.call('ZPOPMIN', queue, count)
    redis.call('HSET', KEYS[5], qid, last)
    redis.call('HINCRBY', KEYS[5], qid .. ':moved', queue_moved)
    moved = moved + queue_moved
    budget = budget - count
  end
  local head = redis.call('ZRANGE', queue, 0, 0, 'WITHSCORES')
  if #head == 0 then
    redis.call('ZREM', KEYS[1], qid)
  else
    redis.call('ZADD', KEYS[1], head[2], qid)
  end
end

local next_head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
return {moved, dropped, next_head[2] or ''}
