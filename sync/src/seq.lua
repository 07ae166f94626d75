-- floodgate-sync: batches' seqs, canonical decimal u64 strings (Lua numbers are doubles, exact
-- only to 2^53). Shared by apply.lua and ask.lua.

-- a > b for canonical decimal strings (exact for every u64).
local function newer(a, b)
  if #a ~= #b then
    return #a > #b
  end
  return a > b
end
