//! Load shedding on the proxy-wide count of in-flight requests. An admitted request holds a
//! [`Permit`] from its request headers to the end of its stream; a request of priority class `c` is
//! admitted while
//!
//! ```text
//! in_flight < threshold(c) = max(1, ⌊shed_at(c) × max_active_requests⌋)
//! ```
//!
//! so low classes are shed first. Each VM counts its own requests in memory and publishes the
//! count, with a heartbeat, in the shared [`crate::primitives::inflight::InFlight`] record; to
//! admit, it adds the other VMs' published counts and publishes its own plus one with a
//! compare-and-swap.
//!
//! Invariants: the count is exact across workers (no two VMs take the last unit); a release whose
//! write fails is published by the next heartbeat (every
//! [`HEARTBEAT_MS`](crate::primitives::inflight::HEARTBEAT_MS)), so the figure errs only on the
//! safe side; a VM that stops heartbeating stops counting after
//! [`STALE_AFTER_MS`](crate::primitives::inflight::STALE_AFTER_MS); heartbeats are monotonic
//! ([`MonoMillis`]). Reserves follow [`crate::primitives::inflight`].
//!
//! Rationale: docs/design.md, section "Load shedding".

pub mod fair;
pub mod flows;
pub mod lag;
pub mod per_key;
pub mod queue;

use crate::config::{LoadShedding, Name};
use crate::primitives::inflight::{admits, in_flight_units, InFlight, Permit, LocalCount};
use crate::primitives::store::{update, Attempt, SharedStore, StoreError, Stored};
use crate::primitives::time::MonoMillis;

/// The admission threshold of a class: `max(1, ⌊shed_at × max_active_requests⌋)`.
pub fn threshold(shed_at: f64, max_active_requests: u32) -> u32 {
    let scaled = (shed_at * f64::from(max_active_requests)).floor();
    // `shed_at` is validated to (0, 1], so the product fits; clamp anyway.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let value = scaled.clamp(1.0, f64::from(max_active_requests)) as u32;
    value
}

/// A priority class and the in-flight count at which it is shed.
#[derive(Clone, Debug, PartialEq)]
pub struct Class {
    /// The class name (the priority header's value).
    pub name: Name,
    /// Admitted while the in-flight count is below this.
    pub threshold: u32,
}

/// Why a request was shed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shed {
    /// In-flight requests when it was refused.
    pub in_flight: u32,
    /// Index of its class.
    pub class: usize,
    /// True when the shared count could not be updated (CAS attempts ran out).
    pub contention: bool,
}

/// The proxy-wide in-flight limit of one filter instance.
#[derive(Clone, Debug)]
pub struct Shedder {
    key: String,
    /// The configured limit.
    pub max_active_requests: u32,
    /// Priority classes, in configuration order.
    pub classes: Vec<Class>,
    /// Index of the class of requests without (or with an unknown) priority header value.
    pub default_class: usize,
    /// The request header naming the class.
    pub priority_header: String,
    /// `retry-after` of a shed request, in seconds.
    pub retry_after_secs: u64,
    /// The lowest class threshold: reserves are sized on the room below it (0 with a queue:
    /// no reserves).
    lowest_threshold: u32,
}

/// The priority classes of a configuration, and how a request names its class: what both
/// shedding signals (the in-flight count here, the loop lag in [`crate::shedding::lag`]) share.
#[derive(Clone, Debug, PartialEq)]
pub struct Classes {
    /// The class names, in configuration order.
    pub names: Vec<Name>,
    /// Index of the class of requests without (or with an unknown) priority header value.
    pub default_class: usize,
    /// The request header naming the class.
    pub priority_header: String,
}

impl Classes {
    /// The classes of `config`.
    pub fn new(config: &LoadShedding) -> Classes {
        let names: Vec<Name> = config.classes.iter().map(|c| c.name.clone()).collect();
        Classes {
            default_class: names.iter().position(|n| *n == config.default_class).unwrap_or(0),
            names,
            priority_header: config.priority_header.clone(),
        }
    }

    /// The class a priority header value names (the default class for `None` or unknown).
    pub fn class_of(&self, value: Option<&[u8]>) -> usize {
        value
            .and_then(|v| self.names.iter().position(|n| n.as_str().as_bytes() == v))
            .unwrap_or(self.default_class)
    }

    /// The name of class `index` (empty for an unknown index).
    pub fn name(&self, index: usize) -> &str {
        self.names.get(index).map_or("", Name::as_str)
    }
}

impl Shedder {
    /// The in-flight shedder of `config` (`None` without `max_active_requests`: shedding on the
    /// loop lag only), its record under `namespace`.
    pub fn new(config: &LoadShedding, namespace: &str) -> Option<Shedder> {
        let max = config.max_active_requests?.get().get();
        let classes: Vec<Class> = config
            .classes
            .iter()
            .map(|c| Class {
                name: c.name.clone(),
                threshold: threshold(c.shed_at.get(), max),
            })
            .collect();
        let default_class = classes
            .iter()
            .position(|c| c.name == config.default_class)
            .unwrap_or(0);
        // With a queue, no reserves: a unit reserved on one worker could admit a request there
        // ahead of a waiter on another.
        let lowest_threshold = if config.queue.is_some() { 0 } else { classes.iter().map(|c| c.threshold).min().unwrap_or(max) };
        Some(Shedder {
            lowest_threshold,
            key: format!("floodgate/{namespace}/in-flight"),
            max_active_requests: max,
            classes,
            default_class,
            priority_header: config.priority_header.clone(),
            retry_after_secs: config.retry_after.ceil_secs().max(1),
        })
    }

    /// The shared-data key of the in-flight record.
    pub fn record_key(&self) -> &str {
        &self.key
    }

    /// The class a priority header value names (the default class for `None` or unknown).
    pub fn class_of(&self, value: Option<&[u8]>) -> usize {
        value
            .and_then(|v| self.classes.iter().position(|c| c.name.as_str().as_bytes() == v))
            .unwrap_or(self.default_class)
    }

    fn read<S: SharedStore + ?Sized>(&self, store: &S) -> Result<InFlight, StoreError> {
        Ok(record_of(store.get(&self.key)?.as_ref()))
    }

    /// Admits a request of `class` on VM `vm` whose local count is `local`, or sheds it: from
    /// the VM's reserve when it has one, else by a compare-and-swap on the record.
    pub fn try_acquire<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        vm: u64,
        local: &LocalCount,
        class: usize,
        now: MonoMillis,
    ) -> Result<Permit, Shed> {
        let threshold = self.classes.get(class).map_or(0, |c| c.threshold);
        if local.take_reserved(threshold) {
            return Ok(Permit::taken(local));
        }
        let mut last_total = local.in_use();
        let published = update(store, &self.key, |current| {
            let mut record = record_of(current);
            let mine = local.in_use();
            let others = record.others(vm, now);
            last_total = match admits(&record, vm, mine, threshold, now) {
                Ok(total) => total,
                Err(total) => return Attempt::Done(Err(Shed { in_flight: total, class, contention: false })),
            };
            // The reserve is sized on the lowest threshold (≤ this class's), so it never takes
            // the count past any class's: `in_flight_units` stays within `lowest − others`.
            let wanted = in_flight_units(mine.saturating_add(1), others, record.other_vms(vm, now), self.lowest_threshold);
            if !record.publish(vm, wanted, now) {
                return Attempt::Done(Err(Shed { in_flight: last_total, class, contention: true }));
            }
            Attempt::Write(record.encode(), Ok((wanted, others)))
        });
        match published {
            Ok(Ok((wanted, others))) => {
                local.admitted(wanted, others);
                Ok(Permit::taken(local))
            }
            Ok(Err(shed)) => Err(shed),
            Err(_) => Err(Shed { in_flight: last_total, class, contention: true }),
        }
    }

    /// Ends an admitted request: lowers the local count, and publishes it when the VM holds
    /// units it no longer uses (see [`crate::primitives::inflight::Local::idle_surplus`]); if that write loses every race,
    /// the next heartbeat publishes it.
    pub fn release<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        vm: u64,
        mut permit: Permit,
        now: MonoMillis,
    ) {
        permit.end();
        if permit.local.idle_surplus() {
            self.publish(store, vm, &permit.local, now);
        }
    }

    /// Refreshes this VM's entry (on every tick): gives back its reserve and publishes its count
    /// if the record disagrees with it or holds dead entries. Returns the proxy-wide in-flight
    /// count.
    pub fn heartbeat<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        vm: u64,
        local: &LocalCount,
        now: MonoMillis,
    ) -> u32 {
        self.publish(store, vm, local, now)
    }

    /// The proxy-wide in-flight count as this VM sees it (other VMs' reserves included).
    pub fn in_flight<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        vm: u64,
        local: &LocalCount,
        now: MonoMillis,
    ) -> u32 {
        self.read(store).map_or(local.in_use(), |record| {
            record.others(vm, now).saturating_add(local.in_use())
        })
    }

    /// Whether a request of the default class would be shed now (the health endpoint's answer).
    pub fn overloaded(&self, in_flight: u32) -> bool {
        self.classes
            .get(self.default_class)
            .is_some_and(|c| in_flight >= c.threshold)
    }

    /// Writes this VM's count in use (giving back any reserve) into the record when the record
    /// disagrees with it (or holds dead entries); returns the proxy-wide count.
    fn publish<S: SharedStore + ?Sized>(
        &self,
        store: &S,
        vm: u64,
        local: &LocalCount,
        now: MonoMillis,
    ) -> u32 {
        let mut total = local.in_use();
        // Best effort: a write that loses every race is made by the next heartbeat.
        let _ = update(store, &self.key, |current| {
            let mut record = record_of(current);
            let mine = local.in_use();
            let others = record.others(vm, now);
            total = others.saturating_add(mine);
            // Lowering is safe before the write lands: the record holds at least as much.
            local.published(mine, others);
            if !record.needs_heartbeat(vm, mine, now) || (current.is_none() && mine == 0) {
                return Attempt::Done(());
            }
            record.publish(vm, mine, now);
            Attempt::Write(record.encode(), ())
        });
        total
    }
}

/// The in-flight record as read (`None`: absent). A malformed record is not trusted: it is
/// replaced by this VM's view at the next write.
fn record_of(stored: Option<&Stored>) -> InFlight {
    stored.and_then(|s| InFlight::decode(&s.value).ok()).unwrap_or_default()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::primitives::inflight::STALE_AFTER_MS;
    use crate::primitives::record::DecodeError;
    use crate::primitives::inflight::RESERVE_MAX;
    use std::cell::Cell;
    use std::rc::Rc;

    const T0: MonoMillis = MonoMillis(1_700_000_000_000);

    #[test]
    fn thresholds_per_class() {
        assert_eq!(threshold(1.0, 10), 10);
        assert_eq!(threshold(0.9, 10), 9);
        assert_eq!(threshold(0.55, 10), 5);
        assert_eq!(threshold(0.01, 10), 1, "every class gets at least one");
    }

    /// One VM admitting into a record, as the store layer does it.
    fn admit(record: &mut InFlight, vm: u64, local: &mut u32, threshold: u32, now: MonoMillis) -> Result<u32, u32> {
        let total = admits(record, vm, *local, threshold, now)?;
        *local += 1;
        assert!(record.publish(vm, *local, now));
        Ok(total)
    }

    #[test]
    fn admission_at_every_boundary() {
        let mut record = InFlight::default();
        let (mut one, mut two) = (0, 0);
        for i in 0..5 {
            assert_eq!(admit(&mut record, 1, &mut one, 5, T0), Ok(i));
        }
        assert_eq!(admit(&mut record, 2, &mut two, 5, T0), Err(5), "at the threshold: shed");
        assert_eq!(admit(&mut record, 2, &mut two, 4, T0), Err(5), "a lower class is shed earlier");
        assert_eq!(admit(&mut record, 2, &mut two, 6, T0), Ok(5), "a higher class still fits");
        assert_eq!(record.total(T0), 6);
        one -= 1;
        record.publish(1, one, T0);
        assert_eq!(admit(&mut record, 2, &mut two, 6, T0), Ok(5));
    }

    #[test]
    fn releases_bring_the_count_back_to_zero() {
        let mut record = InFlight::default();
        let mut locals = [0u32; 3];
        for (vm, local) in locals.iter_mut().enumerate() {
            for _ in 0..4 {
                admit(&mut record, vm as u64, local, 100, T0).unwrap();
            }
        }
        for vm in [2usize, 0, 1] {
            for _ in 0..4 {
                locals[vm] -= 1;
                record.publish(vm as u64, locals[vm], T0);
            }
        }
        assert_eq!(record.total(T0), 0);
        assert!(record.entries.is_empty(), "idle VMs leave no entry");
    }

    #[test]
    fn a_failed_release_write_is_repaired_by_the_next_heartbeat() {
        let mut record = InFlight::default();
        let mut local = 0;
        admit(&mut record, 1, &mut local, 10, T0).unwrap();
        local -= 1; // the release's write is lost: the record still says 1
        assert_eq!(record.total(T0), 1);
        assert!(record.needs_heartbeat(1, local, T0));
        record.publish(1, local, T0);
        assert_eq!(record.total(T0), 0);
        assert!(!record.needs_heartbeat(1, local, T0));
    }

    #[test]
    fn a_dead_vm_stops_counting_after_the_stale_period() {
        let mut record = InFlight::default();
        let (mut dead, mut alive) = (0, 0);
        for _ in 0..3 {
            admit(&mut record, 7, &mut dead, 10, T0).unwrap(); // VM 7 admits 3, then dies
        }
        admit(&mut record, 8, &mut alive, 10, T0).unwrap();
        let later = T0.plus_ms(STALE_AFTER_MS - 1);
        assert!(record.needs_heartbeat(8, alive, later));
        record.publish(8, alive, later);
        assert_eq!(record.total(later), 4, "still within the stale period");
        let after = T0.plus_ms(STALE_AFTER_MS + 500);
        assert_eq!(record.total(after), 1, "VM 7's streams no longer count");
        assert!(record.needs_heartbeat(8, alive, after));
        record.publish(8, alive, after);
        assert!(record.entries.iter().all(|e| e.vm != 7), "and its entry is gone");
    }

    #[test]
    fn an_idle_vm_need_not_write_a_heartbeat() {
        let record = InFlight::default();
        assert!(!record.needs_heartbeat(1, 0, T0));
        assert!(record.needs_heartbeat(1, 1, T0));
    }

    fn shedder(max: u32) -> Shedder {
        let config = crate::config::Config::parse(
            format!(r#"{{"load_shedding":{{"max_active_requests":{max}}}}}"#).as_bytes(),
        )
        .unwrap();
        Shedder::new(config.load_shedding.as_ref().unwrap(), "t").unwrap()
    }

    #[test]
    fn default_classes_shed_low_first_and_admit_critical_to_the_limit() {
        let shedder = shedder(10);
        let names: Vec<(&str, u32)> = shedder.classes.iter().map(|c| (c.name.as_str(), c.threshold)).collect();
        assert_eq!(names, vec![("critical", 10), ("normal", 9), ("low", 5)]);
        assert_eq!(shedder.class_of(None), 1);
        assert_eq!(shedder.class_of(Some(b"low")), 2);
        assert_eq!(shedder.class_of(Some(b"\xff\xfe")), 1);
    }

    #[test]
    fn two_vms_share_one_exact_count_through_the_store() {
        let store = crate::primitives::store::MemoryStore::new();
        let shedder = shedder(10);
        let (a, b): (LocalCount, LocalCount) = (Rc::default(), Rc::default());
        let mut permits = Vec::new();
        for i in 0..10 {
            let (vm, local) = if i % 2 == 0 { (1, &a) } else { (2, &b) };
            permits.push((vm, shedder.try_acquire(&store, vm, local, 0, T0).unwrap()));
        }
        let shed = shedder.try_acquire(&store, 1, &a, 0, T0).unwrap_err();
        assert_eq!(shed, Shed { in_flight: 10, class: 0, contention: false });
        assert!(shedder.overloaded(shedder.in_flight(&store, 1, &a, T0)));
        let (vm, permit) = permits.pop().unwrap();
        shedder.release(&store, vm, permit, T0);
        assert_eq!(shedder.in_flight(&store, 1, &a, T0), 9);
        assert!(shedder.try_acquire(&store, 1, &a, 2, T0).is_err(), "low sheds at 5");
        permits.push((1, shedder.try_acquire(&store, 1, &a, 0, T0).unwrap()));
        for (vm, permit) in permits {
            shedder.release(&store, vm, permit, T0);
        }
        assert_eq!(shedder.in_flight(&store, 1, &a, T0), 0);
        assert_eq!((a.in_use(), b.in_use()), (0, 0));
    }

    #[test]
    fn a_dropped_lease_is_released_locally_and_published_by_the_heartbeat() {
        let store = crate::primitives::store::MemoryStore::new();
        let shedder = shedder(10);
        let local: LocalCount = Rc::default();
        let permit = shedder.try_acquire(&store, 1, &local, 0, T0).unwrap();
        drop(permit);
        assert_eq!(local.in_use(), 0);
        assert_eq!(
            shedder.in_flight(&store, 2, &Rc::default(), T0),
            local.held(),
            "not yet published"
        );
        assert!(local.held() >= 1);
        shedder.heartbeat(&store, 1, &local, T0);
        assert_eq!(shedder.in_flight(&store, 2, &Rc::default(), T0), 0);
    }

    #[test]
    fn a_released_lease_is_not_released_again_on_drop() {
        let store = crate::primitives::store::MemoryStore::new();
        let shedder = shedder(10);
        let local: LocalCount = Rc::default();
        let first = shedder.try_acquire(&store, 1, &local, 0, T0).unwrap();
        let _second = shedder.try_acquire(&store, 1, &local, 0, T0).unwrap();
        shedder.release(&store, 1, first, T0);
        assert_eq!(local.in_use(), 1);
    }

    #[test]
    fn records_round_trip_and_refuse_corruption() {
        let mut record = InFlight::default();
        record.publish(11, 2, T0);
        record.publish(12, 1, T0);
        let bytes = record.encode();
        assert_eq!(InFlight::decode(&bytes), Ok(record));
        for cut in 0..bytes.len() {
            assert!(InFlight::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut bad = bytes.clone();
        bad[1] = 3;
        assert_eq!(InFlight::decode(&bad), Err(DecodeError::Malformed));
        assert_eq!(InFlight::decode(&[]), Err(DecodeError::Malformed));
        assert_eq!(InFlight::decode(&[1, 0, 0, 0]), Ok(InFlight::default()));
    }

    /// A store that counts its operations.
    #[derive(Default)]
    struct Counting {
        inner: crate::primitives::store::MemoryStore,
        ops: Cell<u32>,
    }

    impl SharedStore for Counting {
        fn get(&self, key: &str) -> Result<Option<crate::primitives::store::Stored>, StoreError> {
            self.ops.set(self.ops.get() + 1);
            self.inner.get(key)
        }
        fn set(
            &self,
            key: &str,
            value: &[u8],
            cas: Option<crate::primitives::store::Cas>,
        ) -> Result<(), StoreError> {
            self.ops.set(self.ops.get() + 1);
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn far_below_the_limit_most_admissions_need_no_shared_data() {
        let store = Counting::default();
        let shedder = shedder(100_000);
        let local: LocalCount = Rc::default();
        let permits: Vec<Permit> = (0..170)
            .map(|_| shedder.try_acquire(&store, 1, &local, 2, T0).unwrap())
            .collect();
        assert_eq!(local.in_use(), 170);
        // One read and one write per RESERVE_MAX + 1 admissions (creating the record takes two more).
        assert_eq!(
            store.ops.get(),
            2 * 10 + 2,
            "{} store operations",
            store.ops.get()
        );
        assert_eq!(
            shedder.in_flight(&store, 2, &Rc::default(), T0),
            170,
            "the reserve counts for other VMs"
        );
        for permit in permits {
            shedder.release(&store, 1, permit, T0);
        }
        let idle = shedder.in_flight(&store, 2, &Rc::default(), T0);
        assert!(idle <= RESERVE_MAX, "at most a reserve stays published ({idle})");
        shedder.heartbeat(&store, 1, &local, T0);
        assert_eq!(shedder.in_flight(&store, 2, &Rc::default(), T0), 0, "the heartbeat gives it back");
    }

    #[test]
    fn reserves_never_let_two_vms_past_the_limit() {
        // Two VMs alternate; whatever they reserve, the critical limit admits exactly max.
        for max in [1, 7, 64, 100, 1_000] {
            let store = crate::primitives::store::MemoryStore::new();
            let shedder = shedder(max);
            let (a, b): (LocalCount, LocalCount) = (Rc::default(), Rc::default());
            let mut admitted = Vec::new();
            for i in 0..(2 * max + 10) {
                let (vm, local) = if i % 3 == 0 { (1, &a) } else { (2, &b) };
                if let Ok(permit) = shedder.try_acquire(&store, vm, local, 0, T0) {
                    admitted.push(permit);
                }
                let published =
                    InFlight::decode(&store.get(shedder.record_key()).unwrap().unwrap().value)
                        .unwrap();
                assert!(
                    published.total(T0) <= max,
                    "max {max}: {} published",
                    published.total(T0)
                );
            }
            assert!(admitted.len() as u32 <= max);
            assert!(
                admitted.len() as u32 + 2 * RESERVE_MAX >= max,
                "max {max}: only {} admitted",
                admitted.len()
            );
        }
    }

    #[test]
    fn the_heartbeat_gives_an_idle_reserve_back() {
        let store = crate::primitives::store::MemoryStore::new();
        let shedder = shedder(100_000);
        let local: LocalCount = Rc::default();
        let permit = shedder.try_acquire(&store, 1, &local, 0, T0).unwrap();
        assert_eq!(local.held(), 1 + RESERVE_MAX);
        assert_eq!(shedder.heartbeat(&store, 1, &local, T0), 1);
        assert_eq!(local.held(), 1);
        assert_eq!(shedder.in_flight(&store, 2, &Rc::default(), T0), 1);
        shedder.release(&store, 1, permit, T0);
    }

    /// A reload lowering `max_active_requests` from 1 000 to 16 while this VM holds
    /// a reserve sized on the old limit let it admit 17 from the reserve. The new threshold is
    /// checked before a reserved unit is used.
    #[test]
    fn a_reserve_is_not_spent_past_a_lowered_limit() {
        let store = crate::primitives::store::MemoryStore::new();
        let local: LocalCount = Rc::default();
        let before = shedder(1_000);
        let mut permits = vec![before.try_acquire(&store, 1, &local, 0, T0).unwrap()];
        assert_eq!(local.held(), 1 + RESERVE_MAX, "a full reserve far below the old limit");
        let after = shedder(16);
        while let Ok(permit) = after.try_acquire(&store, 1, &local, 0, T0) {
            permits.push(permit);
        }
        assert_eq!(permits.len(), 16, "the new limit holds");
        for permit in permits {
            after.release(&store, 1, permit, T0);
        }
        after.heartbeat(&store, 1, &local, T0);
        assert_eq!(after.in_flight(&store, 2, &Rc::default(), T0), 0);
    }

    /// Heartbeats are monotonic-clock readings, so a step of the wall clock (which
    /// the shedder never sees) cannot make a live VM's entry look dead. Both VMs below read the
    /// same monotonic clock, 1 ms apart, whatever the wall clock did meanwhile; the entry of
    /// VM 1 counts for VM 2 until VM 1 has missed heartbeats for `STALE_AFTER_MS`.
    #[test]
    fn entries_expire_on_the_monotonic_clock_only() {
        let store = crate::primitives::store::MemoryStore::new();
        let shedder = shedder(10);
        let (a, b): (LocalCount, LocalCount) = (Rc::default(), Rc::default());
        let permits: Vec<Permit> = (0..10).map(|_| shedder.try_acquire(&store, 1, &a, 0, T0).unwrap()).collect();
        let soon = T0.plus_ms(1);
        assert!(shedder.try_acquire(&store, 2, &b, 0, soon).is_err(), "VM 1 holds all 10");
        let just_live = T0.plus_ms(STALE_AFTER_MS - 1);
        assert!(shedder.try_acquire(&store, 2, &b, 0, just_live).is_err(), "still live");
        shedder.heartbeat(&store, 1, &a, just_live);
        let later = just_live.plus_ms(STALE_AFTER_MS - 1);
        assert!(shedder.try_acquire(&store, 2, &b, 0, later).is_err(), "its heartbeat keeps it live");
        for permit in permits {
            shedder.release(&store, 1, permit, later);
        }
    }
}
