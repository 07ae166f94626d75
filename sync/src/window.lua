-- floodgate-sync: the sliding window's arithmetic, exact in Lua's doubles. The scripts that
-- decide room (lease.lua, ask.lua) start with it.

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

-- A counter's value as GET or MGET gives it: absent is 0, and so is a negative one (written by
-- someone else).
local function count(value)
  value = tonumber(value or '0') or 0
  if value < 0 then
    return 0
  end
  return value
end
