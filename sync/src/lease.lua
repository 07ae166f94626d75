-- floodgate-sync: grants a proxy units of one key's quota, atomically (a leased rule).
--
-- KEYS[1]  the current bucket's counter (<prefix>{s}:<key>:<window_ms>:<bucket>)
-- KEYS[2]  the previous bucket's counter (absent for bucket 0)
-- ARGV[1]  window_ms            (1 .. 366 days)
-- ARGV[2]  remaining_ms         window_ms - elapsed_ms: the previous bucket's weight x window_ms
-- ARGV[3]  limit                (1 .. 2^32 - 1)
-- ARGV[4]  want                 units asked for (0: only give back and read)
-- ARGV[5]  returned             unused units of the current bucket given back first
-- ARGV[6]  returned_previous    unused units of the previous bucket given back first
-- ARGV[7]  expire_at_ms         the current counter's expiry when this call creates it
-- ARGV[8]  consumed             units the proxy admitted without a grant (the store was down),
--                               added to the current counter first, whatever the room
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
-- Returns {granted, current, previous}: the counters after the call.

local window = tonumber(ARGV[1])
local remaining = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local returned = tonumber(ARGV[5])
local returned_previous = tonumber(ARGV[6])
local consumed = tonumber(ARGV[8])

-- floor(x / c) and x mod c for integers 0 <= x < 2^53, 1 <= c < 2^53, exact: the double
-- quotient is off by at most one, which the remainder's sign corrects.
local function divmod(x, c)
  local q = math.floor(x / c)
  local r = x - q * c
  while r < 0 do
    q = q - 1
    r = r + c
  end
  while r >= c do
    q = q + 1
    r = r - c
  end
  return q, r
end

-- ceil(a x b / c) exactly for 0 <= a < 2^33 and 0 <= b <= c < 2^35: b is split at 2^17 so
-- every product stays below 2^53, where doubles are exact.
local function ceil_mul_div(a, b, c)
  local k = 131072
  local bh = math.floor(b / k)
  local bl = b - bh * k
  local q1, r1 = divmod(a * bh, c)
  local q2, r2 = divmod(r1 * k + a * bl, c)
  local q = q1 * k + q2
  if r2 > 0 then
    q = q + 1
  end
  return q
end

local function read(key)
  local value = tonumber(redis.call('GET', key) or '0') or 0
  if value < 0 then
    return 0
  end
  return value
end

local current = read(KEYS[1])
if consumed > 0 then
  current = redis.call('INCRBY', KEYS[1], consumed)
  if current == consumed then
    redis.call('PEXPIREAT', KEYS[1], ARGV[7])
  end
end
local previous = 0
if KEYS[2] then
  previous = read(KEYS[2])
  if returned_previous > 0 and previous > 0 then
    previous = redis.call('DECRBY', KEYS[2], math.min(returned_previous, previous))
  end
end
if returned > 0 and current > 0 then
  current = redis.call('DECRBY', KEYS[1], math.min(returned, current))
end

local granted = 0
if want > 0 then
  -- The counters stay far below 2^33 (limits are below 2^32); a larger value (written by
  -- someone else) only means no room.
  local weighted = ceil_mul_div(math.min(previous, 8589934591), remaining, window)
  local room = limit - weighted - current
  if room > 0 then
    granted = math.min(want, math.max(1, math.floor(room / 4)))
    current = redis.call('INCRBY', KEYS[1], granted)
    if current == granted then
      redis.call('PEXPIREAT', KEYS[1], ARGV[7])
    end
  end
end
return {granted, current, previous}
