//! The queue stage (load leveling, [`crate::shedding::queue`]): a request the in-flight limit
//! would shed takes a ticket and is parked here until a slot is its, or its wait ends. The
//! root's tick ([`TICK_MS`], only with `load_shedding.queue`) first ends the waits that are
//! over (their requests get the shed `503`), then, while the next slot goes to one of this
//! VM's tickets and the in-flight count has room for its class, takes the slot for that
//! request; the host then resumes each from its own context ([`super::Waiting::Slot`]). A
//! stream that ends while it waits leaves the queue ([`super::Stream::end`]).
//!
//! Nothing here calls the host.

use super::stats::{self, increment, Stats};
use super::{Clock, Env, Host, SharedStream, Shedding};
use crate::primitives::time::MonoMillis;
use crate::shedding::queue::{Leveler, LocalWaiters, NoRoom, Ticket};
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};

/// The tick period with a queue, ms: a free slot reaches its waiter, and a wait ends, at most
/// this late (plus the event loop's own lateness).
pub const TICK_MS: u64 = 10;

/// A request waiting for a slot (kept in its stream's state).
#[derive(Clone, Debug)]
pub struct Queued {
    /// Its place.
    pub ticket: Ticket,
    /// When it started to wait.
    pub since: MonoMillis,
    /// When its wait ends.
    pub until: MonoMillis,
    /// Whether the request headers ended the request.
    pub end_of_stream: bool,
    /// Request body seen while waiting: bytes, and whether it ended.
    pub body: (usize, bool),
    /// Its wait is over: a slot (its in-flight permit is in the stream) or not.
    pub ready: Option<Ready>,
}

/// How a wait ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ready {
    /// It has a slot.
    Admitted,
    /// Its time ran out.
    Expired,
}

/// A parked stream: its context, when its wait ends, its state.
type Parked = (u32, MonoMillis, SharedStream);

/// This VM's waiters under one configuration.
pub struct QueueStage {
    /// The proxy-wide queue.
    pub leveler: Leveler,
    local: RefCell<LocalWaiters>,
    /// By (class, ticket): the stream and when its wait ends.
    parked: RefCell<HashMap<(usize, u64), Parked>>,
    /// (end of wait, class, ticket), in that order.
    deadlines: RefCell<BTreeSet<(MonoMillis, usize, u64)>>,
}

impl QueueStage {
    /// The stage of `leveler`.
    pub fn new(leveler: Leveler) -> QueueStage {
        QueueStage { leveler, local: RefCell::default(), parked: RefCell::default(), deadlines: RefCell::default() }
    }

    /// Whether a request of `class` must wait behind a waiter even if a slot is free.
    pub fn must_wait<H: Host>(&self, env: &Env<'_, H>, class: usize, now: MonoMillis) -> bool {
        self.leveler.must_wait(env.store, class, now)
    }

    /// Requests waiting now, proxy-wide.
    pub fn waiting<H: Host>(&self, env: &Env<'_, H>, now: MonoMillis) -> u32 {
        self.leveler.waiting(env.store, now)
    }

    /// A request of `class` takes a ticket (`Err`: it cannot wait).
    pub fn enter<H: Host>(&self, stats: &Stats, env: &Env<'_, H>, class: usize, end_of_stream: bool, now: MonoMillis) -> Result<Queued, NoRoom> {
        let ticket = self.leveler.enter(env.store, env.vm, &mut self.local.borrow_mut(), class, now)?;
        increment(env.metrics, stats.class(class).queued);
        stats::add(env.metrics, stats.shedding.queue_length, 1);
        Ok(Queued { ticket, since: now, until: now.plus_ms(ticket.wait_ms), end_of_stream, body: (0, false), ready: None })
    }

    /// Parks the stream `context` of a request that took `queued`'s ticket.
    pub fn park(&self, queued: &Queued, context: u32, shared: SharedStream) {
        let Ticket { class, ticket, .. } = queued.ticket;
        self.parked.borrow_mut().insert((class, ticket), (context, queued.until, shared));
        self.deadlines.borrow_mut().insert((queued.until, class, ticket));
    }

    /// Streams waiting on this VM.
    pub fn len(&self) -> usize {
        self.parked.borrow().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.parked.borrow().is_empty()
    }

    /// Takes `(class, ticket)` off this VM's queue: the ticket leaves the record and the stream
    /// is unparked (returned).
    fn take<H: Host>(&self, stats: &Stats, env: &Env<'_, H>, class: usize, ticket: u64, now: MonoMillis) -> Option<(u32, SharedStream)> {
        self.leveler.leave(env.store, env.vm, &mut self.local.borrow_mut(), class, ticket, now);
        let (context, until, shared) = self.parked.borrow_mut().remove(&(class, ticket))?;
        self.deadlines.borrow_mut().remove(&(until, class, ticket));
        stats::add(env.metrics, stats.shedding.queue_length, -1);
        Some((context, shared))
    }

    /// A waiting stream ended (its client hung up, reset, or timed out): its ticket leaves.
    pub fn abandon<H: Host>(&self, stats: &Stats, env: &Env<'_, H>, queued: &Queued) {
        let now = env.clock.now().mono;
        let Ticket { class, ticket, .. } = queued.ticket;
        if self.take(stats, env, class, ticket, now).is_some() {
            increment(env.metrics, stats.class(class).abandoned);
        }
    }

    /// The root's tick: the waits that are over end, then the free slots that are this VM's
    /// (under `shedding`'s in-flight limit) go to its waiters, in order. Returns the streams to
    /// resume, each marked [`Ready`].
    pub fn tick<H: Host>(&self, shedding: &Shedding, stats: &Stats, env: &Env<'_, H>) -> Vec<(u32, SharedStream)> {
        if self.is_empty() {
            return Vec::new();
        }
        let now = env.clock.now().mono;
        let mut ready = Vec::new();
        let expired: Vec<(MonoMillis, usize, u64)> = {
            let mut deadlines = self.deadlines.borrow_mut();
            let later = deadlines.split_off(&(now.plus_ms(1), 0, 0));
            std::mem::replace(&mut *deadlines, later).into_iter().collect()
        };
        for (_, class, ticket) in expired {
            if let Some((context, shared)) = self.take(stats, env, class, ticket, now) {
                increment(env.metrics, stats.class(class).timed_out);
                mark(&shared, Ready::Expired, None);
                ready.push((context, shared));
            }
        }
        let Some(shedder) = shedding.shedder.as_ref() else { return ready };
        loop {
            let next = self.leveler.next_up(env.store, env.vm, &self.local.borrow(), now);
            let Some((class, ticket)) = next else { break };
            let Ok(permit) = shedder.try_acquire(env.store, env.vm, &shedding.local, class, now) else { break };
            match self.take(stats, env, class, ticket, now) {
                Some((context, shared)) => {
                    increment(env.metrics, stats.class(class).dequeued);
                    mark(&shared, Ready::Admitted, Some(permit));
                    ready.push((context, shared));
                }
                None => shedder.release(env.store, env.vm, permit, now),
            }
        }
        ready
    }

    /// The configuration is retired: every wait ends now (no tick of it will run again).
    /// Returns the streams to resume.
    pub fn drain<H: Host>(&self, stats: &Stats, env: &Env<'_, H>) -> Vec<(u32, SharedStream)> {
        let now = env.clock.now().mono;
        let keys: Vec<(usize, u64)> = self.parked.borrow().keys().copied().collect();
        let mut ready = Vec::new();
        for (class, ticket) in keys {
            if let Some((context, shared)) = self.take(stats, env, class, ticket, now) {
                increment(env.metrics, stats.class(class).timed_out);
                mark(&shared, Ready::Expired, None);
                ready.push((context, shared));
            }
        }
        ready
    }

    /// Refreshes this VM's entry in the record (every heartbeat).
    pub fn heartbeat<H: Host>(&self, env: &Env<'_, H>, now: MonoMillis) {
        self.leveler.heartbeat(env.store, env.vm, &self.local.borrow(), now);
    }
}

/// Marks a parked stream's wait over (with its in-flight permit, when it has a slot).
fn mark(shared: &SharedStream, ready: Ready, permit: Option<crate::primitives::inflight::Permit>) {
    let mut stream = shared.borrow_mut();
    stream.wait_over(ready, permit);
}
