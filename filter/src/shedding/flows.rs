//! Fair shares between flows, proxy-wide: for each priority class with a flow key
//! (`load_shedding.flow`, `load_shedding.classes[].flow`), the shared record of its fair queues
//! ([`FairClass`]), read and changed by compare-and-swap from any worker. The in-flight limit
//! still counts every request ([`super::Shedder`]); a class's fair queues decide which of its
//! requests takes a slot the limit has room for, and which waits or is shed.
//!
//! Invariants: every change to a class's record is one compare-and-swap of the whole record
//! (so a slot is held once, and a waiter is admitted once, whichever worker asks); the record
//! keeps per queue, never per flow, so its size is bounded whatever the number of flows
//! ([`crate::shedding::fair::MAX_RECORD_LEN`]).
//!
//! Rationale: docs/design.md, section "Fair shares between flows".

use super::fair::{Arrival, Claim, FairClass, Limits, Place, Slot};
use super::threshold;
use crate::config::{KeyPart, LoadShedding};
use crate::primitives::store::{update, Attempt, SharedStore, StoreError};
use crate::primitives::time::MonoMillis;

/// One class's fair queues.
#[derive(Clone, Debug)]
pub struct FlowClass {
    key: String,
    limits: Limits,
    /// The request parts that name a request's flow.
    pub flow_key: Vec<KeyPart>,
    target_ms: u64,
    interval_ms: u64,
}

/// A flow's part of its class, for a refusal and the access log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Share {
    /// Slots its queue holds.
    pub held: u32,
    /// Requests waiting in its queue.
    pub waiting: u32,
    /// Flows active in the class (queues holding a slot or a waiter).
    pub flows: u32,
    /// The class's slots.
    pub slots: u32,
}

impl Share {
    /// Its fair share of the class's slots: the slots over the flows active (all of them when
    /// none is).
    pub fn fair_share(&self) -> f64 {
        f64::from(self.slots) / f64::from(self.flows.max(1))
    }

    /// [`Share::fair_share`] to two decimals, as a refusal and the access log show it.
    pub fn fair_share_rounded(&self) -> f64 {
        (self.fair_share() * 100.0).round() / 100.0
    }
}

/// What became of an arriving request, with its flow's share as the class now stands.
#[derive(Debug)]
pub struct Arrived {
    /// The decision.
    pub arrival: Arrival,
    /// How long it may wait if it waits: `max_wait`, or CoDel's `target` when the class's queue
    /// stands and its flow holds the most.
    pub wait_ms: u64,
    /// Its flow's share.
    pub share: Share,
}

/// The classes' fair queues of one filter instance.
#[derive(Clone, Debug, Default)]
pub struct Flows {
    classes: Vec<Option<FlowClass>>,
}

impl Flows {
    /// The fair queues of `config`'s classes that have a flow key (`None` when none has, or
    /// without the queue and in-flight limit they need), their records under `namespace`.
    pub fn new(config: &LoadShedding, namespace: &str) -> Option<Flows> {
        let queue = config.queue.as_ref()?;
        let max = config.max_active_requests?.get().get();
        let classes: Vec<Option<FlowClass>> = (0..config.classes.len())
            .map(|index| {
                let flow = config.flow_of(index)?;
                let class = config.classes.get(index)?;
                let waits = queue.class(config, index);
                let usize_of = |n: u32| usize::try_from(n).unwrap_or(usize::MAX);
                Some(FlowClass {
                    // The number of queues names the record: a configuration with another
                    // number starts a record of its own, and the streams of the one before give
                    // their slots back to theirs.
                    key: format!("floodgate/{namespace}/flows/{}/{}", class.name, flow.queues.get()),
                    limits: Limits::new(
                        usize_of(flow.queues.get().get()),
                        usize_of(flow.hand_size.get().get()),
                        threshold(class.shed_at.get(), max),
                        waits.max_queued,
                        waits.max_wait_ms,
                    ),
                    flow_key: flow.key.clone(),
                    target_ms: queue.target.get().get(),
                    interval_ms: queue.interval.get().get(),
                })
            })
            .collect();
        classes.iter().any(Option::is_some).then_some(Flows { classes })
    }

    /// The fair queues of class `class`, if it has a flow key.
    pub fn class(&self, class: usize) -> Option<&FlowClass> {
        self.classes.get(class).and_then(Option::as_ref)
    }

    /// The classes with a flow key, with their index.
    pub fn iter(&self) -> impl Iterator<Item = (usize, &FlowClass)> {
        self.classes.iter().enumerate().filter_map(|(index, class)| class.as_ref().map(|c| (index, c)))
    }

    /// The shared-data keys of the records.
    pub fn record_keys(&self) -> impl Iterator<Item = &str> {
        self.iter().map(|(_, class)| class.key.as_str())
    }
}

impl FlowClass {
    /// The shared-data key of the class's record.
    pub fn record_key(&self) -> &str {
        &self.key
    }

    /// Its limits.
    pub fn limits(&self) -> Limits {
        self.limits
    }

    /// The record as it is now (an idle class when absent or unreadable).
    pub fn read<S: SharedStore + ?Sized>(&self, store: &S) -> FairClass {
        let stored = store.get(&self.key).ok().flatten();
        stored.and_then(|s| FairClass::decode(&s.value, self.limits).ok()).unwrap_or_else(|| FairClass::new(self.limits))
    }

    /// One decision on the record, written by compare-and-swap (decided again on the record
    /// read anew when another worker wrote first).
    fn decide<S: SharedStore + ?Sized, T>(&self, store: &S, mut decide: impl FnMut(&mut FairClass) -> T) -> Result<T, StoreError> {
        update(store, &self.key, |stored| {
            let mut class = stored.and_then(|s| FairClass::decode(&s.value, self.limits).ok()).unwrap_or_else(|| FairClass::new(self.limits));
            let answer = decide(&mut class);
            Attempt::Write(class.encode(), answer)
        })
    }

    /// A request of the flow of hash `flow_hash` arrives at `now`; with `may_go` false, the
    /// proxy has no room for it now, and it waits (or is shed) whatever its class holds.
    pub fn arrive<S: SharedStore + ?Sized>(&self, store: &S, flow_hash: u64, may_go: bool, now: MonoMillis) -> Result<Arrived, StoreError> {
        self.decide(store, |class| {
            let arrival = if may_go { class.arrive(flow_hash, now) } else { class.arrive_to_wait(flow_hash, now) };
            let queue = match &arrival {
                Arrival::Admitted(slot) => slot.queue(),
                Arrival::Queued(place) | Arrival::Shed(super::fair::Victim::Waiter { place, .. }) => place.queue,
                Arrival::Shed(super::fair::Victim::Arrival) => class.queue_of(flow_hash),
            };
            let codel = class.standing(self.interval_ms, now) && class.holder_of_most() == Some(queue);
            let wait_ms = if codel { self.target_ms.min(self.limits.max_wait_ms()) } else { self.limits.max_wait_ms() };
            Arrived { arrival, wait_ms, share: share_of(class, queue) }
        })
    }

    /// In shadow: the request takes a slot of its flow's queue whatever the class holds; the
    /// answer says whether it would have gone on at once, and its flow's share.
    pub fn arrive_in_shadow<S: SharedStore + ?Sized>(&self, store: &S, flow_hash: u64, now: MonoMillis) -> Result<(Slot, bool, Share), StoreError> {
        self.decide(store, |class| {
            let (slot, due) = class.arrive_in_shadow(flow_hash, now);
            let share = share_of(class, slot.queue());
            (slot, due, share)
        })
    }

    /// The waiter at `place` takes the slot due to it, if one is.
    pub fn claim<S: SharedStore + ?Sized>(&self, store: &S, place: Place, now: MonoMillis) -> Result<Claim, StoreError> {
        self.decide(store, |class| class.claim(place, now))
    }

    /// The waiter at `place` leaves (its wait ended, or its client went away).
    pub fn abandon<S: SharedStore + ?Sized>(&self, store: &S, place: Place) {
        // Best effort: a waiter no write removes is dropped when it has waited `max_wait`.
        let _ = self.decide(store, |class| class.abandon(place));
    }

    /// Gives `slot` back at `now`. A release whose every write loses its race is lost: the
    /// class counts a slot too many until the proxy's record is reset, so it errs on the safe
    /// side.
    pub fn release<S: SharedStore + ?Sized>(&self, store: &S, slot: &Slot, now: MonoMillis) {
        let _ = self.decide(store, |class| class.release(slot, now));
    }

    /// Slots the record holds beyond `in_flight`, the proxy-wide in-flight count (which counts
    /// every request holding a slot, and is given back after its slot): `excess_before` is what
    /// the last heartbeat found. Slots held beyond it at two heartbeats in a row were never
    /// given back (their worker is gone): forgets as many as both found, so they do not hold
    /// the class's capacity for ever, while a release between its two writes on another worker
    /// is left alone. `record` is the record as just read. Returns the excess found now.
    pub fn forget_beyond<S: SharedStore + ?Sized>(&self, store: &S, record: &FairClass, in_flight: u32, excess_before: u32) -> u32 {
        let excess = record.held().saturating_sub(in_flight);
        let lost = excess.min(excess_before);
        if lost > 0 {
            // Never below the in-flight count: another worker's heartbeat may have forgotten
            // the same slots already.
            let _ = self.decide(store, |class| class.forget_beyond(class.held().saturating_sub(lost).max(in_flight)));
        }
        excess
    }

    /// The flow's share of the queue at `queue` as the record stands (for a waiter shed).
    pub fn share<S: SharedStore + ?Sized>(&self, store: &S, queue: usize) -> Share {
        share_of(&self.read(store), queue)
    }
}

/// The share of the flow of the queue at `queue` in `class`.
pub fn share_of(class: &FairClass, queue: usize) -> Share {
    let (held, waiting) = class.queues().get(queue).map_or((0, 0), |q| (q.held(), u32::try_from(q.waiting()).unwrap_or(u32::MAX)));
    Share {
        held,
        waiting,
        flows: u32::try_from(class.flows()).unwrap_or(u32::MAX),
        slots: class.limits().max_active(),
    }
}
