-- floodgate-sync: grants a proxy units of one key's quota, atomically (a leased rule).
--
-- KEYS[1]  the current bucket's counter (<prefix>{s}:<key>:<window_ms>:<bucket>)
-- KEYS[2]  the current bucket's holders (<counter>:h, a hash: holder -> units outstanding)
-- KEYS[3]  the previous bucket's counter (absent for bucket 0)
-- KEYS[4]  the previous bucket's holders (absent for bucket 0)
-- ARGV[1]  window_ms            (1 .. 366 days)
-- ARGV[2]  remaining_ms         window_ms - elapsed_ms: the previous bucket's weight x window_ms
-- ARGV[3]  limit                (1 .. 2^32 - 1)
-- ARGV[4]  want                 units asked for (0: only give back and read)
-- ARGV[5]  returned             unused units of the current bucket given back first
-- ARGV[6]  returned_previous    unused units of the previous bucket given back first
-- ARGV[7]  expire_at_ms         the current counter's expiry when this call creates it
-- ARGV[8]  consumed             units the proxy admitted without a grant (the store was down),
--                               added to the current counter first, whatever the room
-- ARGV[9]  used                 units of the current bucket's grants the holder admitted since
--                               its last call
-- ARGV[10] used_previous        the same for the previous bucket
-- ARGV[11] grace_ms             how long into the bucket the previous bucket's holders have to
--                               settle (see below; 0: never take their units back)
-- ARGV[12] bucket_start_ms      when the current bucket began (bucket x window_ms)
-- ARGV[13] holder               who asks ('' when the caller is not tracked)
-- ARGV[14] at_once              units of the grant the holder's waiting requests take at once:
--                               counted as used, not outstanding
-- ARGV[15] refunded             units of the current bucket counted as used (reported `used`,
--                               or taken `at_once`) that were not used after all: taken off the
--                               counter, never below 0, not off the holder's outstanding units
-- ARGV[16] refunded_previous    the same for the previous bucket
-- ARGV[17] exact                '1': grant want whole when the room holds it, else nothing (the
--                               ask of a batched rule's request, taken at once)
--
-- A counter holds the units granted in its bucket and not given back (used, or still leased).
-- With p and c the previous and current counters after the give-backs, a unit more fits the
-- sliding window when  p x remaining + (c + 1) x window <= limit x window  (the filter's
-- `Window::admits`), so the room is
--
--   room    = limit - ceil(p x remaining / window) - c
--   granted = min(want, max(1, floor(room / 4)))   when room > 0, else 0
--
-- (a grant takes at most a quarter of the room, so near the limit the fleet's proxies get
-- single units in turn rather than one of them taking the rest). Give-backs never take a
-- counter below 0.
--
-- Holders. A tracked holder's outstanding units in a bucket (granted, less given back, less
-- reported used) sit in the bucket's holders hash. Its give-backs come off the counter only up
-- to what it has outstanding there, and an entry at 0 is removed. Once the bucket is over and
-- `grace_ms` into the next one (live holders settle their ended bucket at once: what they did
-- not use comes back, what they used is reported), by both the caller's clock (`elapsed_ms`)
-- and Redis's (TIME: a caller whose clock runs ahead takes nothing back early), whatever is
-- still outstanding belongs to
-- holders that stopped (a proxy died or restarted): it comes off the previous counter
-- and the hash goes. A dead proxy's units thus stop weighing at the end of the bucket they
-- were granted in, plus the grace. Of them, the units it admitted after its last report are
-- taken off too: the previous bucket then weighs a little less than it should (never the
-- current one, so no bucket admits more than its limit).
--
-- Returns {granted, current, previous, reclaimed}: the counters after the call, and the units of
-- stopped holders taken back.

-- (window.lua, the sliding window's arithmetic, comes before this script.)

local window = tonumber(ARGV[1])
local remaining = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local returned = tonumber(ARGV[5])
local returned_previous = tonumber(ARGV[6])
local consumed = tonumber(ARGV[8])
local used = tonumber(ARGV[9])
local used_previous = tonumber(ARGV[10])
local grace = tonumber(ARGV[11])
local bucket_start = tonumber(ARGV[12])
local holder = ARGV[13]
local at_once = tonumber(ARGV[14])
local expire_at = ARGV[7]
local refunded = tonumber(ARGV[15] or '0')
local refunded_previous = tonumber(ARGV[16] or '0')
local exact = ARGV[17] == '1'

-- Takes `units` off `counter` (at `value`), never below 0; returns the counter after.
local function refund(counter, value, units)
  if units > 0 and value > 0 then
    return redis.call('DECRBY', counter, math.min(units, value))
  end
  return value
end

local function read(key)
  return count(redis.call('GET', key))
end

-- Takes `returned` units of a holder off `counter` (at most what it has outstanding in
-- `holders`) and settles its entry; returns the counter after.
local function give_back(counter, holders, value, returned, reported)
  if holder == '' then
    if returned > 0 and value > 0 then
      value = redis.call('DECRBY', counter, math.min(returned, value))
    end
    return value
  end
  if returned + reported == 0 then
    return value
  end
  local outstanding = tonumber(redis.call('HGET', holders, holder) or '0') or 0
  if outstanding <= 0 then
    return value
  end
  local back = math.min(returned, outstanding, value)
  if back > 0 then
    value = redis.call('DECRBY', counter, back)
  end
  if outstanding - returned - reported <= 0 then
    redis.call('HDEL', holders, holder)
  else
    redis.call('HINCRBY', holders, holder, -(returned + reported))
  end
  return value
end

-- Both counters in one command.
local current, previous_read
if KEYS[3] then
  local both = redis.call('MGET', KEYS[1], KEYS[3])
  current, previous_read = count(both[1]), count(both[2])
else
  current = read(KEYS[1])
end
if consumed > 0 then
  current = redis.call('INCRBY', KEYS[1], consumed)
  if current == consumed then
    redis.call('PEXPIREAT', KEYS[1], expire_at)
  end
end
local previous = 0
local reclaimed = 0
if KEYS[3] then
  previous = previous_read
  previous = give_back(KEYS[3], KEYS[4], previous, returned_previous, used_previous)
  previous = refund(KEYS[3], previous, refunded_previous)
  -- The previous bucket's holders had their grace: what is still outstanding is a stopped
  -- holder's, and comes back.
  local function grace_over()
    local time = redis.call('TIME')
    local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
    return now_ms >= bucket_start + grace
  end
  if grace > 0 and remaining <= window - grace and previous > 0
      and redis.call('EXISTS', KEYS[4]) == 1 and grace_over() then
    local stranded = 0
    for _, units in ipairs(redis.call('HVALS', KEYS[4])) do
      stranded = stranded + math.max(tonumber(units) or 0, 0)
    end
    if stranded > 0 then
      reclaimed = math.min(stranded, previous)
      previous = redis.call('DECRBY', KEYS[3], reclaimed)
    end
    redis.call('DEL', KEYS[4])
  end
end
current = give_back(KEYS[1], KEYS[2], current, returned, used)
current = refund(KEYS[1], current, refunded)

local granted = 0
if want > 0 then
  -- The counters stay far below 2^33 (limits are below 2^32); a larger value (written by
  -- someone else) only means no room.
  local weighted = ceil_mul_div(math.min(previous, 8589934591), remaining, window)
  local room = limit - weighted - current
  if exact then
    if room >= want then
      granted = want
    end
  elseif room > 0 then
    granted = math.min(want, math.max(1, math.floor(room / 4)))
  end
  if granted > 0 then
    current = redis.call('INCRBY', KEYS[1], granted)
    if current == granted then
      redis.call('PEXPIREAT', KEYS[1], expire_at)
    end
    local outstanding = granted - math.min(granted, at_once)
    if holder ~= '' and outstanding > 0 then
      if redis.call('HINCRBY', KEYS[2], holder, outstanding) == outstanding then
        redis.call('PEXPIREAT', KEYS[2], expire_at)
      end
    end
  end
end
return {granted, current, previous, reclaimed}
