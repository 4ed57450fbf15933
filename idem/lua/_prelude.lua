-- idem: helpers prepended to every idem script when it is loaded (a Redis script
-- cannot import another). No KEYS, no ARGV, no reply of its own.
--
-- Lua's C stack takes ~8000 values, so long argument lists go to Redis in
-- slices (of an even size, so field/value pairs never split):
--   sliced(list, fn)    calls fn(slice...) for each slice of list
--   gathered(list, fn)  the same, concatenating the tables fn returns
--   present(name)       whether a key exists (a lookup in a missing hash is skipped)
--   declared(name)      name itself, or an error when it is not one of KEYS
--   instant(arg)        the now (epoch ms) a script decides leases and the dedup
--                       window by: Redis's own clock (TIME) when arg is empty, else
--                       arg itself (the instant of a caller's injected test clock)
--   newest_claims(tag, keys, now, pwidth, span)
--                       the claim generation hashes at now, newest first, and each
--                       key's newest claim: pgen, hashes, held[j] (its value),
--                       where[j] (the index of its hash)
--
-- Redis's clock, not the caller's, decides: a client whose clock is stepped or
-- runs ahead can neither take over a live lease nor see a completed key as new.
-- Redis 7 replicates a script's effects, not the script, so reading TIME is safe
-- on replicas and in an AOF. The caller names the generation hashes a call may
-- touch from its estimate of Redis's clock (with some slack); a TIME outside it
-- makes declared() fail before anything is written.
--
-- Every name a script builds goes through declared(): the caller declares all of
-- them in KEYS, so on a Redis Cluster whose slot is being migrated the server
-- answers ASK/TRYAGAIN instead of running the script on a node that already gave
-- some of those keys away (the script would take a moved hash for an empty one).

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


local DECLARED = {}
for i = 1, #KEYS do
  DECLARED[KEYS[i]] = true
end

local function declared(name)
  if not DECLARED[name] then
    error('idem: the script touches ' .. name .. ' without declaring it in KEYS')
  end
  return name
end


local function instant(arg)
  if arg == '' then
    local t = redis.call('TIME')
    return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return tonumber(arg)
end

local function newest_claims(tag, keys, now, pwidth, span)
  local pgen = math.floor(now / pwidth)
  local hashes = {}
  for i = 0, span do
    hashes[i + 1] = declared(tag .. ':p:' .. pwidth .. ':' .. (pgen - i))
  end
  local held, where = {}, {}
  for i = 1, #hashes do
    -- Claims leave their hash when their keys complete, so between batches the
    -- claim generations are usually gone: no lookup then.
    if present(hashes[i]) then
      local values = gathered(keys, function(...) return redis.call('HMGET', hashes[i], ...) end)
      for j = 1, #keys do
        if values[j] and not held[j] then
          held[j], where[j] = values[j], i
        end
      end
    end
  end
  return pgen, hashes, held, where
end
