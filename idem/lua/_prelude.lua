-- idem: helpers prepended to every idem script when it is loaded (a Redis script
-- cannot import another). No KEYS, no ARGV, no reply of its own.
--
-- Lua's C stack takes ~8000 values, so long argument lists go to Redis in
-- slices (of an even size, so field/value pairs never split):
--   sliced(list, fn)    calls fn(slice...) for each slice of list
--   gathered(list, fn)  the same, concatenating the tables fn returns
--   present(name)       whether a key exists (a lookup in a missing hash is skipped)

local SLICE = 4000

local function sliced(list, fn)
  for i = 1, #list, SLICE do
    fn(unpack(list, i, math.min(i + SLICE - 1, #list)))
  end
end

local function gathered(list, fn)
  if #list <= SLICE then
    return fn(unpack(list))  -- one slice: its reply is the whole answer
  end
  local out = {}
  sliced(list, function(...)
    local part = fn(...)
    for j = 1, #part do
      out[#out + 1] = part[j]
    end
  end)
  return out
end


local function present(name)
  return redis.call('EXISTS', name) == 1
end
