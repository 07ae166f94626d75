//! Rate limiting in one proxy: per-key sliding-window counters ([`window`]) kept in bounded tables
//! ([`table`]) in Envoy shared data, exact across worker threads, with per-key quota reserves
//! ([`reserve`]).
//!
//! Invariants: a request is checked against every rule that applies before any counter is written
//! (read, then commit with each read's CAS token, re-deciding on fresh counts on a mismatch, at
//! most [`MAX_ATTEMPTS`] times), so a refused request consumes no quota of any rule, and units
//! committed for earlier rules are taken back when a later one refuses. When the attempts run out
//! the request is refused (`contention`): a quota is never looser than configured.
//!
//! Rationale: docs/design.md, section "Rate limiting in one proxy".

pub mod probes;
pub mod remote;
pub mod rules;
pub mod reserve;
pub mod table;
pub mod usage;
pub mod bucket;
pub mod estimate;
pub mod window;

use crate::config::{Algorithm, Config, CostSource, Name, RefusalFormat};
use crate::primitives::hash::{fnv1a, FNV1A_BASIS};
use crate::primitives::store::{update, update_from, Attempt, SharedStore, Stored, StoreError, MAX_ATTEMPTS};
use crate::primitives::time::UnixMillis;
use bucket::{micros, Bucket, Turn};
use remote::Remote;
use reserve::{Leftover, Reserves};
use std::num::{NonZeroU32, NonZeroU64};
use table::{fingerprint, Set, WAYS};
use window::{Counts, Window};

/// One rule's table: where its sets live and how it counts.
#[derive(Clone, Debug)]
pub struct RuleTable {
    /// The rule's name.
    pub name: Name,
    /// Units (requests, unless the rule has a `cost`) per window, unless a tier or an override
    /// says otherwise for a key.
    pub limit: NonZeroU32,
    /// What the limit counts: `"requests"`, `"bytes"` (a request-body cost) or `"units"` (a cost
    /// from a header).
    pub unit: &'static str,
    /// The window.
    pub window: Window,
    sets: NonZeroU64,
    /// `floodgate/<namespace>/rl/<rule name>/`: one name, one set of records, whatever the
    /// rule's definition (bounded memory across configuration changes).
    key_prefix: String,
    /// A stamp of the rule's key, window and capacity, kept in its records: a record stamped
    /// otherwise belongs to an earlier definition and reads as empty.
    shape: u64,
    /// A token-bucket rule's bucket (`None`: a sliding window).
    pub bucket: Option<BucketSpec>,
    /// The shape of the rule's `429` body (its own `refusal_format`, else the configuration's).
    pub refusal_format: RefusalFormat,
}

/// A token-bucket rule's bucket, whatever the key's limit (the rate is `limit` per `window`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BucketSpec {
    /// Units the bucket holds.
    pub burst: NonZeroU32,
    /// The longest wait for a turn, ms (0: none).
    pub max_delay_ms: u64,
    /// The period the table's overflow rolls by: at least the horizon of the rule's smallest
    /// limit ([`table`], "token-bucket rule's set").
    period: Window,
    /// The emission interval of the rule's largest limit, µs: levels are compared in it.
    unit_us: u64,
}

impl RuleTable {
    /// The bucket of a key of limit `limit`, for a token-bucket rule.
    pub fn bucket_of(&self, limit: NonZeroU32) -> Option<Bucket> {
        self.bucket.map(|spec| Bucket::new(self.window, limit, spec.burst, spec.max_delay_ms))
    }
}

impl RuleTable {
    /// The shared-data key of set `index`.
    fn set_key(&self, index: u64) -> String {
        format!("{}{index}", self.key_prefix)
    }

    /// Number of shared-data records this rule can ever create.
    pub fn set_count(&self) -> u64 {
        self.sets.get()
    }

    /// The stamp of the rule's definition its records carry.
    pub fn shape(&self) -> u64 {
        self.shape
    }
}

/// A rule that applies to the request, and the hash of the request's key for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    /// Index of the rule in the configuration.
    pub rule: usize,
    /// The keyed hash of the request's key.
    pub key_hash: u64,
    /// The key's limit when it is not the rule's (a tier's, an override's: [`crate::ratelimit::rules`]).
    pub limit: Option<NonZeroU32>,
    /// The units the request counts at admission (1 unless the rule has a `cost`). It is
    /// admitted when its key has room for `max(cost, 1)`: a key whose quota is spent is
    /// refused even for a request whose cost is charged later.
    pub cost: u32,
}

impl Probe {
    /// A probe of cost 1 and the rule's limit.
    pub fn new(rule: usize, key_hash: u64) -> Probe {
        Probe { rule, key_hash, limit: None, cost: 1 }
    }

    /// The room the request needs: its cost, and at least one unit.
    pub fn needs(&self) -> u32 {
        self.cost.max(1)
    }
}

/// Where a key stands against one rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Standing {
    /// Index of the rule.
    pub rule: usize,
    /// The sliding estimate (after this request, when it was admitted).
    pub estimate: f64,
    /// Units (requests of cost 1) that would still be admitted now.
    pub remaining: u64,
    /// Milliseconds until the estimate is back to zero if nothing else arrives.
    pub reset_ms: u64,
    /// When the same request would be admitted if nothing else arrived (`None`: never).
    pub retry_at: Option<UnixMillis>,
    /// The key's limit (the rule's, a tier's or an override's).
    pub limit: NonZeroU32,
    /// For an admitted request that waits for its turn (a token bucket with `max_delay`): when
    /// it goes.
    pub go_at: Option<UnixMillis>,
}

/// Why a rule refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The estimate plus the request's cost exceeds the limit.
    OverLimit,
    /// The shared counters could not be updated (CAS attempts ran out, or the host failed).
    Contention,
}

/// A refusing rule.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Violation {
    /// Where the key stands.
    pub standing: Standing,
    /// Why it refused.
    pub cause: Cause,
}

/// The decision for one request.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Every applicable rule admitted and counted the request.
    Admitted {
        /// One per applicable rule, after counting this request.
        standings: Vec<Standing>,
        /// Rules whose table evicted another key's live entry to make room.
        evictions: Vec<usize>,
    },
    /// At least one rule refused; no rule counted the request.
    Refused {
        /// The refusing rules (never empty).
        violations: Vec<Violation>,
    },
}

impl Verdict {
    /// For a rejection: the earliest instant every refusing rule would admit the same request
    /// if nothing else arrived (the latest of their `retry_at`s).
    pub fn retry_at(&self) -> Option<UnixMillis> {
        match self {
            Verdict::Admitted { .. } => None,
            Verdict::Refused { violations } => violations
                .iter()
                .map(|v| v.standing.retry_at)
                .try_fold(UnixMillis(0), |latest, at| at.map(|at| latest.max(at))),
        }
    }
}

/// All rules' tables.
#[derive(Clone, Debug)]
pub struct Limiter {
    tables: Vec<RuleTable>,
}

/// A rule's set as read in phase 1.
struct Read {
    probe: Probe,
    /// What the rest of the fleet adds to the key's counts.
    remote: Remote,
    key: String,
    stored: Option<Stored>,
    set: Set,
    /// This VM's unused units of the key, given back by the commit.
    leftover: Leftover,
    /// The key's counts in `set` before this request, without `leftover`.
    counts: Counts,
    /// A token-bucket rule's: the key's TAT before this request, µs.
    tat: u64,
    admits: bool,
}

/// A rule's commit: where the key stands, whether a live entry was evicted, and the bucket the
/// request was counted in.
struct Committed {
    standing: Standing,
    evicted: bool,
    bucket_index: u64,
}

impl Limiter {
    /// Lays out one table per rule under `namespace` (the shared-data prefix of this filter
    /// instance). A rule's records are named after the rule: a changed definition reuses them
    /// (so shared data stays bounded per rule name across any number of configuration changes).
    /// Its counters are identified by its name, key, window and capacity: changing any of them
    /// starts fresh counters (records stamped with another shape read as empty), while a changed
    /// limit applies at once to the counters already there.
    pub fn new(config: &Config, namespace: &str) -> Limiter {
        let tables = config
            .rate_limits
            .iter()
            .map(|rule| {
                let capacity = u64::from(rule.capacity.get().get());
                let sets = NonZeroU64::new(capacity.div_ceil(WAYS as u64)).unwrap_or(NonZeroU64::MIN);
                let window = Window::new(rule.window.get());
                let bucket = match (rule.algorithm, rule.burst) {
                    (Algorithm::TokenBucket, Some(burst)) => Some(bucket_spec(rule, window, burst.get())),
                    _ => None,
                };
                let identity = match &bucket {
                    None => format!("{:?}|{}|{}", rule.key, rule.window.get(), capacity),
                    Some(spec) => format!("{:?}|{}|{}|token_bucket|{}", rule.key, rule.window.get(), capacity, spec.period.length_ms()),
                };
                RuleTable {
                    name: rule.name.clone(),
                    limit: rule.limit.get(),
                    unit: match rule.cost.as_ref().map(|c| c.from) {
                        None => "requests",
                        Some(CostSource::RequestBody) => "bytes",
                        Some(CostSource::RequestHeader | CostSource::ResponseHeader | CostSource::ResponseBody) => "units",
                    },
                    window,
                    bucket,
                    sets,
                    key_prefix: format!("floodgate/{namespace}/rl/{}/", rule.name),
                    shape: fnv1a(identity.as_bytes(), FNV1A_BASIS),
                    refusal_format: rule.refusal_format.unwrap_or(config.refusal_format),
                }
            })
            .collect();
        Limiter { tables }
    }

    /// The rules' tables, in configuration order.
    pub fn tables(&self) -> &[RuleTable] {
        &self.tables
    }

    /// Checks a request against the rules in `probes` (each with its key's limit and the
    /// request's cost) and, if all admit, counts it, from this VM's `reserves` where it can.
    /// `remotes` holds, by rule index, what the rest of the fleet adds to each key's counts
    /// ([`remote`]; a rule past its end, or an empty slice: nothing).
    pub fn check<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        reserves: &mut Reserves,
        probes: &[Probe],
        remotes: &[Remote],
        now: UnixMillis,
    ) -> Verdict {
        let mut standings = Vec::with_capacity(probes.len());
        // What is not pending was taken from the reserves (in order: `pending` is a
        // subsequence of `probes`).
        let mut pending = Vec::new();
        for probe in probes {
            let Some(table) = self.table(probe.rule).filter(|t| t.bucket.is_none()) else {
                pending.push(*probe);
                continue;
            };
            let phase = table.window.phase(now);
            let remote = remote_of(remotes, probe.rule);
            // A request that counts nothing now (its cost comes later) needs room for one unit,
            // which only a read can tell.
            let taking = if probe.cost == 0 { None } else { reserves.take(*probe, phase.bucket_index, probe.cost) };
            match taking {
                // Other proxies' counts grow between syncs, and a key's tier can change between
                // its requests: a reserve counted before is only used while the whole estimate
                // still fits the key's limit now.
                Some(counts)
                    if (remote.is_none() && probe.limit.is_none())
                        || table.window.fits(remote.fleet(counts), phase.elapsed_ms, limit_of(table, probe)) =>
                {
                    standings.push(standing(table, probe, remote, counts, now));
                }
                Some(_) => {
                    reserves.untake(*probe, probe.cost);
                    pending.push(*probe);
                }
                None => pending.push(*probe),
            }
        }
        if pending.is_empty() {
            return Verdict::Admitted {
                standings,
                evictions: Vec::new(),
            };
        }
        let untake = |reserves: &mut Reserves| {
            let mut still_pending = pending.iter().peekable();
            for probe in probes {
                if still_pending.next_if_eq(&probe).is_none() {
                    reserves.untake(*probe, probe.cost);
                }
            }
        };
        let mut reads = Vec::with_capacity(pending.len());
        let mut violations = Vec::new();
        for &probe in &pending {
            match self.read(store, reserves, probe, remote_of(remotes, probe.rule), now) {
                Ok(read) => {
                    if !read.admits {
                        violations.push(Violation {
                            standing: self.standing_before(&read, now),
                            cause: Cause::OverLimit,
                        });
                    }
                    reads.push(read);
                }
                Err(_) => violations.push(Violation {
                    standing: self.blank_standing(probe, now),
                    cause: Cause::Contention,
                }),
            }
        }
        if !violations.is_empty() {
            untake(reserves);
            return Verdict::Refused { violations };
        }
        let mut evictions = Vec::new();
        let mut committed: Vec<(&Read, u64)> = Vec::with_capacity(reads.len());
        for read in &reads {
            match self.commit(store, reserves, read, now) {
                Ok(done) => {
                    standings.push(done.standing);
                    if done.evicted {
                        evictions.push(read.probe.rule);
                    }
                    committed.push((read, done.bucket_index));
                }
                Err(violation) => {
                    // Only this request's cost goes back: units granted to the reserves stay
                    // counted and reserved.
                    for (done, bucket) in committed {
                        self.give_back(store, done.probe, Leftover { bucket_index: bucket, units: done.probe.cost });
                    }
                    untake(reserves);
                    return Verdict::Refused {
                        violations: vec![violation],
                    };
                }
            }
        }
        Verdict::Admitted {
            standings,
            evictions,
        }
    }

    /// Gives back the reserves this VM left unused for a heartbeat period or whose window bucket
    /// ended (called once per heartbeat).
    pub fn heartbeat<S: SharedStore + ?Sized>(&self, store: &S, reserves: &mut Reserves, now: UnixMillis) {
        let returns = reserves.heartbeat(|rule| self.table(rule).map(|t| t.window.phase(now).bucket_index));
        for r in returns {
            self.give_back(store, r.probe, r.leftover);
        }
    }

    /// Gives back every reserve (the configuration is being replaced).
    pub fn drain<S: SharedStore + ?Sized>(&self, store: &S, reserves: &mut Reserves) {
        for r in reserves.drain() {
            self.give_back(store, r.probe, r.leftover);
        }
    }

    fn table(&self, rule: usize) -> Option<&RuleTable> {
        self.tables.get(rule)
    }

    fn locate(&self, probe: Probe) -> Option<(&RuleTable, String)> {
        let table = self.table(probe.rule)?;
        let index = probe.key_hash.checked_rem(table.sets.get()).unwrap_or(0);
        Some((table, table.set_key(index)))
    }

    fn read<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        reserves: &Reserves,
        probe: Probe,
        remote: Remote,
        now: UnixMillis,
    ) -> Result<Read, StoreError> {
        let (table, key) = self.locate(probe).ok_or(StoreError::Host(0))?;
        let stored = store.get(&key)?;
        if let Some(spec) = &table.bucket {
            let set = decode_or_empty(stored.as_ref(), table.shape, 0).rolled_overflow_to(spec.period.phase(now).bucket_index);
            let bucket = Bucket::new(table.window, limit_of(table, &probe), spec.burst, spec.max_delay_ms);
            let tat = set.tat_of(fingerprint(probe.key_hash), micros(now), bucket.interval_us());
            let admits = matches!(bucket.decide(tat, now, probe.cost, probe.needs()), Turn::Go { .. });
            return Ok(Read { probe, remote, key, stored, set, leftover: Leftover::default(), counts: Counts::default(), tat, admits });
        }
        let phase = table.window.phase(now);
        let set = decode_or_empty(stored.as_ref(), table.shape, phase.bucket_index).rolled_to(phase.bucket_index);
        let leftover = reserves.leftover(probe, phase.bucket_index);
        let counts = leftover.remove_from(set.counts_of(fingerprint(probe.key_hash)), phase.bucket_index);
        let admits = table.window.fits(remote.fleet(counts.plus(probe.needs())), phase.elapsed_ms, limit_of(table, &probe));
        Ok(Read {
            probe,
            remote,
            key,
            stored,
            set,
            leftover,
            counts,
            tat: 0,
            admits,
        })
    }

    /// Where the key of `read` stood before this request. Only a refusal needs it: an admitted
    /// request reports where it stands after counting (computed once, in [`Limiter::commit`]).
    fn standing_before(&self, read: &Read, now: UnixMillis) -> Standing {
        match self.table(read.probe.rule) {
            Some(table) if table.bucket.is_some() => bucket_standing(table, &read.probe, read.tat, now, None),
            Some(table) => standing(table, &read.probe, read.remote, read.counts, now),
            None => self.blank_standing(read.probe, now),
        }
    }

    /// Phase 2 for one rule: counts the request, gives back the VM's leftover units of the key
    /// and counts a new reserve for it when there is room to spare, in one write.
    fn commit<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        reserves: &mut Reserves,
        first: &Read,
        now: UnixMillis,
    ) -> Result<Committed, Violation> {
        let contention = || Violation {
            standing: self.standing_before(first, now),
            cause: Cause::Contention,
        };
        let table = self.table(first.probe.rule).ok_or_else(contention)?;
        if let Some(spec) = &table.bucket {
            return self.commit_bucket(store, first, table, spec, now).map_err(|over| over.unwrap_or_else(contention));
        }
        let (cost, limit) = (first.probe.cost, limit_of(table, &first.probe));
        let phase = table.window.phase(now);
        let fp = fingerprint(first.probe.key_hash);
        // The first attempt decides on phase 1's read; each later one on the set as read again,
        // where the decision is taken again on the fresh counts.
        let mut phase_one = Some((first.set.clone(), first.counts));
        let mut stored = first.stored.clone();
        let written = update_from(store, &first.key, &mut stored, MAX_ATTEMPTS, |current| {
            let (mut set, counts) = match phase_one.take() {
                Some(read) => read,
                None => {
                    let set = decode_or_empty(current, table.shape, phase.bucket_index).rolled_to(phase.bucket_index);
                    let counts = first.leftover.remove_from(set.counts_of(fp), phase.bucket_index);
                    if !table.window.fits(first.remote.fleet(counts.plus(first.probe.needs())), phase.elapsed_ms, limit) {
                        return Attempt::Done(Err(Violation {
                            standing: standing(table, &first.probe, first.remote, counts, now),
                            cause: Cause::OverLimit,
                        }));
                    }
                    (set, counts)
                }
            };
            let after = counts.plus(cost);
            let added = set.add(fp, cost, table.window, phase.elapsed_ms);
            // Units are only reserved on an entry (they can be given back from there), and for
            // requests of cost 1: a reserve serves the next requests of the same cost, and a
            // key whose requests cost more, or whose cost comes later, would only hold room
            // others may need.
            let grant = if added.resident && cost == 1 {
                let room = table.window.remaining(first.remote.fleet(after), phase.elapsed_ms, limit);
                reserves.grant(first.probe, room)
            } else {
                0
            };
            set.add_to_entry(fp, grant);
            set.subtract(fp, first.leftover.units, first.leftover.bucket_index);
            let done = (after, added.evicted.is_some(), set.bucket_index, grant, set.counts_of(fp));
            Attempt::Write(set.encode(), Ok(done))
        });
        match written {
            Ok(Ok((after, evicted, bucket_index, grant, counts))) => {
                reserves.record(first.probe, phase.bucket_index, grant, counts);
                Ok(Committed {
                    standing: standing(table, &first.probe, first.remote, after, now),
                    evicted,
                    bucket_index,
                })
            }
            Ok(Err(violation)) => Err(violation),
            Err(_) => Err(contention()),
        }
    }

    /// Phase 2 for a token-bucket rule: takes the request's slot (the key's TAT moves on by its
    /// cost), deciding again on a fresh read when another worker wrote the set meanwhile.
    /// `Err(None)` on contention.
    fn commit_bucket<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        first: &Read,
        table: &RuleTable,
        spec: &BucketSpec,
        now: UnixMillis,
    ) -> Result<Committed, Option<Violation>> {
        let probe = first.probe;
        let bucket = Bucket::new(table.window, limit_of(table, &probe), spec.burst, spec.max_delay_ms);
        let (fp, now_us, period) = (fingerprint(probe.key_hash), micros(now), spec.period.phase(now).bucket_index);
        let mut phase_one = Some((first.set.clone(), first.tat));
        let mut stored = first.stored.clone();
        let written = update_from(store, &first.key, &mut stored, MAX_ATTEMPTS, |current| {
            let (mut set, tat) = phase_one.take().unwrap_or_else(|| {
                let set = decode_or_empty(current, table.shape, period).rolled_overflow_to(period);
                let tat = set.tat_of(fp, now_us, bucket.interval_us());
                (set, tat)
            });
            match bucket.decide(tat, now, probe.cost, probe.needs()) {
                Turn::Go { tat: after, at } => {
                    let added = set.put_tat(fp, after, probe.cost, now_us, spec.unit_us);
                    Attempt::Write(set.encode(), Ok((after, at, added.evicted.is_some())))
                }
                Turn::Refuse { .. } => Attempt::Done(Err(Violation {
                    standing: bucket_standing(table, &probe, tat, now, None),
                    cause: Cause::OverLimit,
                })),
            }
        });
        match written {
            Ok(Ok((after, at, evicted))) => Ok(Committed {
                standing: bucket_standing(table, &probe, after, now, Some(at).filter(|at| *at > now)),
                evicted,
                bucket_index: period,
            }),
            Ok(Err(violation)) => Err(Some(violation)),
            Err(_) => Err(None),
        }
    }

    /// Gives back the slot an admitted request took of a token-bucket rule (it waited for its
    /// turn and its client went away): the key's TAT moves back by the request's cost, if the
    /// key still owns its entry.
    pub fn give_back_turn<S: SharedStore + ?Sized>(&self, store: &S, probe: Probe) {
        self.give_back(store, probe, Leftover { bucket_index: 0, units: probe.cost });
    }

    /// Charges `units` to `probe`'s key in the current window bucket without a decision: a cost
    /// known after admission (a streamed request body, units the upstream reported; see
    /// [`crate::ratelimit::rules`]). It can take the key past its limit; its later requests are then
    /// refused until the window slides. Returns false if the counters could not be updated
    /// (the charge is lost, counted by the caller).
    pub fn charge<S: SharedStore + ?Sized>(&self, store: &S, probe: Probe, units: u32, now: UnixMillis) -> bool {
        if units == 0 {
            return true;
        }
        let Some((table, key)) = self.locate(probe) else { return false };
        let fp = fingerprint(probe.key_hash);
        if let (Some(spec), Some(bucket)) = (&table.bucket, table.bucket_of(limit_of(table, &probe))) {
            let (now_us, period) = (micros(now), spec.period.phase(now).bucket_index);
            return update(store, &key, |current| {
                let mut set = decode_or_empty(current, table.shape, period).rolled_overflow_to(period);
                let tat = bucket.charged(set.tat_of(fp, now_us, bucket.interval_us()), now, units);
                set.put_tat(fp, tat, units, now_us, spec.unit_us);
                Attempt::Write(set.encode(), ())
            })
            .is_ok();
        }
        let phase = table.window.phase(now);
        update(store, &key, |current| {
            let mut set = decode_or_empty(current, table.shape, phase.bucket_index).rolled_to(phase.bucket_index);
            set.add(fp, units, table.window, phase.elapsed_ms);
            Attempt::Write(set.encode(), ())
        })
        .is_ok()
    }

    /// Gives back `units` that `probe`'s key was charged at `admitted_at` and did not use (a
    /// reservation above the count the upstream reported): out of the window bucket they were
    /// counted in, if the key still has it (best effort: if not, the key is over-counted, the
    /// safe direction).
    pub fn refund<S: SharedStore + ?Sized>(&self, store: &S, probe: Probe, units: u32, admitted_at: UnixMillis) {
        let Some(table) = self.tables.get(probe.rule) else { return };
        if units == 0 {
            return;
        }
        let bucket_index = table.window.phase(admitted_at).bucket_index;
        self.give_back(store, probe, Leftover { bucket_index, units });
    }

    /// Takes `leftover` units of `probe`'s key back out of its counters (best effort: if it
    /// cannot, the key is over-counted, which is the safe direction).
    fn give_back<S: SharedStore + ?Sized>(&self, store: &S, probe: Probe, leftover: Leftover) {
        let Some((table, key)) = self.locate(probe) else { return };
        let fp = fingerprint(probe.key_hash);
        // Best effort: a record that is gone, unreadable or of another definition is left as it is.
        let _ = update(store, &key, |current| {
            let Some(set) = current.and_then(|s| Set::decode(&s.value).ok()).filter(|set| set.shape == table.shape) else {
                return Attempt::Done(());
            };
            let mut set = set;
            match table.bucket_of(limit_of(table, &probe)) {
                Some(bucket) => set.untake_tat(fp, bucket.span_us(leftover.units)),
                None => {
                    set = set.rolled_to(leftover.bucket_index);
                    set.subtract(fp, leftover.units, leftover.bucket_index);
                }
            }
            Attempt::Write(set.encode(), ())
        });
    }

    /// This proxy's counts of `probe`'s key at `now` (a sliding-window rule's; `None` for a
    /// token bucket's, an unknown rule's, or a record that cannot be read).
    pub fn counts_of<S: SharedStore + ?Sized>(&self, store: &S, reserves: &Reserves, probe: &Probe, now: UnixMillis) -> Option<Counts> {
        let read = self.read(store, reserves, *probe, Remote::NONE, now).ok()?;
        self.table(probe.rule).filter(|t| t.bucket.is_none()).map(|_| read.counts)
    }

    /// Where `probe`'s key stands with `counts` (this proxy's, or the fleet's for a leased
    /// rule: nothing added), against its limit, for a request of its cost; `None` for an
    /// unknown rule.
    pub fn standing_of(&self, probe: &Probe, counts: Counts, now: UnixMillis) -> Option<Standing> {
        self.table(probe.rule).map(|table| standing(table, probe, Remote::NONE, counts, now))
    }

    fn blank_standing(&self, probe: Probe, now: UnixMillis) -> Standing {
        Standing {
            rule: probe.rule,
            estimate: 0.0,
            remaining: 0,
            reset_ms: 0,
            retry_at: Some(now),
            limit: self.table(probe.rule).map_or(NonZeroU32::MIN, |t| limit_of(t, &probe)),
            go_at: None,
        }
    }
}

/// The limit of `probe`'s key: its own (a tier's, an override's) or the rule's.
fn limit_of(table: &RuleTable, probe: &Probe) -> NonZeroU32 {
    probe.limit.unwrap_or(table.limit)
}

/// What the rest of the fleet adds to the counts of rule `rule`'s key, of those by rule
/// (nothing past their end).
fn remote_of(remotes: &[Remote], rule: usize) -> Remote {
    remotes.get(rule).copied().unwrap_or(Remote::NONE)
}

/// Where `probe`'s key stands with this proxy's `local` counts and what the rest of the fleet
/// adds to them (`remote`), against its limit, for a request of its cost.
fn standing(table: &RuleTable, probe: &Probe, remote: Remote, local: Counts, now: UnixMillis) -> Standing {
    let phase = table.window.phase(now);
    let limit = limit_of(table, probe);
    let counts = remote.fleet(local);
    Standing {
        rule: probe.rule,
        estimate: table.window.estimate(counts, phase.elapsed_ms),
        remaining: table.window.remaining(counts, phase.elapsed_ms, limit),
        reset_ms: table.window.ms_until_reset(counts, now),
        retry_at: remote.earliest_admission(table.window, local, now, probe.needs(), limit),
        limit,
        go_at: None,
    }
}

/// Where `probe`'s key of a token-bucket rule stands with its TAT `tat` (µs): its level as the
/// estimate, the requests that would go at once, the time until its bucket is full again, and
/// when a request of its cost would go (at once or within `max_delay`).
fn bucket_standing(table: &RuleTable, probe: &Probe, tat: u64, now: UnixMillis, go_at: Option<UnixMillis>) -> Standing {
    let limit = limit_of(table, probe);
    match table.bucket_of(limit) {
        Some(bucket) => Standing {
            rule: probe.rule,
            estimate: bucket.level(tat, now),
            remaining: bucket.remaining(tat, now),
            reset_ms: bucket.ms_until_full(tat, now),
            retry_at: bucket.earliest_admission(tat, now, probe.needs()),
            limit,
            go_at,
        },
        None => standing(table, probe, Remote::NONE, Counts::default(), now),
    }
}

/// The bucket of a token-bucket rule: its overflow's period is the horizon (`τ + max_delay`)
/// of its smallest limit (whole milliseconds, at least one), its levels compared in the
/// emission interval of its largest.
fn bucket_spec(rule: &crate::config::RateLimitRule, window: Window, burst: NonZeroU32) -> BucketSpec {
    let max_delay_ms = rule.max_delay.map_or(0, |d| d.get().get());
    let slowest = Bucket::new(window, rule.limits().min().unwrap_or(NonZeroU32::MIN), burst, max_delay_ms);
    let fastest = Bucket::new(window, rule.limits().max().unwrap_or(NonZeroU32::MIN), burst, max_delay_ms);
    let period_ms = slowest.horizon_us().div_ceil(1000);
    BucketSpec {
        burst,
        max_delay_ms,
        period: Window::new(NonZeroU64::new(period_ms).unwrap_or(NonZeroU64::MIN)),
        unit_us: fastest.interval_us(),
    }
}

/// A record that cannot be decoded (corrupt, truncated, or from another version of the
/// module), or that belongs to another definition of the rule (`shape`), is not trusted: the
/// set starts empty and the next write replaces it.
fn decode_or_empty(stored: Option<&Stored>, shape: u64, bucket_index: u64) -> Set {
    stored
        .and_then(|s| Set::decode(&s.value).ok())
        .filter(|set| set.shape == shape)
        .unwrap_or_else(|| Set::empty(shape, bucket_index))
}

#[cfg(test)]
mod tests;
