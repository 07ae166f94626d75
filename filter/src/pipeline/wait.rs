//! Waiting requests: what a paused request waits for ([`Waiting`]) and holds meanwhile
//! ([`Wait`]), its resumption once that came ([`resume`]), and its abandonment when its host
//! context is gone ([`abandon`]).
//!
//! Invariant: a stream waits on one thing at a time, and what that wait holds goes back once,
//! taken out of it.

use crate::primitives::hash::Random;
use crate::primitives::inflight::Permit;
use crate::primitives::time::MonoMillis;
use crate::ratelimit::estimate::BodyEstimates;
use super::*;
use super::decision::By;
use super::delay::Delayed;
use super::leased::StoreWait;
use super::queue::{Queued, Ready};
use super::stats::{self, increment};
use super::walk::{walk, Next, Pass, Start};
use std::rc::Rc;

/// What a paused request waits for. A stage that makes a request wait parks its stream where
/// that comes from; the shell, told it came, checks [`Stream::waits_for`] and then [`resume`]s
/// the request from its own context, or [`abandon`]s it when that context is gone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// Units of a leased rule's key (the `leased` stage; the store's answer).
    Store,
    /// Its turn (the `delay` stage; the root's tick).
    Turn,
    /// A slot (the `queue` stage; a freed slot or the root's tick).
    Slot,
    /// Its body, none of which came in time (an estimate read from the body; the root's tick).
    Body,
    /// The answer to its ask (a batched global rule's key; the store's answer).
    Asked,
}

/// What a paused request waits on, holding what that kind of wait holds: a stream has one
/// ([`Stream`]), so it waits on one thing at a time, and what it holds goes back once, taken
/// out of it ([`resume`], [`abandon`], [`Stream::end`]).
#[derive(Debug)]
pub(super) enum Wait {
    /// Units of a leased rule's key: its keys, and the units it wants.
    Store(StoreWait),
    /// Its turn: the turns it took of token buckets.
    Turn(Delayed),
    /// A slot: its ticket, and, once the wait is over, how it ended.
    Slot(Queued),
    /// Its body: the estimates read in it so far (none done).
    Body(Box<BodyEstimates>),
    /// The answer to its ask, then its decision with the answer.
    Asked(asked::Asking),
}

impl Wait {
    /// Its kind.
    pub(super) fn kind(&self) -> Waiting {
        match self {
            Wait::Store(_) => Waiting::Store,
            Wait::Turn(_) => Waiting::Turn,
            Wait::Slot(_) => Waiting::Slot,
            Wait::Body(_) => Waiting::Body,
            Wait::Asked(_) => Waiting::Asked,
        }
    }

    /// Whether it holds something to give back when the stream ends: units wanted of a leased
    /// key, turns, a ticket. One for its body or its ask holds nothing yet (its ask's answer is
    /// still learned: [`asked`]).
    pub(super) fn holds(&self) -> bool {
        matches!(self, Wait::Store(_) | Wait::Turn(_) | Wait::Slot(_))
    }

    /// The request body that comes while it waits, held (`None`: the body is read, waiting for
    /// its estimates).
    pub(super) fn body(&mut self) -> Option<&mut (usize, bool)> {
        match self {
            Wait::Store(wait) => Some(&mut wait.body),
            Wait::Turn(delayed) => Some(&mut delayed.body),
            Wait::Slot(queued) => Some(&mut queued.body),
            Wait::Asked(asking) => Some(&mut asking.body),
            Wait::Body(_) => None,
        }
    }
}

/// A paused request whose `what` came (its stream `context`, made the host's effective
/// context): the walk goes on from where it waited (`Stream::resumed`), and the body that
/// came meanwhile goes with it. [`Step::Wait`] when it waits on (for the same or the next
/// thing).
pub fn resume<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    shared: &SharedStream,
    context: u32,
    request: &R,
    rng: &mut G,
    what: Waiting,
) -> Step {
    let now = env.clock.now();
    let Some(Resumed { start, end_of_stream, body }) = shared.borrow_mut().resumed(filter, env, what, now) else { return Step::Wait };
    let mut cell = StreamCell::Shared(Rc::clone(shared));
    let mut pass = Pass { request, context, end_of_stream, rng, now, route: None };
    let step = walk(filter, env, &mut cell, &mut pass, start);
    if let Some(body) = body {
        shared.borrow_mut().carry_body(filter, env, &step, body);
    }
    step
}

/// Where a resumed request's walk goes on.
struct Resumed {
    /// After the stage it waited in, or at the stage that decides again with what came.
    start: Start,
    /// Whether its request headers ended the request.
    end_of_stream: bool,
    /// The body that came while it waited (bytes, and whether it ended); `None` for one that
    /// waited for its body (the body callbacks hold it).
    body: Option<(usize, bool)>,
}

/// A paused request whose `what` came and whose host context is gone: it will never be
/// decided, and what it holds goes back (units of a leased key, the turns it took, a queue
/// slot). One waiting for its body or its ask holds nothing yet (a grant its ask took stays
/// counted: the fleet admits less, never more).
pub fn abandon<H: Host>(filter: &Filter, env: &Env<'_, H>, shared: &SharedStream, what: Waiting) {
    match what {
        Waiting::Store => abandon_store(filter, env, shared),
        Waiting::Turn => abandon_turn(filter, env, shared),
        Waiting::Slot => abandon_slot(filter, env, shared),
        Waiting::Body | Waiting::Asked => {}
    }
}

/// A request whose turn came and whose host context is gone: its turns go back.
fn abandon_turn<H: Host>(filter: &Filter, env: &Env<'_, H>, shared: &SharedStream) {
    let mut stream = shared.borrow_mut();
    if let Some(Wait::Turn(delayed)) = stream.take_wait(Waiting::Turn) {
        stream.give_back_turns(filter, env, &delayed);
    }
}

/// A request whose wait for a slot is over and whose host context is gone: the slot it was
/// given goes back.
fn abandon_slot<H: Host>(filter: &Filter, env: &Env<'_, H>, shared: &SharedStream) {
    let mut stream = shared.borrow_mut();
    if stream.take_wait(Waiting::Slot).is_some() {
        let now = env.clock.now().mono;
        stream.release(filter, env, now);
    }
}

/// A woken request whose host context is gone: it will never be decided.
fn abandon_store<H: Host>(filter: &Filter, env: &Env<'_, H>, shared: &SharedStream) {
    let mut stream = shared.borrow_mut();
    if let (Some(Wait::Store(wait)), Some(stage)) = (stream.take_wait(Waiting::Store), &filter.fleet.leased) {
        stage.abandon(env.store, &wait, env.clock.now());
    }
}

impl Stream {
    /// A paused request whose `what` came: where its walk goes on, once its wait is over (or
    /// still on, for the store, at the stage that decides again); `None` when it no longer
    /// waits for `what` (it ended, or was resumed already).
    fn resumed<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, what: Waiting, now: Now) -> Option<Resumed> {
        match what {
            // Decided without its body, on its rules' `estimate.default`.
            Waiting::Body => {
                if !self.body_never_came() {
                    return None;
                }
                self.estimates_read(true);
                Some(Resumed { start: Start::After(Stage::Body, Next::Go), end_of_stream: false, body: None })
            }
            // Admitted, on after the queue; its wait ended, the shed `503`.
            Waiting::Slot => {
                let over = |wait: &mut Wait| matches!(wait, Wait::Slot(queued) if queued.ready.is_some());
                let Some(Wait::Slot(queued)) = self.wait.take_if(over).filter(|_| !self.ended) else { return None };
                let waited_ms = now.mono.saturating_since(queued.since);
                self.decision.waited_ms = Some(waited_ms);
                stats::set(env.metrics, filter.stats.shedding.queue_wait_ms, waited_ms);
                let reply = match queued.ready {
                    Some(Ready::Admitted) => {
                        if queued.fair_queue.is_some() {
                            stats::set(env.metrics, filter.stats.flow(queued.ticket.class).flow_wait_ms, waited_ms);
                        }
                        None
                    }
                    _ => self.wait_ended(&filter.shedding, &filter.waits, &filter.stats, env, &queued, waited_ms, now.mono),
                };
                Some(Resumed { start: Start::After(Stage::Queue, reply.into()), end_of_stream: queued.end_of_stream, body: Some(queued.body) })
            }
            // The `leased` stage takes its units again: decided, the walk goes on; still short
            // of units, it waits again.
            Waiting::Store => {
                let Some(Wait::Store(wait)) = self.wait.as_mut().filter(|_| filter.fleet.leased.is_some()) else { return None };
                let body = std::mem::take(&mut wait.body);
                Some(Resumed { start: Start::At(Stage::Leased), end_of_stream: wait.end_of_stream, body: Some(body) })
            }
            // Decided again with the answer.
            Waiting::Asked => {
                if !self.ask_answered() {
                    return None;
                }
                let Some(Wait::Asked(asking)) = self.wait.as_mut() else { return None };
                let body = std::mem::take(&mut asking.body);
                Some(Resumed { start: Start::At(Stage::RateLimit), end_of_stream: asking.end_of_stream, body: Some(body) })
            }
            // On after the delay.
            Waiting::Turn => {
                let Some(Wait::Turn(delayed)) = self.take_wait(Waiting::Turn).filter(|_| !self.ended) else { return None };
                self.decision.delayed(By::Rule(delayed.rule), now.mono.saturating_since(delayed.since));
                Some(Resumed { start: Start::After(Stage::Delay, Next::Go), end_of_stream: delayed.end_of_stream, body: Some(delayed.body) })
            }
        }
    }

    /// The keys it asks the store for, while it waits for the answer.
    pub(super) fn pending_asks(&self) -> Option<Vec<crate::fleet::batched::ask::KeyAsk>> {
        self.asking().filter(|a| a.outcomes.is_none()).map(|a| a.asks.clone())
    }

    /// Its ask, while it waits for the answer and then to be decided with it.
    pub(super) fn asking(&self) -> Option<&asked::Asking> {
        match &self.wait {
            Some(Wait::Asked(asking)) => Some(asking),
            _ => None,
        }
    }

    /// Takes its wait out, if it waits for `what`.
    pub(super) fn take_wait(&mut self, what: Waiting) -> Option<Wait> {
        self.wait.take_if(|wait| wait.kind() == what)
    }

    /// Whether it still waits for `what`, and what it waits for came (and it has not ended):
    /// the shell resumes only those.
    pub fn waits_for(&self, what: Waiting) -> bool {
        if self.ended {
            return false;
        }
        match (&self.wait, what) {
            (Some(Wait::Store(_)), Waiting::Store) | (Some(Wait::Turn(_)), Waiting::Turn) => true,
            (Some(Wait::Slot(queued)), Waiting::Slot) => queued.ready.is_some(),
            (Some(Wait::Body(estimates)), Waiting::Body) => !estimates.started(),
            (Some(Wait::Asked(asking)), Waiting::Asked) => !self.replied && asking.outcomes.is_some(),
            _ => false,
        }
    }

    /// Whether its ask was answered and it waits to be decided again.
    pub fn ask_answered(&self) -> bool {
        self.waits_for(Waiting::Asked)
    }

    /// The body that came while the request waited (bytes, and whether it ended), counted now
    /// that it goes on.
    fn body_held<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, (bytes, ended): (usize, bool)) {
        if self.charges.counts_body() && bytes > 0 {
            self.charges.body(bytes);
        }
        if ended && self.charges.counts_body() {
            let owed = self.charges.body_done();
            self.charge(filter, env, owed);
        }
    }

    /// The body that came while the request waited (bytes, and whether it ended), now that it
    /// is decided (`step`): it waits on with the request if the request waits again (for the
    /// store or its turn), else it is counted.
    fn carry_body<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, step: &Step, body: (usize, bool)) {
        match (step, &mut self.wait) {
            (Step::Wait, Some(Wait::Store(wait))) => wait.body = body,
            (Step::Wait, Some(Wait::Turn(delayed))) => delayed.body = body,
            _ => self.body_held(filter, env, body),
        }
    }

    /// The turns a request waiting for its turn took go back (its client went away).
    pub(super) fn give_back_turns<H: Host>(&self, filter: &Filter, env: &Env<'_, H>, delayed: &Delayed) {
        for probe in &delayed.turns {
            filter.limits.limiter.give_back_turn(env.store, *probe);
            increment(env.metrics, filter.stats.rule(probe.rule).delay_abandoned);
        }
    }

    /// Whether it waits for the body its estimate is read from, none of which came yet.
    pub fn body_never_came(&self) -> bool {
        self.waits_for(Waiting::Body)
    }

    /// Its body's estimates are read (`give_up`: none is, as none of the body came): its wait
    /// for them is over, and what they found stays with the request.
    pub(super) fn estimates_read(&mut self, give_up: bool) {
        if let Some(Wait::Body(mut estimates)) = self.take_wait(Waiting::Body) {
            if give_up {
                estimates.give_up();
            }
            self.estimates = Some(estimates);
        }
    }

    /// When it goes, while it waits for its turn.
    pub fn delayed_until(&self) -> Option<MonoMillis> {
        match &self.wait {
            Some(Wait::Turn(delayed)) if !self.ended => Some(delayed.until),
            _ => None,
        }
    }

    /// The body slot of a request that waits (for the store, its turn, a slot, or its ask's
    /// answer and its decision with it).
    pub(super) fn held_body(&mut self) -> Option<&mut (usize, bool)> {
        if self.ended {
            return None;
        }
        self.wait.as_mut().and_then(Wait::body)
    }

    /// When it started to wait for the store, while it waits.
    pub fn waiting_since(&self) -> Option<MonoMillis> {
        match &self.wait {
            Some(Wait::Store(wait)) if !self.ended => Some(wait.since),
            _ => None,
        }
    }

    /// A waiting request's wait is over (`ready`; with a slot, its in-flight `permit`, and in
    /// a class shared by flow its fair `slot`): the host resumes it next ([`Waiting::Slot`]).
    pub(crate) fn wait_over(&mut self, ready: Ready, permit: Option<Permit>, slot: Option<super::queue::FairSlot>) {
        if let Some(Wait::Slot(queued)) = self.wait.as_mut() {
            queued.ready = Some(ready);
        }
        if permit.is_some() {
            self.permit = permit;
        }
        if slot.is_some() {
            self.fair_slot = slot;
        }
    }

    /// The fair queue it waits in, while it waits for a slot of a class shared by flow.
    pub(crate) fn waiting_in_fair_queue(&self) -> Option<usize> {
        match &self.wait {
            Some(Wait::Slot(queued)) if queued.ready.is_none() => queued.fair_queue,
            _ => None,
        }
    }

    /// Whether its wait for a slot is over and it awaits its resumption.
    pub fn slot_decided(&self) -> bool {
        self.waits_for(Waiting::Slot)
    }
}
