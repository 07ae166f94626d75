-- floodgate-sync: applies shard parts (groups) of proxies' batches, atomically: the groups of
-- every batch an instance received while its previous call for the same shards ran, merged.
-- (In Redis Cluster one script per shard, where a script may only touch one slot; on a single
-- node every shard in one script.)
--
-- ARGV[1]  the number of groups
-- then per group:    ARGV  seq (its batch's, canonical decimal u64), seen_ttl_ms, counter count
--                    KEYS  the shard's dedup key of the batch's proxy (<prefix>{s}:seen:<proxy>)
--   then per counter: ARGV delta, refund, expire_at_ms, has_previous (1|0)
--                     KEYS current key [, previous key when has_previous is 1]
--
-- Groups are taken in order. A group is applied only when its seq is newer than its dedup key
-- (absent counts as older): the dedup key takes seq (SET PX seen_ttl_ms GET, which returns the
-- seq it held; when that one was not older, it is set back), so a later group of the same proxy
-- and shard in this call is compared with the newest. Then, over the applied groups,
-- every counter's deltas are summed and added once (INCRBY, and PEXPIREAT expire_at_ms when
-- that INCRBY created it: a counter's expiry only depends on its bucket, so an existing counter
-- has it already); then every counter's give-backs are summed and, if it exists, taken off once
-- (DECRBY min(refund, its value): never below 0, never created; a give-back of a counter that
-- expired or was never written has nothing to give back to, and DECRBY keeps the expiry).
-- Last, each distinct counter is read once (MGET), so every group sees the totals after the
-- whole call, a counter whose previous bucket is in the same call included.
--
-- Returns {applied_1 .. applied_groups, then per group per counter current, previous}: applied
-- is 1 or 0; totals are the keys' values (bulk strings), or nil when absent (false: bucket 0 has
-- no previous).

-- Sums go back to Redis as integers (string.format %d: a double prints as 1e+15 otherwise).

-- a > b for canonical decimal strings (exact for every u64; Lua numbers are doubles).
local function newer(a, b)
  if #a ~= #b then
    return #a > #b
  end
  return a > b
end

local groups = tonumber(ARGV[1])
local k, a = 1, 2
local out = {}
local order = {} -- counters with a change, in order of first appearance
local deltas, refunds, expiries = {}, {}, {}
local reads, read_at = {}, {} -- distinct keys to read, and each key's index in reads
local where = {} -- per total to return: its index in reads, or false
local function read(key)
  local at = read_at[key]
  if not at then
    reads[#reads + 1] = key
    at = #reads
    read_at[key] = at
  end
  return at
end
for g = 1, groups do
  local seq = ARGV[a]
  local seen_ttl_ms = ARGV[a + 1]
  local count = tonumber(ARGV[a + 2])
  a = a + 3
  local seen_key = KEYS[k]
  k = k + 1
  -- One command when the part is new (the usual case); a retry puts the newer seq back.
  local seen = redis.call('SET', seen_key, seq, 'PX', seen_ttl_ms, 'GET')
  local apply = (not seen) or newer(seq, seen)
  if apply then
    out[g] = 1
  else
    redis.call('SET', seen_key, seen, 'PX', seen_ttl_ms)
    out[g] = 0
  end
  for _ = 1, count do
    local current = KEYS[k]
    k = k + 1
    local delta = tonumber(ARGV[a])
    local refund = tonumber(ARGV[a + 1])
    local expire_at_ms = ARGV[a + 2]
    local has_previous = ARGV[a + 3] == '1'
    a = a + 4
    if apply and (delta > 0 or refund > 0) then
      if not deltas[current] then
        order[#order + 1] = current
        deltas[current], refunds[current] = 0, 0
        expiries[current] = expire_at_ms
      end
      deltas[current] = deltas[current] + delta
      refunds[current] = refunds[current] + refund
    end
    where[#where + 1] = read(current)
    if has_previous then
      where[#where + 1] = read(KEYS[k])
      k = k + 1
    else
      where[#where + 1] = false
    end
  end
end

for _, current in ipairs(order) do
  local delta = deltas[current]
  if delta > 0 then
    if redis.call('INCRBY', current, string.format('%d', delta)) == delta then
      redis.call('PEXPIREAT', current, expiries[current])
    end
  end
end
for _, current in ipairs(order) do
  local refund = refunds[current]
  if refund > 0 then
    local value = tonumber(redis.call('GET', current) or '0')
    local back = math.min(refund, value)
    if back > 0 then
      redis.call('DECRBY', current, string.format('%d', back))
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
