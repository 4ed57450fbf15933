-- persist_offsets.lua: write a consumer's offsets, unless an operator reset them meanwhile.
--
-- KEYS[1]  the group's offsets       HASH  rmq:offset:{<group>}        <topic>:<queue> -> offset
-- KEYS[2]  the group's reset marks   HASH  rmq:offset-reset:{<group>}  <topic>:<queue> -> "<epoch>:<offset>"
-- ARGV     triples: queue, offset, the reset epoch this instance has applied to the queue (0: none)
--
-- A queue whose reset mark is newer than the epoch the instance applied is not
-- written: the instance missed that reset's notice, and its offset would undo
-- the reset. Returns those queues and their marks {queue, mark, ...}, for the
-- instance to apply the reset now.

local missed = {}
local writes = {}
for i = 1, #ARGV, 3 do
  local queue, offset, seen = ARGV[i], ARGV[i + 1], tonumber(ARGV[i + 2])
  local mark = redis.call('HGET', KEYS[2], queue)
  local epoch = mark and tonumber(string.match(mark, '^(%d+):'))
  if epoch and epoch > seen then
    missed[#missed + 1] = queue
    missed[#missed + 1] = mark
  else
    writes[#writes + 1] = queue
    writes[#writes + 1] = offset
  end
end
if #writes > 0 then
  redis.call('HSET', KEYS[1], unpack(writes))
end
return missed
