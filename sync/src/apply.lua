-- floodgate-sync: applies parts (groups) of proxies' batches, atomically: the groups of every
-- batch an instance received while its previous call for the same shards ran, merged. (In Redis
-- Cluster one script per shard, where a script may only touch one slot, and a batch's part per
-- shard; on a single node every shard in one script, and a batch in one part unless it is
-- larger than a call: layout.rs.) It is handed the groups that change a counter only, and of
-- them the counters they change.
--
-- ARGV[1]  the number of groups
-- then per group:    ARGV  seq (its batch's, canonical decimal u64), field (its batch's proxy's
--                          in the dedup hash: the proxy, or <proxy>:<s> for a shard part on a
--                          single node),
--                          seen_expire_at_ms, counter count, expire_at_ms (its counters')
--                    KEYS  the shard's dedup hash of the part's generation
--                          (<prefix>{s}:seen:<period_ms>:<generation>, or on a single node every
--                          shard's, <prefix>seen:<period_ms>:<generation>), the one before
--   then per counter: ARGV its change: the delta (decimal), or delta:refund:expire_at_ms when
--                          it gives units back or expires at another time than the group says
--                     KEYS its current key
--
-- Dedup. A shard keeps the last seq it applied of each proxy in hashes (field -> seq), one per
-- period and generation (layout.rs: a part's generation is that of its counters' latest bucket
-- start, the same for a retry on any instance; the period covers 2 windows of the part's
-- longest, at least 10 minutes). In a cluster each shard has its hashes, the proxy its field;
-- on a single node every shard shares them, the field the proxy for a whole batch, <proxy>:<s>
-- for a batch in shard parts (one proxy's field per shard: the parts of one batch on other
-- shards, with the same seq, are other fields). A batch is always laid out the same way, so a
-- retry compares its seq under the field it went under. A call
-- reads its fields' seqs in their parts' hashes (HMGET, with the field '-' that every hash holds
-- from its creation), and those it does not find there in the generation before (HMGET); it
-- writes the newer seqs (one HSET per hash), and a hash it creates gets '-' and its expiry, the
-- end of the next generation (PEXPIREAT). A seq thus lives one to two periods past its
-- counters' time, and a hash holds the proxies of two periods at most. The dedup costs a call
-- two commands per hash (usually one hash per call: a call holds one shard in a cluster, and
-- every shard shares the hashes on a single node), whatever the number of parts and proxies in
-- it, and rarely two more.
--
-- Groups are taken in order. A group is applied only when its seq is newer than its field's
-- last seq (absent counts as older); a later group of the same field in this call (the same
-- proxy's on the same shard) is compared with the newest. Then, over the applied groups,
-- every counter's deltas are summed and added once (INCRBY, and PEXPIREAT expire_at_ms when
-- that INCRBY created it: a counter's expiry only depends on its bucket, so an existing counter
-- has it already); then its give-backs are summed and, if it exists, taken off once
-- (DECRBY min(refund, its value): never below 0, never created; a give-back of a counter that
-- expired or was never written has nothing to give back to, and DECRBY keeps the expiry).
-- A counter's value after the call is what its last write answered; a counter no applied group
-- changed is read (GET: only a part sent again). The counters' previous buckets, and the ones
-- a call only reads, the caller reads with a plain MGET pipelined after it, which sees its
-- writes (store.rs, "Merging").
--
-- Every key and argument handed and every value returned costs Redis more than a native
-- command's: a counter comes with one argument, and its one delta goes to INCRBY as handed.
--
-- Returns {applied_1 .. applied_groups, value_1 .. value_n}: 1 or 0 per group, then the value
-- of each distinct counter key handed, in the order of its first appearance.

-- Sums go back to Redis as integers (string.format %d: a double prints as 1e+15 otherwise).

-- (seq.lua, the comparison of seqs, comes before this script.)

local groups = tonumber(ARGV[1])

-- The dedup: per hash (usually one), its fields' last seqs, read in one pass.
local hashes, hash_order = {}, {}
local hash_of = {} -- per group
do
  local a, k = 2, 1
  for g = 1, groups do
    local field, expire_at = ARGV[a + 1], ARGV[a + 2]
    local count = tonumber(ARGV[a + 3])
    local key, before = KEYS[k], KEYS[k + 1]
    k = k + 2 + count
    a = a + 5 + count
    local p = hashes[key]
    if not p then
      p = {key = key, before = before, expire_at = expire_at, fields = {'-'}, listed = {}, last = {},
           written = {}, changed = {}}
      hashes[key] = p
      hash_order[#hash_order + 1] = p
    end
    hash_of[g] = p
    if not p.listed[field] then
      p.listed[field] = true
      p.fields[#p.fields + 1] = field
    end
  end
end
for _, p in ipairs(hash_order) do
  local found = redis.call('HMGET', p.key, unpack(p.fields))
  p.fresh = not found[1]
  local missing = {}
  for n = 2, #p.fields do
    local field = p.fields[n]
    if found[n] then
      p.last[field] = found[n]
    else
      missing[#missing + 1] = field
    end
  end
  if #missing > 0 and p.before ~= p.key then
    local older = redis.call('HMGET', p.before, unpack(missing))
    for n, field in ipairs(missing) do
      if older[n] then
        p.last[field] = older[n]
      end
    end
  end
end

local k, a = 1, 2
local out = {}
local order = {} -- the keys handed, each once, in order of first appearance
local adds, texts = {}, {} -- per key: the units to add, and their text when one counter adds them
local refunds, expiries = {}, {} -- per key: the units to give back, and its expiry
for g = 1, groups do
  local seq, field, expire_at = ARGV[a], ARGV[a + 1], ARGV[a + 4]
  local count = tonumber(ARGV[a + 3])
  a = a + 5
  k = k + 2
  local p = hash_of[g]
  local last = p.last[field]
  local apply = (not last) or newer(seq, last)
  if apply then
    p.last[field] = seq
    if not p.changed[field] then
      p.changed[field] = true
      p.written[#p.written + 1] = field
    end
  end
  out[g] = apply and 1 or 0
  for _ = 1, count do
    local current, text = KEYS[k], ARGV[a]
    local units, refund, expiry = tonumber(text), 0, expire_at
    if not units then
      text, refund, expiry = string.match(text, '^(%d+):(%d+):(%d+)$')
      units, refund = tonumber(text), tonumber(refund)
    end
    local add = adds[current]
    if not add then
      order[#order + 1] = current
      expiries[current] = expiry
      add = 0
    end
    if apply then
      if units > 0 then
        texts[current] = add == 0 and text or nil
        add = add + units
      end
      if refund > 0 then
        refunds[current] = (refunds[current] or 0) + refund
      end
    end
    adds[current] = add
    k = k + 1
    a = a + 1
  end
end

-- The newer seqs, one HSET per hash; a hash this call creates gets '-' and its expiry.
for _, p in ipairs(hash_order) do
  if #p.written > 0 then
    local pairs_ = {}
    if p.fresh then
      pairs_[1], pairs_[2] = '-', '1'
    end
    for _, field in ipairs(p.written) do
      pairs_[#pairs_ + 1] = field
      pairs_[#pairs_ + 1] = p.last[field]
    end
    redis.call('HSET', p.key, unpack(pairs_))
    if p.fresh then
      redis.call('PEXPIREAT', p.key, p.expire_at)
    end
  end
end

for _, current in ipairs(order) do
  local add, value = adds[current], nil
  if add > 0 then
    value = redis.call('INCRBY', current, texts[current] or string.format('%d', add))
    if value == add then
      redis.call('PEXPIREAT', current, expiries[current])
      -- (A bucket long past expires at once: its value is then 0.)
      value = tonumber(redis.call('GET', current) or '0')
    end
  end
  local refund = refunds[current]
  if refund then
    value = value or tonumber(redis.call('GET', current) or '0')
    local back = math.min(refund, value)
    if back > 0 then
      value = redis.call('DECRBY', current, string.format('%d', back))
    end
  end
  -- (GET answers false for a counter that does not exist: a nil reply, 0 for the caller.)
  out[#out + 1] = value or redis.call('GET', current)
end

return out
