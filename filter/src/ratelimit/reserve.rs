//! Quota reserves: units of a key's current window bucket that this VM has already counted in
//! shared data, and admits its next requests of that key from without reading shared data: the
//! per-key, per-bucket shape of [`crate::primitives::inflight`]'s reserves.
//!
//! Invariants: a reserve is used only in the bucket it was counted in, where the sliding estimate
//! only falls as time passes, so a unit that fitted when counted still fits whatever the other
//! workers did since. Grants are small (nothing on a key's first request through a VM, then 1, 2,
//! 4, … up to [`RESERVE_MAX`], never more than `1 / QUOTA_SPREAD` of the room: none near the
//! limit), and unused units go back when their bucket ends, after a heartbeat period unused, and
//! when their configuration is retired.
//!
//! Rationale: docs/design.md, section "Reserves".

use super::window::Counts;
use super::Probe;
use crate::primitives::hash::MixMap;

use crate::primitives::inflight::RESERVE_MAX;
/// A grant is at most this fraction (1 / n) of the room left under the limit.
pub const QUOTA_SPREAD: u64 = 8;
/// Keys one VM follows per configuration; a key not used for a heartbeat period is forgotten.
pub const MAX_KEYS: usize = 4096;
/// Reserves one heartbeat gives back at most (each is a read and a write of shared data); the
/// rest wait for the next heartbeat, so a worker never stalls on a tick.
pub const MAX_RETURNS_PER_HEARTBEAT: usize = 256;

/// One key's reserve in this VM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Reserve {
    /// The window bucket the units were counted in.
    bucket_index: u64,
    /// Units counted in shared data and not used yet.
    units: u32,
    /// The key's counters as this VM last wrote them, including `units` (as of `bucket_index`).
    counts: Counts,
    /// The next grant for this key, before the room and [`RESERVE_MAX`] bound it.
    next_grant: u32,
    /// Whether a request used this reserve since the last heartbeat.
    used: bool,
}

type ByKey = MixMap<(usize, u64), Reserve>;

fn id(probe: Probe) -> (usize, u64) {
    (probe.rule, probe.key_hash)
}

/// Units of a key this VM counted earlier and did not use, to give back at its next write.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Leftover {
    /// The bucket they were counted in.
    pub bucket_index: u64,
    /// How many.
    pub units: u32,
}

impl Leftover {
    /// The counters as seen from bucket `bucket_index` without these units (never below zero).
    pub fn remove_from(self, counts: Counts, bucket_index: u64) -> Counts {
        if self.bucket_index == bucket_index {
            Counts { current: counts.current.saturating_sub(self.units), ..counts }
        } else if self.bucket_index.saturating_add(1) == bucket_index {
            Counts { previous: counts.previous.saturating_sub(self.units), ..counts }
        } else {
            counts
        }
    }
}

/// A reserve to give back (see [`Reserves::heartbeat`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Return {
    /// The key.
    pub probe: Probe,
    /// The units and the bucket they were counted in.
    pub leftover: Leftover,
}

/// This VM's quota reserves for one configuration.
#[derive(Clone, Debug)]
pub struct Reserves {
    by_key: ByKey,
    /// Keys followed at most ([`MAX_KEYS`]; 0: no reserves).
    max_keys: usize,
}

impl Default for Reserves {
    fn default() -> Self {
        Reserves::new()
    }
}

impl Reserves {
    /// Follows up to [`MAX_KEYS`] keys.
    pub fn new() -> Reserves {
        Reserves { by_key: ByKey::default(), max_keys: MAX_KEYS }
    }

    /// No reserves at all: every request reads and writes shared data.
    pub fn disabled() -> Reserves {
        Reserves { by_key: ByKey::default(), max_keys: 0 }
    }

    fn reserve(&self, probe: Probe) -> Option<&Reserve> {
        self.by_key.get(&id(probe))
    }

    fn reserve_mut(&mut self, probe: Probe) -> Option<&mut Reserve> {
        self.by_key.get_mut(&id(probe))
    }

    /// Admits a request of `cost` for `probe` from the reserve counted in `bucket_index`, if
    /// there is one with enough units. Returns the key's counters including this request and
    /// excluding the units still unused (what an exact count would say, as of this VM's last
    /// write).
    pub fn take(&mut self, probe: Probe, bucket_index: u64, cost: u32) -> Option<Counts> {
        let reserve = self.reserve_mut(probe)?;
        if reserve.bucket_index != bucket_index {
            return None;
        }
        reserve.units = reserve.units.checked_sub(cost)?;
        reserve.used = true;
        let current = reserve.counts.current.saturating_sub(reserve.units);
        Some(Counts { current, ..reserve.counts })
    }

    /// Puts back what [`Reserves::take`] took for a request that another rule refused.
    pub fn untake(&mut self, probe: Probe, cost: u32) {
        if let Some(reserve) = self.reserve_mut(probe) {
            reserve.units = reserve.units.saturating_add(cost);
        }
    }

    /// The units this VM holds for `probe`, counted in this bucket or the one before, which the
    /// key's next write gives back (they are not in use).
    pub fn leftover(&self, probe: Probe, bucket_index: u64) -> Leftover {
        match self.reserve(probe) {
            Some(reserve) if reserve.units > 0 && reserve.bucket_index.saturating_add(1) >= bucket_index => {
                Leftover { bucket_index: reserve.bucket_index, units: reserve.units }
            }
            _ => Leftover::default(),
        }
    }

    /// The units to count for `probe` on top of its request, given `room` (requests of cost 1
    /// the key would still admit after this one): nothing on a key's first write through this
    /// VM (or once it follows [`MAX_KEYS`] keys), then a doubling grant bounded by
    /// [`RESERVE_MAX`] and a [`QUOTA_SPREAD`]th of the room.
    pub fn grant(&self, probe: Probe, room: u64) -> u32 {
        let Some(reserve) = self.reserve(probe) else { return 0 };
        let share = u32::try_from(room / QUOTA_SPREAD).unwrap_or(u32::MAX);
        reserve.next_grant.min(RESERVE_MAX).min(share)
    }

    /// Records a write for `probe` in `bucket_index` that left `units` unused in the key's
    /// counters `counts` (any earlier leftover having been given back by the same write).
    pub fn record(&mut self, probe: Probe, bucket_index: u64, units: u32, counts: Counts) {
        let next_grant = match self.by_key.get(&id(probe)) {
            Some(reserve) => reserve.next_grant.saturating_mul(2).clamp(1, RESERVE_MAX),
            // A new key, while there is room to follow it (it got no units: see `grant`).
            None if self.by_key.len() < self.max_keys => 1,
            None => return,
        };
        self.by_key.insert(id(probe), Reserve { bucket_index, units, counts, next_grant, used: true });
    }

    /// Once per heartbeat: takes the reserves that no request used since the last heartbeat, or
    /// that were counted in a bucket that has ended (`bucket_of(rule)` is the rule's current
    /// bucket), and returns those still worth giving back, at most
    /// [`MAX_RETURNS_PER_HEARTBEAT`]. Keys idle for a whole period are forgotten (their grants
    /// start over) once nothing is left to give back.
    pub fn heartbeat(&mut self, bucket_of: impl Fn(usize) -> Option<u64>) -> Vec<Return> {
        let mut returns = Vec::new();
        self.by_key.retain(|&(rule, key_hash), reserve| {
            let current = bucket_of(rule);
            let ended = current != Some(reserve.bucket_index);
            if reserve.units > 0 && (ended || !reserve.used) {
                if returns.len() >= MAX_RETURNS_PER_HEARTBEAT {
                    // The next heartbeat takes it (`take` no longer serves an ended bucket).
                    reserve.used = false;
                    return true;
                }
                let leftover = Leftover { bucket_index: reserve.bucket_index, units: reserve.units };
                if current.is_some_and(|b| reserve.bucket_index.saturating_add(1) >= b) {
                    returns.push(Return { probe: Probe::new(rule, key_hash), leftover });
                }
                reserve.units = 0;
            }
            std::mem::replace(&mut reserve.used, false)
        });
        returns
    }

    /// How many keys this VM follows.
    pub fn followed(&self) -> usize {
        self.by_key.len()
    }

    /// Units held per rule, for `rules` rules.
    pub fn held(&self, rules: usize) -> Vec<u64> {
        let mut held = vec![0u64; rules];
        for (&(rule, _), reserve) in &self.by_key {
            if let Some(sum) = held.get_mut(rule) {
                *sum = sum.saturating_add(u64::from(reserve.units));
            }
        }
        held
    }

    /// Takes every reserve (a configuration is being replaced): all of them are worth giving
    /// back.
    pub fn drain(&mut self) -> Vec<Return> {
        self.by_key
            .drain()
            .filter(|(_, reserve)| reserve.units > 0)
            .map(|((rule, key_hash), reserve)| Return {
                probe: Probe::new(rule, key_hash),
                leftover: Leftover { bucket_index: reserve.bucket_index, units: reserve.units },
            })
            .collect()
    }
}
