-- apply.lua: apply send-back / ack events of one consumer group to its Redis side, atomically.
--
-- The Delta retry journal is the log; this script replays a slice of it (mode "cursor",
-- checking and advancing the group's journal cursor in the same step) or applies a
-- client-side resend directly (mode "direct", cursor untouched). Every op is idempotent:
-- a message already live is not scheduled twice, a message already gone is not removed twice.
-- A message is replaced at most once: one failed delivery continues in one chain, however
-- many copies of it were sent back (a takeover's and a local re-submit's, a redelivery).
--
-- KEYS[1]   cursor    STRING  next journal position to apply, "<version>:<seq>"
-- KEYS[2]   live      HASH    msg_id -> "S|<queue id>:<arrival seq>|<origin>" (scheduled)
--                                     or "R|<stream id>|<origin>" (in %RETRY%<group>)
-- KEYS[3]   payloads  HASH    msg_id -> wire JSON of a scheduled message
-- KEYS[4]   heads     ZSET    queue id -> due ms of the queue's head
-- KEYS[5]   stream    STREAM  %RETRY%<group>
-- KEYS[6]   progress  HASH    field "seq": last arrival number given to a scheduled message
-- KEYS[7]   replaced  ZSET    msg_id -> journal time (ms) of the event that replaced it: its
--                             chain went on in another message, so a late copy of it sent
--                             back again, or the same message placed again, would fork it
-- KEYS[8..] schedule queues (ZSET "<arrival seq, 16 digits>:<msg_id>" -> due ms), named by
--           the ops' key index; the arrival number keeps a queue FIFO within one millisecond
--
-- ARGV[1]   mode: "cursor" | "direct"
-- ARGV[2]   expected cursor ("" = the cursor key must be missing); mode "cursor" only
-- ARGV[3]   new cursor; mode "cursor" only
-- ARGV[4]   consumer group name (XACK of removed stream entries)
-- ARGV[5]   wake channel: PUBLISHed when the earliest due time moves earlier
-- ARGV[6]   how long a replacement is remembered (ms of journal time)
-- ARGV[7..] ops, 9 fields each:
--           "S", msg_id, origin, key index, queue id, due ms, wire, replaces, at ms  -- schedule
--           "X", msg_id, "",     "",        "",       "",     "",   replaces, at ms  -- the same
--                event, its message removed again later in the slice: replace, not schedule
--           "R", msg_id, "",     "",        "",       "",     "",   "",       at ms  -- remove
--           A schedule op whose message or whose ``replaces`` was replaced at most ARGV[6] ms
--           of journal time before it is a late copy: it changes nothing (counted skipped).
--
-- Returns {1, scheduled, removed, skipped}
--      or {0, current cursor} when the cursor is not the expected one (nothing applied).

local mode = ARGV[1]
if mode == 'cursor' then
  local current = redis.call('GET', KEYS[1])
  if (ARGV[2] == '' and current) or (ARGV[2] ~= '' and current ~= ARGV[2]) then
    return {0, current or ''}
  end
end

local FIELDS, FIRST = 9, 7
local group = ARGV[4]
local kept = tonumber(ARGV[6])
local before = redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')
local min_before = before[2] and tonumber(before[2]) or nil
local min_new = nil
local newest = nil
local queue_min = {}
local scheduled, removed, skipped = 0, 0, 0
local ops = math.floor((#ARGV - FIRST + 1) / FIELDS)
-- arrival numbers for this call, reserved at once (unused ones are simply skipped)
local seq = redis.call('HINCRBY', KEYS[6], 'seq', ops) - ops

local function was_replaced(id, at)
  local when = redis.call('ZSCORE', KEYS[7], id)
  return when and at - tonumber(when) <= kept
end

local function remove(id)
  local state = redis.call('HGET', KEYS[2], id)
  if not state then return end
  if string.sub(state, 1, 1) == 'R' then
    local sid = string.match(state, '^R|([^|]+)|')
    redis.call('XACK', KEYS[5], group, sid)
    redis.call('XDEL', KEYS[5], sid)
  else
    -- still scheduled: its queue entry is dropped by move.lua when it comes due
    redis.call('HDEL', KEYS[3], id)
  end
  redis.call('HDEL', KEYS[2], id)
  removed = removed + 1
end

for i = FIRST, #ARGV, FIELDS do
  local kind, id, at = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 8])
  if not newest or at > newest then newest = at end
  if kind == 'R' then
    remove(id)
  else
    local replaces = ARGV[i + 7]
    if was_replaced(id, at) or (replaces ~= '' and was_replaced(replaces, at)) then
      skipped = skipped + 1
    else
      if replaces ~= '' then
        remove(replaces)
        redis.call('ZADD', KEYS[7], at, replaces)
      end
      if kind == 'S' then
        if redis.call('HEXISTS', KEYS[2], id) == 1 then
          skipped = skipped + 1
        else
          local qid, due = ARGV[i + 4], tonumber(ARGV[i + 5])
          seq = seq + 1
          local arrival = string.format('%016d', seq)
          redis.call('ZADD', KEYS[tonumber(ARGV[i + 3])], due, arrival .. ':' .. id)
          redis.call('HSET', KEYS[3], id, ARGV[i + 6])
          redis.call('HSET', KEYS[2], id, 'S|' .. qid .. ':' .. arrival .. '|' .. ARGV[i + 2])
          if not queue_min[qid] or due < queue_min[qid] then queue_min[qid] = due end
          if not min_new or due < min_new then min_new = due end
          scheduled = scheduled + 1
        end
      end
    end
  end
end

if newest then
  -- kept twice as long as it is consulted: events a little out of journal-time order
  -- (clocks of different writers) still find what they must
  redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', '(' .. string.format('%d', newest - 2 * kept))
end
for qid, due in pairs(queue_min) do
  redis.call('ZADD', KEYS[4], 'LT', due, qid)
end
if mode == 'cursor' then
  redis.call('SET', KEYS[1], ARGV[3])
end
if min_new and (not min_before or min_new < min_before) then
  redis.call('PUBLISH', ARGV[5], string.format('%d', min_new))
end
return {1, scheduled, removed, skipped}
