//! Where a batch goes in Redis (see `sync/README.md`, "Redis layout").
//!
//! - Shard `s = (first 8 hex chars of the key as u32) % shards`.
//! - Counter `<prefix>{<s>}:<key>:<window_ms>:<bucket>`, an integer that expires at
//!   `(bucket + 2) * window_ms + 60000` ms since the epoch: the end of the next window plus a
//!   minute, so at most about two windows of a key live in Redis.
//! - Dedup, a hash per period and generation: per proxy and shard, the last `seq` of the proxy
//!   applied to the shard (see `apply.lua`). In Redis Cluster one hash per shard,
//!   `<prefix>{<s>}:seen:<period_ms>:<generation>`, its fields the proxies (a script touches one
//!   slot); on a single node one hash for every shard, `<prefix>seen:<period_ms>:<generation>`
//!   (so that a call over many shards reads and writes one hash), its fields the proxies for
//!   batches that go whole and `<proxy>:<s>` for those that go in shard parts (below);
//!   [`Layout::seen_key`] and [`Layout::seen_field`] name them. A seq must be kept
//!   `max(2 * the longest window of the batch's counters in s, 10 min)` ([`seen_ttl_ms`]); the
//!   period is the first of 10 min × 2^k that covers it ([`seen_period_ms`]). A batch's part
//!   goes into the generation of its counters' latest bucket start (so a retry, whichever
//!   instance takes it, finds the same hash), and is looked up there and in the generation
//!   before; a generation's hash expires at the end of the next generation, so a seq lives one
//!   to two periods past its counters' time, and a hash holds the proxies (and shards) of two
//!   periods at most.
//!
//! In a cluster all keys of a shard share the hash tag `{<s>}`: one slot, so one Lua script can
//! touch them all atomically (on a single node one script touches every shard's). A batch
//! becomes a [`Plan`] of [`Group`]s (parts), each with its distinct counters (duplicates of a
//! (key, window_ms, bucket) are summed): in a cluster one per shard present; on a single node
//! one for the whole batch, its dedup field the proxy, unless the batch has more than
//! [`MAX_SCRIPT_COUNTERS`] distinct counters, which go in shard parts as in a cluster (so that
//! no script call holds Redis long). A batch is always laid out the same way, so its retry
//! finds its seq where it went.

use std::collections::{BTreeMap, HashMap};

use crate::protocol::{Batch, CounterKey};

/// The most counters one script call takes, unless one part has more; on a single node, the most
/// a batch has to go as one part.
pub const MAX_SCRIPT_COUNTERS: usize = 1000;
/// The slack after a counter's last useful moment before Redis drops it, in ms.
pub const EXPIRY_SLACK_MS: u64 = 60_000;
/// The shortest life of a dedup key, in ms (10 minutes).
pub const MIN_SEEN_TTL_MS: u64 = 600_000;
/// The fleet size counts the distinct proxies that sent a batch in the current second and the
/// ones before it, this many seconds in all (a proxy sends at least one batch a second).
pub const FLEET_SECONDS: u64 = 3;
/// How long a second's HyperLogLog of proxies lives, in ms.
pub const FLEET_TTL_MS: u64 = 10_000;
/// The largest expiry Redis accepts (a signed 64-bit count of ms).
const MAX_REDIS_MS: u64 = i64::MAX as u64;

/// The key layout every instance serving one fleet must share (`--prefix`, `--shards`, and
/// `--cluster` or not).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    prefix: String,
    shards: u32,
    /// One dedup hash for every shard (a single node), instead of one per shard.
    node_dedup: bool,
}

impl Layout {
    /// A layout with `shards` ≥ 1 (0 is taken as 1) and a prefix without `{` or `}` (the caller
    /// validates it: braces would change the hash tag).
    pub fn new(prefix: impl Into<String>, shards: u32) -> Layout {
        Layout {
            prefix: prefix.into(),
            shards: shards.max(1),
            node_dedup: false,
        }
    }

    /// The layout on a single Redis node: one dedup hash per period and generation for every
    /// shard, its fields `<proxy>:<shard>` (in a cluster, where a script touches one slot, each
    /// shard has its own).
    pub fn single_node(self) -> Layout {
        Layout { node_dedup: true, ..self }
    }

    /// The number of shards.
    pub fn shards(&self) -> u32 {
        self.shards
    }

    /// The key prefix.
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The shard of a counter key: its first 32 bits modulo the shard count.
    pub fn shard(&self, key: &CounterKey) -> u32 {
        key.high_u32().checked_rem(self.shards).unwrap_or(0)
    }

    /// `<prefix>{<shard>}:<key>:<window_ms>:<bucket>`.
    pub fn counter_key(&self, shard: u32, key: &CounterKey, window_ms: u64, bucket: u64) -> String {
        format!(
            "{}{{{shard}}}:{}:{window_ms}:{bucket}",
            self.prefix,
            key.as_str()
        )
    }

    /// `<prefix>{fleet}:<second>`: the HyperLogLog of the proxies that sent a batch in that
    /// second (since the epoch), for the fleet size ([`FLEET_SECONDS`]).
    pub fn fleet_key(&self, second: u64) -> String {
        format!("{}{{fleet}}:{second}", self.prefix)
    }

    /// What the dedup hashes holding `shard`'s seqs are named after
    /// (`<seen_key>:<period_ms>:<generation>`, see `apply.lua`): `<prefix>{<shard>}:seen`, or
    /// `<prefix>seen` on a single node (every shard's).
    pub fn seen_key(&self, shard: u32) -> String {
        if self.node_dedup {
            format!("{}seen", self.prefix)
        } else {
            format!("{}{{{shard}}}:seen", self.prefix)
        }
    }

    /// The field of `proxy`'s last seq on `shard` in the dedup hashes ([`Layout::seen_key`]) for a
    /// batch laid out in shard parts: the proxy, or `<proxy>:<shard>` on a single node. (A whole
    /// batch's, on a single node, is the proxy.)
    pub fn seen_field(&self, shard: u32, proxy: &str) -> String {
        if self.node_dedup {
            format!("{proxy}:{shard}")
        } else {
            proxy.to_owned()
        }
    }

    /// The dedup hashes in which a batch's part holding the counter (`key`, `window_ms`, `bucket`)
    /// keeps its seq, when the batch was formed before `formed_before_ms` and its counters' longest
    /// window is at most `longest_window_ms` (a part's longest window lies between the two, and its
    /// latest bucket start between the counter's and `formed_before_ms`). At most two generations of
    /// each period in that range; oldest period first.
    pub fn seen_keys_of(&self, key: &CounterKey, window_ms: u64, bucket: u64, longest_window_ms: u64, formed_before_ms: u64) -> Vec<String> {
        let base = self.seen_key(self.shard(key));
        let start = bucket.saturating_mul(window_ms);
        let (mut period, last) = (seen_period_ms(window_ms), seen_period_ms(longest_window_ms.max(window_ms)));
        let mut keys = Vec::new();
        loop {
            let (from, to) = (start.checked_div(period).unwrap_or(0), formed_before_ms.max(start).checked_div(period).unwrap_or(0));
            // A part's generation is its latest bucket start's, at most two of them here (a
            // period covers two windows of the part's longest).
            keys.extend((from..=to.min(from.saturating_add(1))).map(|generation| format!("{base}:{period}:{generation}")));
            if period >= last {
                return keys;
            }
            period = period.saturating_mul(2);
        }
    }
}

/// When a counter of (`window_ms`, `bucket`) expires, in ms since the epoch:
/// `(bucket + 2) * window_ms + 60000`, saturating at the largest value Redis accepts.
pub fn expire_at_ms(window_ms: u64, bucket: u64) -> u64 {
    bucket
        .saturating_add(2)
        .saturating_mul(window_ms)
        .saturating_add(EXPIRY_SLACK_MS)
        .min(MAX_REDIS_MS)
}

/// How long a shard keeps a proxy's last seq at least, in ms: `max(2 * max_window_ms, 600000)`.
pub fn seen_ttl_ms(max_window_ms: u64) -> u64 {
    max_window_ms
        .saturating_mul(2)
        .clamp(MIN_SEEN_TTL_MS, MAX_REDIS_MS)
}

/// The period of the dedup hashes that keep a seq [`seen_ttl_ms`]`(max_window_ms)` at least, in
/// ms: the first of `600000 × 2^k` that is not shorter (a few periods in all, so that batches of
/// similar windows share a hash).
pub fn seen_period_ms(max_window_ms: u64) -> u64 {
    let ttl = seen_ttl_ms(max_window_ms);
    let mut period = MIN_SEEN_TTL_MS;
    while period < ttl {
        period = period.saturating_mul(2);
    }
    period
}

/// One distinct counter of a shard's part of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedCounter {
    /// The counter's Redis key.
    pub current_key: String,
    /// The previous bucket's Redis key; `None` for bucket 0.
    pub previous_key: Option<String>,
    /// The sum of the batch's deltas for this counter.
    pub delta: u64,
    /// The sum of the batch's give-backs for this counter.
    pub refund: u64,
    /// When the counter expires (PEXPIREAT), in ms since the epoch.
    pub expire_at_ms: u64,
}

/// A part of a batch (a shard's, or a whole batch's on a single node): applied atomically by one
/// script.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    /// The shard (0 for a whole batch on a single node: its lane is the node's one).
    pub shard: u32,
    /// The dedup hash that keeps the batch's seq: `<seen_key>:<period>:<generation>`
    /// ([`Layout::seen_key`], [`seen_period_ms`]; the generation of the latest bucket start of the
    /// part's counters).
    pub seen_key: String,
    /// The hash of the generation before.
    pub seen_before_key: String,
    /// When `seen_key` expires: the end of the next generation, in ms since the epoch.
    pub seen_expire_at_ms: u64,
    /// The batch's proxy's field in the dedup hashes ([`Layout::seen_field`]).
    pub seen_field: String,
    /// The part's distinct counters, in order of first appearance in the batch (a whole batch's: by
    /// shard, then in that order).
    pub counters: Vec<PlannedCounter>,
}

/// A batch laid out on shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The batch's `seq`.
    pub seq: u64,
    /// Its parts: one per shard present, in shard order, or one for the whole batch (module doc).
    pub groups: Vec<Group>,
    /// For each request counter, the index of its distinct counter in the flattened groups
    /// (group 0's counters first, then group 1's, ...).
    pub index: Vec<usize>,
}

impl Plan {
    /// The number of distinct counters (the flattened groups' length).
    pub fn distinct(&self) -> usize {
        self.groups.iter().map(|group| group.counters.len()).sum()
    }
}

/// Lays a validated batch out: in shard parts, or whole on a single node (module doc).
pub fn plan(layout: &Layout, batch: &Batch) -> Plan {
    let plan = plan_shards(layout, batch);
    if !layout.node_dedup || plan.groups.is_empty() || plan.distinct() > MAX_SCRIPT_COUNTERS {
        return plan;
    }
    // The flattened order stays: the whole part's counters are the shard parts' in turn.
    let (mut max_window, mut latest) = (0u64, 0u64);
    for counter in &batch.counters {
        max_window = max_window.max(counter.window_ms);
        latest = latest.max(counter.bucket.saturating_mul(counter.window_ms));
    }
    let counters = plan.groups.into_iter().flat_map(|group| group.counters).collect();
    let whole = part(layout.seen_key(0), batch.proxy.as_str().to_owned(), max_window, latest, counters);
    Plan {
        seq: plan.seq,
        groups: vec![whole],
        index: plan.index,
    }
}

/// A part of a batch with its dedup hashes: the period of its longest window, the generation of
/// its latest bucket start.
fn part(seen_base: String, seen_field: String, max_window: u64, latest: u64, counters: Vec<PlannedCounter>) -> Group {
    let period = seen_period_ms(max_window);
    let generation = latest.checked_div(period).unwrap_or(0);
    Group {
        shard: 0,
        seen_key: format!("{seen_base}:{period}:{generation}"),
        seen_before_key: format!("{seen_base}:{period}:{}", generation.saturating_sub(1)),
        seen_expire_at_ms: generation.saturating_add(2).saturating_mul(period).min(MAX_REDIS_MS),
        seen_field,
        counters,
    }
}

/// Lays a validated batch out in shard parts.
fn plan_shards(layout: &Layout, batch: &Batch) -> Plan {
    // shard -> (max window, latest bucket start, distinct counters); (key, window, bucket) ->
    // (shard, position).
    let mut shards: BTreeMap<u32, (u64, u64, Vec<PlannedCounter>)> = BTreeMap::new();
    let mut seen: HashMap<(&CounterKey, u64, u64), (u32, usize)> = HashMap::new();
    let mut located: Vec<(u32, usize)> = Vec::with_capacity(batch.counters.len());
    for counter in &batch.counters {
        let shard = layout.shard(&counter.key);
        let (max_window, latest, counters) = shards.entry(shard).or_insert((0, 0, Vec::new()));
        *max_window = (*max_window).max(counter.window_ms);
        *latest = (*latest).max(counter.bucket.saturating_mul(counter.window_ms));
        let id = (&counter.key, counter.window_ms, counter.bucket);
        let at = match seen.get(&id) {
            Some(&at) => {
                if let Some(planned) = counters.get_mut(at.1) {
                    planned.delta = planned.delta.saturating_add(counter.delta);
                    planned.refund = planned.refund.saturating_add(counter.refund);
                }
                at
            }
            None => {
                let at = (shard, counters.len());
                counters.push(PlannedCounter {
                    current_key: layout.counter_key(
                        shard,
                        &counter.key,
                        counter.window_ms,
                        counter.bucket,
                    ),
                    previous_key: counter.bucket.checked_sub(1).map(|previous| {
                        layout.counter_key(shard, &counter.key, counter.window_ms, previous)
                    }),
                    delta: counter.delta,
                    refund: counter.refund,
                    expire_at_ms: expire_at_ms(counter.window_ms, counter.bucket),
                });
                seen.insert(id, at);
                at
            }
        };
        located.push(at);
    }
    // Where each shard's counters start in the flattened list.
    let mut offsets: HashMap<u32, usize> = HashMap::with_capacity(shards.len());
    let mut next = 0usize;
    let mut groups = Vec::with_capacity(shards.len());
    for (shard, (max_window, latest, counters)) in shards {
        offsets.insert(shard, next);
        next = next.saturating_add(counters.len());
        let group = part(layout.seen_key(shard), layout.seen_field(shard, batch.proxy.as_str()), max_window, latest, counters);
        groups.push(Group { shard, ..group });
    }
    let index = located
        .into_iter()
        .map(|(shard, position)| {
            offsets
                .get(&shard)
                .copied()
                .unwrap_or(0)
                .saturating_add(position)
        })
        .collect();
    Plan {
        seq: batch.seq,
        groups,
        index,
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]

    use super::*;
    use crate::protocol::parse_batch;

    fn key(text: &str) -> CounterKey {
        CounterKey::try_from(text.to_string()).unwrap()
    }

    /// Every hash a batch's part holding the counter can have used: the periods from the
    /// counter's window's to the batch's longest's, each in the generations between the counter's
    /// bucket start and the batch's forming; the same names a plan gives.
    #[test]
    fn an_asked_counter_s_batch_is_looked_up_where_its_part_can_be() {
        let layout = Layout::new("fg:", 16);
        let a = key("00000001aaaaaaaaaaaaaaaaaaaaaaaa");
        // A minute's bucket at 9:59 into a 10 min generation, asked 30 s in: two generations.
        let bucket = 599_000 / 60_000;
        assert_eq!(layout.seen_keys_of(&a, 60_000, bucket, 60_000, 570_000), ["fg:{1}:seen:600000:0"]);
        assert_eq!(layout.seen_keys_of(&a, 60_000, 9, 60_000, 600_500), ["fg:{1}:seen:600000:0", "fg:{1}:seen:600000:1"]);
        // A batch with an hour's counter too: 600 000 up to 9 600 000.
        let keys = layout.seen_keys_of(&a, 60_000, 100, 3_600_000, 6_010_000);
        assert_eq!(keys.first().map(String::as_str), Some("fg:{1}:seen:600000:10"));
        assert_eq!(keys.last().map(String::as_str), Some("fg:{1}:seen:9600000:0"));
        assert_eq!(keys.len(), 5, "{keys:?}");
        // The plan of a batch of that counter alone keeps its seq in one of them.
        let batch = crate::protocol::parse_batch(
            br#"{"version":1,"proxy":"0123456789abcdef","seq":1,"counters":[{"key":"00000001aaaaaaaaaaaaaaaaaaaaaaaa","window_ms":60000,"bucket":100,"delta":1}]}"#,
            10,
        )
        .unwrap();
        let plan = plan(&layout, &batch);
        assert!(keys.contains(&plan.groups[0].seen_key));
    }

    #[test]
    fn the_shard_is_the_first_32_bits_modulo_the_shard_count() {
        let layout = Layout::new("fg:", 16);
        assert_eq!(layout.shard(&key("00000000000000000000000000000000")), 0);
        assert_eq!(layout.shard(&key("0000000f000000000000000000000000")), 15);
        assert_eq!(layout.shard(&key("00000010ffffffffffffffffffffffff")), 0);
        // 0x00112233 = 1122867, 1122867 % 16 = 3; % 7 = 1122867 - 7 * 160409 = 4.
        assert_eq!(layout.shard(&key("00112233445566778899aabbccddeeff")), 3);
        assert_eq!(
            Layout::new("fg:", 7).shard(&key("00112233445566778899aabbccddeeff")),
            4
        );
        assert_eq!(
            Layout::new("fg:", 1).shard(&key("ffffffffffffffffffffffffffffffff")),
            0
        );
        assert_eq!(Layout::new("fg:", 0).shards(), 1);
    }

    #[test]
    fn key_names_carry_the_shard_as_hash_tag() {
        let layout = Layout::new("fg:", 16);
        let k = key("00112233445566778899aabbccddeeff");
        assert_eq!(
            layout.counter_key(3, &k, 60_000, 28_333_333),
            "fg:{3}:00112233445566778899aabbccddeeff:60000:28333333"
        );
        assert_eq!(layout.seen_key(3), "fg:{3}:seen");
        assert_eq!(Layout::new("", 16).seen_key(12), "{12}:seen");
        assert_eq!(layout.seen_field(3, "0123456789abcdef"), "0123456789abcdef");
    }

    /// On a single node every shard's seqs are in one hash per period and generation, a field
    /// per proxy and shard; the asks look them up where the plans put them.
    #[test]
    fn a_single_node_keeps_every_shards_seqs_in_one_hash() {
        let layout = Layout::new("fg:", 16).single_node();
        assert_eq!(layout.seen_key(3), layout.seen_key(12));
        assert_eq!(layout.seen_key(3), "fg:seen");
        assert_eq!(layout.seen_field(3, "0123456789abcdef"), "0123456789abcdef:3");
        assert_eq!(layout.counter_key(3, &key("00112233445566778899aabbccddeeff"), 1000, 5), "fg:{3}:00112233445566778899aabbccddeeff:1000:5");
        let body = r#"{"version": 1, "proxy": "0123456789abcdef", "seq": 9, "counters": [
            {"key": "00000001aaaaaaaaaaaaaaaaaaaaaaaa", "window_ms": 60000, "bucket": 100, "delta": 2},
            {"key": "00000002bbbbbbbbbbbbbbbbbbbbbbbb", "window_ms": 60000, "bucket": 100, "delta": 1},
            {"key": "00000011cccccccccccccccccccccccc", "window_ms": 3600000, "bucket": 1, "delta": 1}
        ]}"#;
        let batch = parse_batch(body.as_bytes(), 10).unwrap();
        let whole = plan(&layout, &batch);
        let parts: Vec<(&str, &str)> = whole.groups.iter().map(|g| (g.seen_key.as_str(), g.seen_field.as_str())).collect();
        // One part, its field the proxy: the period of its longest window (an hour's), the
        // generation of its latest bucket start (100 minutes).
        assert_eq!(parts, [("fg:seen:9600000:0", "0123456789abcdef")]);
        // The same counters in the same order as in shard parts: the request order maps alike.
        let sharded = plan_shards(&layout, &batch);
        assert_eq!(sharded.groups.len(), 2);
        let flat: Vec<&PlannedCounter> = sharded.groups.iter().flat_map(|g| &g.counters).collect();
        assert_eq!(whole.groups[0].counters.iter().collect::<Vec<_>>(), flat);
        assert_eq!(whole.index, sharded.index);
        // An ask of any of its keys looks in the hash the part went to.
        for (k, window, bucket) in [("00000002bbbbbbbbbbbbbbbbbbbbbbbb", 60_000, 100), ("00000011cccccccccccccccccccccccc", 3_600_000, 1)] {
            let keys = layout.seen_keys_of(&key(k), window, bucket, 3_600_000, 6_010_000);
            assert!(keys.contains(&whole.groups[0].seen_key), "{keys:?}");
        }
        // A batch larger than a call goes in shard parts, fields `<proxy>:<s>`, all in one hash.
        let counters: Vec<String> = (0..=MAX_SCRIPT_COUNTERS)
            .map(|n| format!(r#"{{"key": "{:08x}{n:024x}", "window_ms": 60000, "bucket": 100, "delta": 1}}"#, n % 3))
            .collect();
        let body = format!(r#"{{"version": 1, "proxy": "0123456789abcdef", "seq": 9, "counters": [{}]}}"#, counters.join(","));
        let large = plan(&layout, &parse_batch(body.as_bytes(), 2000).unwrap());
        let parts: Vec<(u32, &str, &str)> = large.groups.iter().map(|g| (g.shard, g.seen_key.as_str(), g.seen_field.as_str())).collect();
        assert_eq!(
            parts,
            [
                (0, "fg:seen:600000:10", "0123456789abcdef:0"),
                (1, "fg:seen:600000:10", "0123456789abcdef:1"),
                (2, "fg:seen:600000:10", "0123456789abcdef:2")
            ]
        );
    }

    #[test]
    fn counters_expire_a_minute_after_the_next_window() {
        // Bucket 28333333 of 60 s windows spans [1699999980000, 1700000040000); the next one
        // ends at 1700000100000; plus a minute.
        assert_eq!(expire_at_ms(60_000, 28_333_333), 1_700_000_160_000);
        assert_eq!(expire_at_ms(1, 0), 60_002);
        // Extremes saturate at what Redis accepts instead of overflowing.
        assert_eq!(
            expire_at_ms(crate::protocol::MAX_WINDOW_MS, crate::protocol::MAX_BUCKET),
            i64::MAX as u64
        );
    }

    #[test]
    fn dedup_keys_live_two_windows_or_ten_minutes() {
        assert_eq!(seen_ttl_ms(1), 600_000);
        assert_eq!(seen_ttl_ms(300_000), 600_000);
        assert_eq!(seen_ttl_ms(3_600_000), 7_200_000);
        assert_eq!(seen_ttl_ms(crate::protocol::MAX_WINDOW_MS), 63_244_800_000);
        assert_eq!(seen_period_ms(1), 600_000);
        assert_eq!(seen_period_ms(300_000), 600_000);
        assert_eq!(seen_period_ms(300_001), 1_200_000);
        assert_eq!(seen_period_ms(3_600_000), 9_600_000);
        assert_eq!(seen_period_ms(crate::protocol::MAX_WINDOW_MS), 600_000 << 17);
        for window in [1, 60_000, 3_600_000, 86_400_000, crate::protocol::MAX_WINDOW_MS] {
            assert!(seen_period_ms(window) >= seen_ttl_ms(window));
            assert!(seen_period_ms(window) < 2 * seen_ttl_ms(window));
        }
    }

    #[test]
    fn a_plan_groups_by_shard_and_sums_duplicates() {
        let body = r#"{"version": 1, "proxy": "0123456789abcdef", "seq": 9, "counters": [
            {"key": "00000001aaaaaaaaaaaaaaaaaaaaaaaa", "window_ms": 60000, "bucket": 10, "delta": 2},
            {"key": "00000000bbbbbbbbbbbbbbbbbbbbbbbb", "window_ms": 1000, "bucket": 0, "delta": 0},
            {"key": "00000001aaaaaaaaaaaaaaaaaaaaaaaa", "window_ms": 60000, "bucket": 10, "delta": 5},
            {"key": "00000011cccccccccccccccccccccccc", "window_ms": 3600000, "bucket": 7, "delta": 1},
            {"key": "00000001aaaaaaaaaaaaaaaaaaaaaaaa", "window_ms": 60000, "bucket": 11, "delta": 1}
        ]}"#;
        let batch = parse_batch(body.as_bytes(), 100).unwrap();
        let plan = plan(&Layout::new("fg:", 16), &batch);
        assert_eq!(plan.seq, 9);
        let shards: Vec<u32> = plan.groups.iter().map(|g| g.shard).collect();
        assert_eq!(shards, vec![0, 1]);
        let g0 = &plan.groups[0];
        // Bucket 0 of 1 s: generation 0 of 10 min (whose "before" is itself: nothing earlier).
        assert_eq!(g0.seen_key, "fg:{0}:seen:600000:0");
        assert_eq!(g0.seen_before_key, "fg:{0}:seen:600000:0");
        assert_eq!(g0.seen_expire_at_ms, 1_200_000);
        assert_eq!(g0.seen_field, "0123456789abcdef");
        assert_eq!(
            g0.counters,
            vec![PlannedCounter {
                current_key: "fg:{0}:00000000bbbbbbbbbbbbbbbbbbbbbbbb:1000:0".into(),
                previous_key: None,
                delta: 0,
                refund: 0,
                expire_at_ms: 62_000,
            }]
        );
        let g1 = &plan.groups[1];
        // An hour's window: 9 600 000 ms periods; the latest bucket start is 7 h.
        assert_eq!(g1.seen_key, "fg:{1}:seen:9600000:2");
        assert_eq!(g1.seen_before_key, "fg:{1}:seen:9600000:1");
        assert_eq!(g1.seen_expire_at_ms, 4 * 9_600_000);
        let summary: Vec<(&str, Option<&str>, u64)> = g1
            .counters
            .iter()
            .map(|c| (c.current_key.as_str(), c.previous_key.as_deref(), c.delta))
            .collect();
        assert_eq!(
            summary,
            vec![
                (
                    "fg:{1}:00000001aaaaaaaaaaaaaaaaaaaaaaaa:60000:10",
                    Some("fg:{1}:00000001aaaaaaaaaaaaaaaaaaaaaaaa:60000:9"),
                    7
                ),
                (
                    "fg:{1}:00000011cccccccccccccccccccccccc:3600000:7",
                    Some("fg:{1}:00000011cccccccccccccccccccccccc:3600000:6"),
                    1
                ),
                (
                    "fg:{1}:00000001aaaaaaaaaaaaaaaaaaaaaaaa:60000:11",
                    Some("fg:{1}:00000001aaaaaaaaaaaaaaaaaaaaaaaa:60000:10"),
                    1
                ),
            ]
        );
        // Flattened: [g0: b/0] [g1: a/10, c/7, a/11]; request order maps onto it.
        assert_eq!(plan.index, vec![1, 0, 1, 2, 3]);
        assert_eq!(plan.distinct(), 4);
    }

    #[test]
    fn an_empty_batch_has_no_groups() {
        let body = r#"{"version": 1, "proxy": "0123456789abcdef", "seq": 1, "counters": []}"#;
        let plan = plan(
            &Layout::new("fg:", 16),
            &parse_batch(body.as_bytes(), 1).unwrap(),
        );
        assert!(plan.groups.is_empty());
        assert!(plan.index.is_empty());
    }
}
