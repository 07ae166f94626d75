//! The proxy-wide in-flight record ([`InFlight`]) that load shedding, cluster selection and the
//! per-key cap publish their counts in: an entry per VM with its count and its last heartbeat
//! (monotonic ms), so a VM that dies stops counting after [`STALE_AFTER_MS`]. And the in-flight
//! half of reserves: [`Local`], one per VM and record, [`in_flight_units`], and the [`Permit`] a
//! request holds (the quota half is [`crate::ratelimit::reserve`]).
//!
//! Invariants: a unit is counted in the record, by a compare-and-swap that checked the limit,
//! before any request uses it; a reserved unit is used only while the limit the request is admitted
//! under now still admits it ([`Local::take_reserved`]); a grant is at most [`RESERVE_MAX`] units
//! and a fraction of the room ([`IN_FLIGHT_SPREAD`] × live workers), none near the limit; unused
//! units go back at the heartbeat and when their configuration is retired.
//!
//! Record layout (little-endian): version `u8`, entry count `u8`, 2 zero bytes, then per entry VM
//! id `u64`, in-flight `u32`, last heartbeat (monotonic ms) `u64`.
//!
//! Rationale: docs/design.md, sections "Reserves" and "Load shedding".

use crate::primitives::record::{DecodeError, Reader, Writer};
use crate::primitives::time::MonoMillis;
use std::cell::Cell;
use std::rc::Rc;

/// A VM whose heartbeat is older than this is considered gone.
pub const STALE_AFTER_MS: u64 = 10_000;
/// How often a VM refreshes its heartbeat.
pub const HEARTBEAT_MS: u64 = 1_000;
/// Entries a record holds at most (workers plus replaced VMs not yet expired).
pub const MAX_VMS: usize = 128;

const RECORD_VERSION: u8 = 1;
const HEADER_LEN: usize = 4;
const ENTRY_LEN: usize = 8 + 4 + 8;

/// One VM's share of the in-flight count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmEntry {
    /// The VM's random id.
    pub vm: u64,
    /// Requests this VM admitted that have not ended.
    pub in_flight: u32,
    /// When the VM last proved it is alive.
    pub heartbeat: MonoMillis,
}

/// The proxy-wide in-flight record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct InFlight {
    /// Per-VM entries.
    pub entries: Vec<VmEntry>,
}

impl InFlight {
    /// Reads a record, refusing anything malformed.
    pub fn decode(bytes: &[u8]) -> Result<InFlight, DecodeError> {
        let mut reader = Reader::new(bytes);
        let [version, count, _, _] = reader.array::<HEADER_LEN>()?;
        if version != RECORD_VERSION || reader.remaining() != usize::from(count).saturating_mul(ENTRY_LEN) {
            return Err(DecodeError::Malformed);
        }
        let mut entries = Vec::with_capacity(usize::from(count));
        for _ in 0..count {
            entries.push(VmEntry { vm: reader.u64()?, in_flight: reader.u32()?, heartbeat: MonoMillis(reader.u64()?) });
        }
        Ok(InFlight { entries })
    }

    /// Writes the record.
    pub fn encode(&self) -> Vec<u8> {
        let count = self.entries.len().min(MAX_VMS);
        let mut out = Vec::with_capacity(HEADER_LEN.saturating_add(count.saturating_mul(ENTRY_LEN)));
        out.put(&[RECORD_VERSION, u8::try_from(count).unwrap_or(u8::MAX), 0, 0]);
        for entry in self.entries.iter().take(count) {
            out.put_u64(entry.vm);
            out.put_u32(entry.in_flight);
            out.put_u64(entry.heartbeat.0);
        }
        out
    }

    /// Requests in flight across every live VM.
    pub fn total(&self, now: MonoMillis) -> u32 {
        self.live_sum(now, None)
    }

    /// Requests in flight on live VMs other than `vm`.
    pub fn others(&self, vm: u64, now: MonoMillis) -> u32 {
        self.live_sum(now, Some(vm))
    }

    /// Live VMs other than `vm` that hold units.
    pub fn other_vms(&self, vm: u64, now: MonoMillis) -> u32 {
        let count = self
            .entries
            .iter()
            .filter(|e| e.vm != vm && is_live(e, now))
            .count();
        u32::try_from(count).unwrap_or(u32::MAX)
    }

    fn live_sum(&self, now: MonoMillis, except: Option<u64>) -> u32 {
        self.entries
            .iter()
            .filter(|e| Some(e.vm) != except && is_live(e, now))
            .fold(0u32, |sum, e| sum.saturating_add(e.in_flight))
    }

    /// Publishes `vm`'s count as of `now`: drops dead and idle entries of other VMs, then sets
    /// (or, when zero, removes) `vm`'s entry. Returns false if there was no room for it.
    pub fn publish(&mut self, vm: u64, in_flight: u32, now: MonoMillis) -> bool {
        self.entries
            .retain(|e| e.vm != vm && is_live(e, now) && e.in_flight > 0);
        if in_flight == 0 {
            return true;
        }
        if self.entries.len() >= MAX_VMS {
            return false;
        }
        self.entries.push(VmEntry {
            vm,
            in_flight,
            heartbeat: now,
        });
        true
    }

    /// Whether a heartbeat of `vm` with local count `in_flight` would change anything worth a
    /// write: its own entry is missing, stale-bound or wrong, or there are dead entries to drop.
    pub fn needs_heartbeat(&self, vm: u64, in_flight: u32, now: MonoMillis) -> bool {
        let own = self.entries.iter().find(|e| e.vm == vm);
        let own_current = match own {
            Some(e) => e.in_flight == in_flight && now.saturating_since(e.heartbeat) < HEARTBEAT_MS,
            None => in_flight == 0,
        };
        !own_current || self.entries.iter().any(|e| !is_live(e, now))
    }
}

/// The decision for one request, given the published record and this VM's local count.
pub fn admits(record: &InFlight, vm: u64, local: u32, threshold: u32, now: MonoMillis) -> Result<u32, u32> {
    let total = record.others(vm, now).saturating_add(local);
    if total < threshold {
        Ok(total)
    } else {
        Err(total)
    }
}

/// A VM's entry counts while its heartbeat is recent: less than [`STALE_AFTER_MS`] old, and not
/// more than that ahead of `now` either (a corrupt record, or a dead VM's entry after the wall
/// clock stepped back, must not count forever; a live VM rewrites its entry within a heartbeat).
fn is_live(entry: &VmEntry, now: MonoMillis) -> bool {
    now.saturating_since(entry.heartbeat) < STALE_AFTER_MS && entry.heartbeat.saturating_since(now) < STALE_AFTER_MS
}

/// Units a worker may hold beyond what it uses, in any reserve.
pub const RESERVE_MAX: u32 = 16;
/// An in-flight reserve is at most `1 / (IN_FLIGHT_SPREAD × live VMs)` of the room left below
/// the limit.
pub const IN_FLIGHT_SPREAD: u32 = 4;

/// The units a VM publishes once it admits a request that brings its count in use to
/// `in_use_after`: those, plus a reserve of `min(RESERVE_MAX, ⌊room / (IN_FLIGHT_SPREAD × live)⌋)`
/// where `room = ceiling − (others + in_use_after)` and `live` counts the live VMs, this one
/// included, and no reserve when that share is a single unit. Never more than
/// `max(ceiling − others, in_use_after)`.
pub fn in_flight_units(in_use_after: u32, others: u32, other_vms: u32, ceiling: u32) -> u32 {
    let room = ceiling.saturating_sub(others.saturating_add(in_use_after));
    let live = other_vms.saturating_add(1);
    let spare = room
        .checked_div(live.saturating_mul(IN_FLIGHT_SPREAD))
        .unwrap_or(0);
    // A single spare unit saves one write and could leave the last unit below a small threshold
    // stranded in an idle VM: not worth it.
    let spare = if spare < 2 { 0 } else { spare };
    in_use_after.saturating_add(spare.min(RESERVE_MAX))
}

/// This VM's side of one shared in-flight count (the shedder's, or one cluster's): the truth for
/// this VM, which the shared record only mirrors. One per VM and record, shared by the
/// configurations that use the record.
#[derive(Debug, Default)]
pub struct Local {
    /// Requests admitted that have not ended.
    in_use: Cell<u32>,
    /// Units this VM's entry in the record holds, as last written (at least `in_use`; more when
    /// the VM holds a reserve). Raised only once a write succeeded, so it never claims more
    /// than the record grants.
    held: Cell<u32>,
    /// Other live VMs' units when the record was last read.
    others: Cell<u32>,
    /// The last admission that wrote the record was granted no reserve: the count is near its
    /// threshold, so every release is published at once.
    near: Cell<bool>,
}

impl Local {
    /// Requests admitted on this VM that have not ended.
    pub fn in_use(&self) -> u32 {
        self.in_use.get()
    }

    /// Units this VM holds in the record (its requests plus its reserve), as last written.
    pub fn held(&self) -> u32 {
        self.held.get()
    }

    /// Other VMs' units as last read.
    pub fn others(&self) -> u32 {
        self.others.get()
    }

    /// Takes one unit from the reserve, if there is one and the count stays below `ceiling`
    /// (the threshold or limit the request is admitted under, as this VM knows it now): the
    /// admission needs no shared data. The ceiling check matters when the limit has dropped
    /// since the units were granted (a reload lowering `max_active_requests`, another worker's
    /// AIMD back-off): units granted under the old limit are not spent past the new one.
    pub fn take_reserved(&self, ceiling: u32) -> bool {
        let in_use = self.in_use.get();
        if in_use < self.held.get() && self.others.get().saturating_add(in_use) < ceiling {
            self.in_use.set(in_use.saturating_add(1));
            true
        } else {
            false
        }
    }

    /// Records the other VMs' units as just read, without a write of this VM's.
    pub(crate) fn saw(&self, others: u32) {
        self.others.set(others);
    }

    /// Records a successful write of `held` units with one more request in use.
    pub(crate) fn admitted(&self, held: u32, others: u32) {
        let in_use = self.in_use.get().saturating_add(1);
        self.in_use.set(in_use);
        self.held.set(held.max(in_use));
        self.others.set(others);
        self.near.set(held <= in_use);
    }

    /// Records that the record now holds `held` units for this VM (after a write that lowered
    /// them, or one that failed: lowering is always safe).
    pub(crate) fn published(&self, held: u32, others: u32) {
        self.held.set(held.max(self.in_use.get()));
        self.others.set(others);
    }

    /// Whether the VM holds units it does not use and should give them back now: its reserve
    /// outgrew [`RESERVE_MAX`] (the load fell), or the count is near its threshold, where every
    /// unit may be another VM's next admission. (Otherwise the next heartbeat gives it back: a
    /// worker whose requests come and go would else write at every idle moment.)
    pub fn idle_surplus(&self) -> bool {
        let (in_use, held) = (self.in_use.get(), self.held.get());
        held > in_use && (held.saturating_sub(in_use) > RESERVE_MAX || self.near.get())
    }

    fn end_one(&self) {
        self.in_use.set(self.in_use.get().saturating_sub(1));
    }
}

/// A VM's [`Local`] count, shared by the configurations and permits that use it.
pub type LocalCount = Rc<Local>;

/// A request's hold on one unit of the in-flight count, released exactly once: by
/// [`crate::shedding::Shedder::release`] (or `Selector::finish`) when the stream ends, or, should the stream vanish without that, by
/// `Drop`, which lowers the local count (the next heartbeat publishes it).
#[derive(Debug)]
#[must_use = "an admitted request must release its permit when its stream ends"]
pub struct Permit {
    pub(crate) local: LocalCount,
    released: bool,
}

impl Permit {
    /// A permit on one unit of `local`, whose count in use the caller has just raised.
    pub(crate) fn taken(local: &LocalCount) -> Permit {
        Permit { local: Rc::clone(local), released: false }
    }

    /// Gives the unit back (once; later calls do nothing).
    pub(crate) fn end(&mut self) {
        if !self.released {
            self.released = true;
            self.local.end_one();
        }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        self.end();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserves_are_a_share_of_the_room_and_vanish_near_the_threshold() {
        assert_eq!(
            in_flight_units(1, 0, 0, 50_000),
            1 + RESERVE_MAX,
            "far below: a full reserve"
        );
        assert_eq!(
            in_flight_units(1, 0, 1, 100),
            1 + 12,
            "99 units of room, 2 VMs: a quarter of half"
        );
        assert_eq!(in_flight_units(5, 0, 0, 8), 5, "3 units of room: none");
        assert_eq!(in_flight_units(8, 0, 0, 8), 8, "at the threshold");
        assert_eq!(
            in_flight_units(9, 0, 0, 8),
            9,
            "past it (a higher class): never less than in use"
        );
        assert_eq!(in_flight_units(1, 90, 3, 100), 1, "others hold most of it");
        for (in_use, others, vms, ceiling) in (1..40).flat_map(|u| (0..40).flat_map(move |o| (0..3).map(move |v| (u, o, v, 30)))) {
            let held = in_flight_units(in_use, others, vms, ceiling);
            assert!(held >= in_use && held <= (ceiling.saturating_sub(others)).max(in_use), "{in_use} {others} {vms}");
        }
    }
}
