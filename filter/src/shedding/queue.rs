//! Load leveling: a request the in-flight limit would shed waits for a slot instead, in a
//! bounded queue per priority class, for a bounded time ([`Leveler`]). The queue is proxy-wide:
//! one shared record ([`Waiting`]) holds, per class, the next ticket and since when the class's
//! queue has not been empty, and per VM, with a heartbeat, how many of the class's tickets it
//! holds and its first and last. Each VM keeps its own tickets in memory ([`LocalWaiters`], the
//! truth for that VM, which its entry mirrors).
//!
//! Order: a free slot goes to the class of the highest threshold with a live waiter (the
//! configuration's order among equals), and within it to the lowest ticket (first come, first
//! served), or, once that class's queue has not been empty for `interval`, to the highest
//! (adaptive LIFO). Only the VM holding that ticket takes the slot; a request that finds a
//! waiter in its class or a class ranked above waits behind it, so no request passes a waiter
//! that was queued before it looked. A request that joins a queue standing for `interval` waits
//! at most `target` (CoDel's target and interval, as Facebook's "Fail at Scale" applies them to
//! a server's queue), so a standing queue drains instead of adding its delay to every request.
//!
//! Invariants: the record changes only by compare-and-swap; a ticket is counted in the record
//! before its request waits, and `max_queued` is checked in the same write; a VM whose
//! heartbeat is older than [`STALE_AFTER_MS`] holds no waiters, so a dead VM's tickets block no
//! one; a VM's entry is rewritten at each change of its tickets (and at its heartbeat should
//! that write fail), so the queue returns to empty when its waiters are gone.
//!
//! Record layout (little-endian): version `u8`, class count `u8`, entry count `u8`, a zero byte;
//! per class its next ticket `u64` and since when it is non-empty (monotonic ms, 0: empty)
//! `u64`; per entry its VM id `u64`, heartbeat (monotonic ms) `u64`, and per class the count
//! `u32`, first ticket `u64` and last ticket `u64`.
//!
//! Rationale: docs/design.md, section "Load leveling".

use crate::config::{LoadShedding, QueueOrder};
use crate::primitives::inflight::{HEARTBEAT_MS, MAX_VMS, STALE_AFTER_MS};
use crate::primitives::record::{DecodeError, Reader, Writer};
use crate::primitives::store::{update, Attempt, SharedStore, Stored};
use crate::primitives::time::MonoMillis;
use crate::shedding::threshold;
use std::collections::BTreeSet;

const RECORD_VERSION: u8 = 1;

/// One VM's tickets of one class, as its entry publishes them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Span {
    /// Tickets held.
    pub count: u32,
    /// The lowest.
    pub first: u64,
    /// The highest.
    pub last: u64,
}

/// One VM's waiters.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VmWaiters {
    /// The VM's random id.
    pub vm: u64,
    /// When it last wrote its entry.
    pub heartbeat: MonoMillis,
    /// Per class.
    pub spans: Vec<Span>,
}

/// One class's line, proxy-wide.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Line {
    /// The ticket the next waiter takes.
    pub next_ticket: u64,
    /// Since when the class's queue has not been empty (`None`: it is empty).
    pub since: Option<MonoMillis>,
}

/// The proxy-wide queue record.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Waiting {
    /// Per class.
    pub lines: Vec<Line>,
    /// Per VM with waiters.
    pub entries: Vec<VmWaiters>,
}

fn is_live(entry: &VmWaiters, now: MonoMillis) -> bool {
    now.saturating_since(entry.heartbeat) < STALE_AFTER_MS && entry.heartbeat.saturating_since(now) < STALE_AFTER_MS
}

impl Waiting {
    /// An empty record of `classes` classes.
    fn empty(classes: usize) -> Waiting {
        Waiting { lines: vec![Line::default(); classes], entries: Vec::new() }
    }

    /// Reads a record, refusing anything malformed.
    pub fn decode(bytes: &[u8]) -> Result<Waiting, DecodeError> {
        let mut reader = Reader::new(bytes);
        let [version, classes, count, _] = reader.array::<4>()?;
        let (classes, count) = (usize::from(classes), usize::from(count));
        let entry_len = 16usize.saturating_add(classes.saturating_mul(20));
        let expected = classes.saturating_mul(16).saturating_add(count.saturating_mul(entry_len));
        if version != RECORD_VERSION || reader.remaining() != expected {
            return Err(DecodeError::Malformed);
        }
        let mut lines = Vec::with_capacity(classes);
        for _ in 0..classes {
            let next_ticket = reader.u64()?;
            let since = reader.u64()?;
            lines.push(Line { next_ticket, since: (since != 0).then_some(MonoMillis(since)) });
        }
        let mut entries = Vec::with_capacity(count);
        for _ in 0..count {
            let vm = reader.u64()?;
            let heartbeat = MonoMillis(reader.u64()?);
            let mut spans = Vec::with_capacity(classes);
            for _ in 0..classes {
                spans.push(Span { count: reader.u32()?, first: reader.u64()?, last: reader.u64()? });
            }
            entries.push(VmWaiters { vm, heartbeat, spans });
        }
        Ok(Waiting { lines, entries })
    }

    /// Writes the record.
    pub fn encode(&self) -> Vec<u8> {
        let classes = self.lines.len().min(usize::from(u8::MAX));
        let count = self.entries.len().min(MAX_VMS);
        let mut out = Vec::new();
        out.put(&[RECORD_VERSION, u8::try_from(classes).unwrap_or(u8::MAX), u8::try_from(count).unwrap_or(u8::MAX), 0]);
        for line in self.lines.iter().take(classes) {
            out.put_u64(line.next_ticket);
            out.put_u64(line.since.map_or(0, |s| s.0.max(1)));
        }
        for entry in self.entries.iter().take(count) {
            out.put_u64(entry.vm);
            out.put_u64(entry.heartbeat.0);
            for index in 0..classes {
                let span = entry.spans.get(index).copied().unwrap_or_default();
                out.put_u32(span.count);
                out.put_u64(span.first);
                out.put_u64(span.last);
            }
        }
        out
    }

    /// Waiters of `class` on live VMs.
    pub fn live_count(&self, class: usize, now: MonoMillis) -> u32 {
        self.entries
            .iter()
            .filter(|e| is_live(e, now))
            .filter_map(|e| e.spans.get(class))
            .fold(0u32, |sum, s| sum.saturating_add(s.count))
    }

    /// Whether `class`'s queue has stood (not been empty) for `interval_ms` by `now`.
    pub fn standing(&self, class: usize, interval_ms: u64, now: MonoMillis) -> bool {
        self.lines.get(class).and_then(|l| l.since).is_some_and(|since| now.saturating_since(since) >= interval_ms)
    }

    /// The live VM holding the ticket `class`'s next slot goes to, and the ticket: the lowest,
    /// or with `newest_first` the highest.
    pub fn head(&self, class: usize, newest_first: bool, now: MonoMillis) -> Option<(u64, u64)> {
        let holders = self
            .entries
            .iter()
            .filter(|e| is_live(e, now))
            .filter_map(|e| e.spans.get(class).filter(|s| s.count > 0).map(|s| (e.vm, s)));
        if newest_first {
            holders.max_by_key(|(_, s)| s.last).map(|(vm, s)| (vm, s.last))
        } else {
            holders.min_by_key(|(_, s)| s.first).map(|(vm, s)| (vm, s.first))
        }
    }

    /// Publishes `vm`'s tickets as of `now` (`spans`, one per class): drops dead and empty
    /// entries of other VMs, sets (or, with no tickets, removes) `vm`'s, and notes since when
    /// each class is non-empty. Returns false if there was no room for the entry.
    fn publish(&mut self, vm: u64, spans: Vec<Span>, now: MonoMillis) -> bool {
        self.entries.retain(|e| e.vm != vm && is_live(e, now) && e.spans.iter().any(|s| s.count > 0));
        let mut fits = true;
        if spans.iter().any(|s| s.count > 0) {
            if self.entries.len() >= MAX_VMS {
                fits = false;
            } else {
                self.entries.push(VmWaiters { vm, heartbeat: now, spans });
            }
        }
        for class in 0..self.lines.len() {
            let waiting = self.live_count(class, now) > 0;
            if let Some(line) = self.lines.get_mut(class) {
                line.since = match (waiting, line.since) {
                    (false, _) => None,
                    (true, None) => Some(now),
                    (true, since) => since,
                };
            }
        }
        fits
    }

    /// Whether `vm`'s entry would change with `spans` (or heartbeat), or dead entries need
    /// dropping.
    fn needs_heartbeat(&self, vm: u64, spans: &[Span], now: MonoMillis) -> bool {
        let own = self.entries.iter().find(|e| e.vm == vm);
        let current = match own {
            Some(e) => e.spans == spans && now.saturating_since(e.heartbeat) < HEARTBEAT_MS,
            None => spans.iter().all(|s| s.count == 0),
        };
        !current || self.entries.iter().any(|e| !is_live(e, now))
    }
}

/// This VM's tickets, per class: the truth its entry in the record mirrors.
#[derive(Clone, Debug, Default)]
pub struct LocalWaiters {
    tickets: Vec<BTreeSet<u64>>,
}

impl LocalWaiters {
    /// Requests of this VM waiting, every class.
    pub fn len(&self) -> usize {
        self.tickets.iter().map(BTreeSet::len).sum()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.tickets.iter().all(BTreeSet::is_empty)
    }

    /// Whether `ticket` of `class` is this VM's.
    pub fn holds(&self, class: usize, ticket: u64) -> bool {
        self.tickets.get(class).is_some_and(|t| t.contains(&ticket))
    }

    fn insert(&mut self, class: usize, ticket: u64) {
        if self.tickets.len() <= class {
            self.tickets.resize_with(class.saturating_add(1), BTreeSet::new);
        }
        if let Some(tickets) = self.tickets.get_mut(class) {
            tickets.insert(ticket);
        }
    }

    fn remove(&mut self, class: usize, ticket: u64) -> bool {
        self.tickets.get_mut(class).is_some_and(|t| t.remove(&ticket))
    }

    /// The entry's spans for `classes` classes, with `extra` (a class and ticket being added).
    fn spans(&self, classes: usize, extra: Option<(usize, u64)>) -> Vec<Span> {
        (0..classes)
            .map(|class| {
                let own = self.tickets.get(class);
                let added = extra.filter(|(c, _)| *c == class).map(|(_, t)| t);
                let count = own.map_or(0, BTreeSet::len).saturating_add(usize::from(added.is_some()));
                let first = own.and_then(|t| t.first().copied()).into_iter().chain(added).min().unwrap_or(0);
                let last = own.and_then(|t| t.last().copied()).into_iter().chain(added).max().unwrap_or(0);
                Span { count: u32::try_from(count).unwrap_or(u32::MAX), first, last }
            })
            .collect()
    }
}

/// A waiter's place: its class and ticket, and how long it may wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Ticket {
    /// Its class.
    pub class: usize,
    /// Its ticket in the class.
    pub ticket: u64,
    /// How long it may wait, ms: `max_wait`, or `target` when it joined a standing queue.
    pub wait_ms: u64,
}

/// Why a request could not wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoRoom {
    /// Its class already has `max_queued` waiting.
    Full {
        /// Waiting in its class.
        queued: u32,
    },
    /// The record could not be updated (CAS attempts ran out, or no room for this VM's entry).
    Contention,
}

/// The proxy-wide queue of one filter instance.
#[derive(Clone, Debug)]
pub struct Leveler {
    key: String,
    /// Per class: waiters at most, and the longest wait (ms).
    limits: Vec<(u32, u64)>,
    /// Per class: the classes whose waiters come first or alongside (a threshold at least
    /// its own), itself included.
    ahead: Vec<Vec<usize>>,
    /// The classes, in the order free slots go to them.
    by_rank: Vec<usize>,
    order: QueueOrder,
    target_ms: u64,
    interval_ms: u64,
}

impl Leveler {
    /// The queue of `config` (`None` without `queue` or `max_active_requests`), its record under
    /// `namespace`.
    pub fn new(config: &LoadShedding, namespace: &str) -> Option<Leveler> {
        let queue = config.queue.as_ref()?;
        let max = config.max_active_requests?.get().get();
        let thresholds: Vec<u32> = config.classes.iter().map(|c| threshold(c.shed_at.get(), max)).collect();
        let mut by_rank: Vec<usize> = (0..thresholds.len()).collect();
        by_rank.sort_by_key(|c| std::cmp::Reverse(thresholds.get(*c).copied().unwrap_or(0)));
        let ahead = thresholds
            .iter()
            .map(|own| thresholds.iter().enumerate().filter(|(_, t)| *t >= own).map(|(c, _)| c).collect())
            .collect();
        Some(Leveler {
            key: format!("floodgate/{namespace}/queue"),
            limits: (0..config.classes.len())
                .map(|c| {
                    let limits = queue.class(config, c);
                    (limits.max_queued, limits.max_wait_ms)
                })
                .collect(),
            ahead,
            by_rank,
            order: queue.order,
            target_ms: queue.target.get().get(),
            interval_ms: queue.interval.get().get(),
        })
    }

    /// The shared-data key of the record.
    pub fn record_key(&self) -> &str {
        &self.key
    }

    fn classes(&self) -> usize {
        self.limits.len()
    }

    fn record_of(&self, stored: Option<&Stored>) -> Waiting {
        stored
            .and_then(|s| Waiting::decode(&s.value).ok())
            .filter(|w| w.lines.len() == self.classes())
            .unwrap_or_else(|| Waiting::empty(self.classes()))
    }

    /// The record as it is now (empty when absent or unreadable).
    pub fn read<S: SharedStore + ?Sized>(&self, store: &S) -> Waiting {
        let stored = store.get(&self.key).ok().flatten();
        self.record_of(stored.as_ref())
    }

    /// Requests waiting now, proxy-wide (every class, on live VMs).
    pub fn waiting<S: SharedStore + ?Sized>(&self, store: &S, now: MonoMillis) -> u32 {
        let record = self.read(store);
        (0..self.classes()).fold(0u32, |sum, class| sum.saturating_add(record.live_count(class, now)))
    }

    /// The classes whose waiters come before or alongside a request of `class` (a threshold at
    /// least its own), itself included.
    pub fn ahead(&self, class: usize) -> &[usize] {
        self.ahead.get(class).map_or(&[], Vec::as_slice)
    }

    /// Whether a request of `class` must wait behind a waiter (of its class, or of a class
    /// whose threshold is at least its own) even if a slot is free.
    pub fn must_wait<S: SharedStore + ?Sized>(&self, store: &S, class: usize, now: MonoMillis) -> bool {
        let record = self.read(store);
        self.ahead.get(class).is_some_and(|ahead| ahead.iter().any(|c| record.live_count(*c, now) > 0))
    }

    /// Takes a ticket of `class` for a request of VM `vm` (whose tickets are `local`), if the
    /// class has fewer than `max_queued` waiting.
    pub fn enter<S: SharedStore + ?Sized>(&self, store: &S, vm: u64, local: &mut LocalWaiters, class: usize, now: MonoMillis) -> Result<Ticket, NoRoom> {
        let (max_queued, max_wait_ms) = self.limits.get(class).copied().unwrap_or((0, 0));
        let classes = self.classes();
        let entered = update(store, &self.key, |current| {
            let mut record = self.record_of(current);
            let queued = record.live_count(class, now);
            if queued >= max_queued {
                return Attempt::Done(Err(NoRoom::Full { queued }));
            }
            let standing = record.standing(class, self.interval_ms, now);
            let Some(line) = record.lines.get_mut(class) else { return Attempt::Done(Err(NoRoom::Contention)) };
            let ticket = line.next_ticket;
            line.next_ticket = ticket.wrapping_add(1);
            if !record.publish(vm, local.spans(classes, Some((class, ticket))), now) {
                return Attempt::Done(Err(NoRoom::Contention));
            }
            let wait_ms = if standing { self.target_ms.min(max_wait_ms) } else { max_wait_ms };
            Attempt::Write(record.encode(), Ok(Ticket { class, ticket, wait_ms }))
        });
        match entered {
            Ok(Ok(ticket)) => {
                local.insert(class, ticket.ticket);
                Ok(ticket)
            }
            Ok(Err(no_room)) => Err(no_room),
            Err(_) => Err(NoRoom::Contention),
        }
    }

    /// A waiter leaves the queue (admitted, timed out, or gone): its ticket is removed and this
    /// VM's entry rewritten (should that write lose every race, the next heartbeat makes it).
    pub fn leave<S: SharedStore + ?Sized>(&self, store: &S, vm: u64, local: &mut LocalWaiters, class: usize, ticket: u64, now: MonoMillis) {
        if local.remove(class, ticket) {
            self.publish(store, vm, local, now);
        }
    }

    /// The ticket of this VM's that the next free slot goes to, if the next slot goes to this
    /// VM: the head of the first class, in rank order, that has live waiters.
    pub fn next_up<S: SharedStore + ?Sized>(&self, store: &S, vm: u64, local: &LocalWaiters, now: MonoMillis) -> Option<(usize, u64)> {
        if local.is_empty() {
            return None;
        }
        let record = self.read(store);
        let class = self.by_rank.iter().copied().find(|c| record.live_count(*c, now) > 0)?;
        let newest_first = self.order == QueueOrder::AdaptiveLifo && record.standing(class, self.interval_ms, now);
        let (holder, ticket) = record.head(class, newest_first, now)?;
        (holder == vm && local.holds(class, ticket)).then_some((class, ticket))
    }

    /// Refreshes this VM's entry (every heartbeat) when the record disagrees with `local` or
    /// holds dead entries.
    pub fn heartbeat<S: SharedStore + ?Sized>(&self, store: &S, vm: u64, local: &LocalWaiters, now: MonoMillis) {
        self.publish(store, vm, local, now);
    }

    fn publish<S: SharedStore + ?Sized>(&self, store: &S, vm: u64, local: &LocalWaiters, now: MonoMillis) {
        let spans = local.spans(self.classes(), None);
        // Best effort: a write that loses every race is made by the next heartbeat.
        let _ = update(store, &self.key, |current| {
            let mut record = self.record_of(current);
            if !record.needs_heartbeat(vm, &spans, now) || (current.is_none() && local.is_empty()) {
                return Attempt::Done(());
            }
            record.publish(vm, spans.clone(), now);
            Attempt::Write(record.encode(), ())
        });
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::primitives::store::MemoryStore;

    const T0: MonoMillis = MonoMillis(1_700_000_000_000);

    fn leveler(queue: &str) -> Leveler {
        let config = crate::config::Config::parse(
            format!(r#"{{"load_shedding":{{"max_active_requests":10,"queue":{queue}}}}}"#).as_bytes(),
        )
        .unwrap();
        Leveler::new(config.load_shedding.as_ref().unwrap(), "t").unwrap()
    }

    #[test]
    fn records_round_trip_and_refuse_corruption() {
        let mut record = Waiting::empty(3);
        record.lines[1].next_ticket = 7;
        assert!(record.publish(5, vec![Span::default(), Span { count: 2, first: 3, last: 6 }, Span::default()], T0));
        let bytes = record.encode();
        assert_eq!(Waiting::decode(&bytes), Ok(record.clone()));
        assert_eq!(record.lines[1].since, Some(T0));
        for cut in 0..bytes.len() {
            assert!(Waiting::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }

    #[test]
    fn tickets_are_served_in_order_across_two_vms_and_the_queue_bound_holds() {
        let store = MemoryStore::new();
        let queue = leveler(r#"{"max_queued":3,"max_wait":"1s","order":"fifo"}"#);
        let (mut a, mut b) = (LocalWaiters::default(), LocalWaiters::default());
        let first = queue.enter(&store, 1, &mut a, 1, T0).unwrap();
        let second = queue.enter(&store, 2, &mut b, 1, T0).unwrap();
        let third = queue.enter(&store, 1, &mut a, 1, T0).unwrap();
        assert_eq!((first.ticket, second.ticket, third.ticket), (0, 1, 2));
        assert_eq!(first.wait_ms, 1000);
        assert_eq!(queue.enter(&store, 2, &mut b, 1, T0), Err(NoRoom::Full { queued: 3 }));
        assert!(queue.must_wait(&store, 1, T0), "a newcomer of the class waits behind them");
        assert!(queue.must_wait(&store, 2, T0), "so does one of a lower class");
        assert!(!queue.must_wait(&store, 0, T0), "a higher class does not");
        assert_eq!(queue.next_up(&store, 1, &a, T0), Some((1, 0)));
        assert_eq!(queue.next_up(&store, 2, &b, T0), None, "VM 2's ticket is not next");
        queue.leave(&store, 1, &mut a, 1, 0, T0);
        assert_eq!(queue.next_up(&store, 1, &a, T0), None);
        assert_eq!(queue.next_up(&store, 2, &b, T0), Some((1, 1)));
        queue.leave(&store, 2, &mut b, 1, 1, T0);
        queue.leave(&store, 1, &mut a, 1, 2, T0);
        let record = queue.read(&store);
        assert_eq!((record.live_count(1, T0), record.lines[1].since), (0, None));
        assert!(record.entries.is_empty(), "an empty queue leaves no entry");
    }

    #[test]
    fn a_higher_class_goes_first_and_a_standing_queue_turns_lifo_with_the_target_wait() {
        let store = MemoryStore::new();
        let queue = leveler(r#"{"max_queued":10,"max_wait":"2s","target":"20ms","interval":"100ms"}"#);
        let mut a = LocalWaiters::default();
        for _ in 0..3 {
            queue.enter(&store, 1, &mut a, 2, T0).unwrap();
        }
        let critical = queue.enter(&store, 1, &mut a, 0, T0.plus_ms(1)).unwrap();
        assert_eq!(queue.next_up(&store, 1, &a, T0.plus_ms(2)), Some((0, critical.ticket)));
        queue.leave(&store, 1, &mut a, 0, critical.ticket, T0.plus_ms(2));
        assert_eq!(queue.next_up(&store, 1, &a, T0.plus_ms(50)), Some((2, 0)), "young: first come first served");
        let late = queue.enter(&store, 1, &mut a, 2, T0.plus_ms(100)).unwrap();
        assert_eq!(late.wait_ms, 20, "joined a queue standing for the interval: the target");
        assert_eq!(queue.next_up(&store, 1, &a, T0.plus_ms(100)), Some((2, late.ticket)), "standing: newest first");
    }

    #[test]
    fn a_dead_vm_blocks_no_one_after_the_stale_period() {
        let store = MemoryStore::new();
        let queue = leveler(r#"{"max_queued":2,"max_wait":"1s"}"#);
        let (mut dead, mut alive) = (LocalWaiters::default(), LocalWaiters::default());
        queue.enter(&store, 7, &mut dead, 1, T0).unwrap();
        queue.enter(&store, 7, &mut dead, 1, T0).unwrap();
        assert!(matches!(queue.enter(&store, 8, &mut alive, 1, T0), Err(NoRoom::Full { .. })));
        let later = T0.plus_ms(STALE_AFTER_MS);
        let ticket = queue.enter(&store, 8, &mut alive, 1, later).unwrap();
        assert_eq!(queue.next_up(&store, 8, &alive, later), Some((1, ticket.ticket)));
        assert!(queue.read(&store).entries.iter().all(|e| e.vm != 7), "and its entry is gone");
    }
}
