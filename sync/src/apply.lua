-- floodgate-sync: applies one or more shards' parts of a proxy's batch, atomically.
-- (One group per script in Redis Cluster, where a script may only touch one slot; every group
-- of the batch in one script on a single node.)
--
-- ARGV[1]  the batch's seq (canonical decimal u64)
-- ARGV[2]  the number of groups
-- then per group:    ARGV  seen_ttl_ms, counter count
--                    KEYS  the shard's dedup key (<prefix>{s}:seen:<proxy>)
--   then per counter: ARGV delta, refund, expire_at_ms, has_previous (1|0)
--                     KEYS current key [, previous key when has_previous is 1]
--
-- A group is applied only when seq is newer than its dedup key (absent counts as older): then
-- the dedup key takes seq (SET PX seen_ttl_ms), and every counter with a delta > 0 gets
-- INCRBY delta, and PEXPIREAT expire_at_ms when that INCRBY created it (a counter's expiry only
-- depends on its bucket, so an existing counter has it already); then every counter with a
-- refund > 0 that exists gets DECRBY min(refund, its value) (never below 0, never created: a
-- give-back of a counter that expired or was never written has nothing to give back to, and
-- DECRBY keeps the expiry). Otherwise the group's counters
-- are only read. After every group, each counter's current and previous totals are read (MGET),
-- so a counter whose previous bucket is in the same batch sees the batch's increments.
--
-- Returns {applied_1 .. applied_groups, current_1, previous_1, current_2, previous_2, ...}:
-- applied is 1 or 0; totals are the keys' values (bulk strings), or nil when absent.

local seq = ARGV[1]

-- a > b for canonical decimal strings (exact for every u64; Lua numbers are doubles).
local function newer(a, b)
  if #a ~= #b then
    return #a > #b
  end
  return a > b
end

local groups = tonumber(ARGV[2])
local k, a = 1, 3
local out = {}
local reads = {} -- the keys to read, in order
local where = {} -- per total to return: its index in reads, or false (bucket 0 has no previous)
for g = 1, groups do
  local seen_key = KEYS[k]
  k = k + 1
  local seen_ttl_ms = ARGV[a]
  local count = tonumber(ARGV[a + 1])
  a = a + 2
  local seen = redis.call('GET', seen_key)
  local apply = (not seen) or newer(seq, seen)
  if apply then
    redis.call('SET', seen_key, seq, 'PX', seen_ttl_ms)
    out[g] = 1
  else
    out[g] = 0
  end
  for _ = 1, count do
    local current = KEYS[k]
    k = k + 1
    local delta = ARGV[a]
    local refund = ARGV[a + 1]
    local expire_at_ms = ARGV[a + 2]
    local has_previous = ARGV[a + 3] == '1'
    a = a + 4
    if apply and delta ~= '0' then
      if redis.call('INCRBY', current, delta) == tonumber(delta) then
        redis.call('PEXPIREAT', current, expire_at_ms)
      end
    end
    if apply and refund ~= '0' then
      local value = tonumber(redis.call('GET', current) or '0')
      local back = math.min(tonumber(refund), value)
      if back > 0 then
        redis.call('DECRBY', current, back)
      end
    end
    reads[#reads + 1] = current
    where[#where + 1] = #reads
    if has_previous then
      reads[#reads + 1] = KEYS[k]
      k = k + 1
      where[#where + 1] = #reads
    else
      where[#where + 1] = false
    end
  end
end

-- MGET in chunks: unpack() is limited to a few thousand values.
local values = {}
local from = 1
while from <= #reads do
  local to = math.min(from + 999, #reads)
  local chunk = redis.call('MGET', unpack(reads, from, to))
  for n = 1, to - from + 1 do
    values[from + n - 1] = chunk[n]
  end
  from = to + 1
end
for i = 1, #where do
  local at = where[i]
  if at then
    out[groups + i] = values[at]
  else
    out[groups + i] = false
  end
end
return out
