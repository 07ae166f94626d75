-- floodgate-sync: answers the asks of batched rules' requests (a `POST /v1/lease` entry with
-- `exact` that takes its units at once and gives nothing back), merged: the asks that reached
-- one shard's lane while its previous call ran, from whichever proxies, in one call.
-- (In Redis Cluster every key of a call is on one slot, the shard's.)
--
-- ARGV[1]  the number of asks
-- then per ask:  ARGV  window_ms, remaining_ms (window_ms - elapsed_ms), limit, want,
--                      expire_at_ms, has_previous (1|0), carried, field, seq, hashes,
--                      part_field
--                KEYS  the current bucket's counter [, the previous bucket's when has_previous],
--                      then `hashes` dedup hashes of the shard (apply.lua)
--
-- Asks are taken in order, each as lease.lua takes one (its counters after the asks before it):
-- granted `want` whole when the sliding window has room for it,
--
--   limit - ceil(previous x remaining / window) - current >= want,
--
-- else nothing. `limit` comes lowered by the units of the key the proxy admitted that the
-- store had not confirmed; `carried` of them travel in the proxy's batch `seq` (in the dedup
-- hashes under its source's `field`, the proxy, or on a single node, for a batch laid out in
-- shard parts, under `part_field`, <proxy>:<s>; '' when there is none: apply.lua). When one of
-- the dedup hashes holds that batch, or a later one, applied on the key's shard (HMGET per
-- hash, until found), the counter holds those units already, and they go back to `limit`.
--
-- Every distinct counter is read once (MGET); the units granted are added once per counter
-- (INCRBY, and PEXPIREAT expire_at_ms when that INCRBY created it). A call thus costs an MGET
-- and an INCRBY per counter granted, whatever the asks in it, and an HMGET or two per ask that
-- names a batch on its way.
--
-- Returns {granted, current, previous} per ask: current is its counter after its own grant (and
-- those of the asks before it in the call).
--
-- (window.lua, the sliding window's arithmetic, and seq.lua come before this script.)

local asks = tonumber(ARGV[1])

-- The counters (not the dedup hashes), each once.
local distinct, seen = {}, {}
do
  local k = 1
  for i = 0, asks - 1 do
    local a = 2 + i * 11
    local counters = ARGV[a + 5] == '1' and 2 or 1
    for c = k, k + counters - 1 do
      if not seen[KEYS[c]] then
        seen[KEYS[c]] = true
        distinct[#distinct + 1] = KEYS[c]
      end
    end
    k = k + counters + tonumber(ARGV[a + 9])
  end
end
local value = {}
local read = redis.call('MGET', unpack(distinct))
for i, key in ipairs(distinct) do
  value[key] = count(read[i])
end

local added, expiry, order = {}, {}, {}
local answer = {}
local k = 1
for i = 0, asks - 1 do
  local a = 2 + i * 11
  local window = tonumber(ARGV[a])
  local remaining = tonumber(ARGV[a + 1])
  local limit = tonumber(ARGV[a + 2])
  local want = tonumber(ARGV[a + 3])
  local current_key = KEYS[k]
  k = k + 1
  local previous = 0
  if ARGV[a + 5] == '1' then
    previous = value[KEYS[k]]
    k = k + 1
  end
  local carried, seq = tonumber(ARGV[a + 6]), ARGV[a + 8]
  local fields = {ARGV[a + 7]}
  if ARGV[a + 10] ~= '' then
    fields[2] = ARGV[a + 10]
  end
  local applied = false
  for _ = 1, tonumber(ARGV[a + 9]) do
    if carried > 0 and not applied then
      for _, last in ipairs(redis.call('HMGET', KEYS[k], unpack(fields))) do
        applied = applied or (last and not newer(seq, last))
      end
    end
    k = k + 1
  end
  if applied then
    limit = limit + carried
  end
  local weighted = ceil_mul_div(math.min(previous, 8589934591), remaining, window)
  local granted = 0
  if want > 0 and limit - weighted - value[current_key] >= want then
    granted = want
    value[current_key] = value[current_key] + want
    if not added[current_key] then
      added[current_key] = 0
      expiry[current_key] = ARGV[a + 4]
      order[#order + 1] = current_key
    end
    added[current_key] = added[current_key] + want
  end
  answer[#answer + 1] = granted
  answer[#answer + 1] = value[current_key]
  answer[#answer + 1] = previous
end

for _, key in ipairs(order) do
  local units = string.format('%d', added[key])
  if redis.call('INCRBY', key, units) == added[key] then
    redis.call('PEXPIREAT', key, expiry[key])
  end
end
return answer
