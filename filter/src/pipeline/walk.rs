//! The walk of a request through the pipeline's stages, in their order ([`Stage::ORDER`]),
//! from its request headers (or its body's estimates) to its step.
//!
//! Invariant: the stages run in [`Stage::ORDER`]; what a stage holds goes back before the reply
//! when a later stage answers.

use crate::primitives::hash::Random;
use crate::primitives::time::Now;
use crate::replies::Reply;
use crate::replies::grpc;
use super::*;
use super::leased::StoreWait;

/// The request headers came: runs the pipeline, or, when a rule that applies reads its
/// estimate in the request's body, waits for the body ([`request_body_estimates`] decides).
#[allow(clippy::too_many_arguments)]
pub fn request_headers<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    cell: &mut StreamCell,
    context: u32,
    request: &R,
    end_of_stream: bool,
    rng: &mut G,
) -> Step {
    filter.serving(env);
    // The stage exists only where some rule reads its estimate in request bodies.
    if !end_of_stream && filter.body_waits.as_ref().is_some_and(|s| !s.withheld()) {
        if let Some(estimates) = filter.rules.body_estimates(request) {
            // Nothing is taken yet: a client that goes away now leaves nothing behind.
            cell.borrow_mut().wait = Some(Wait::Body(Box::new(estimates)));
            if let Some(stage) = &filter.body_waits {
                stage.park(env.clock.now().mono, context, cell.share());
            }
            return Step::Wait;
        }
    }
    decide(filter, env, cell, context, request, end_of_stream, rng)
}

/// For a request that waits for its body's estimates, the bytes of the body (of `body_size`
/// bytes held so far) to read next: from `start`, `len` bytes (`len` 0: none, the bound is
/// reached); `None` when the request does not wait for them.
pub fn estimate_wants(cell: &StreamCell, body_size: usize) -> Option<(usize, usize)> {
    let stream = cell.borrow();
    let Some(Wait::Body(estimates)) = stream.wait.as_ref().filter(|_| !stream.ended) else { return None };
    Some(estimates.wants(body_size).unwrap_or((body_size, 0)))
}

/// The next bytes of the request body (`chunk`, those [`estimate_wants`] asked; `body_size`
/// bytes held so far, `None` for the request trailers: as before; `end`: the body ended) of a
/// request that waits for its estimates: once they are known (or the body ended, or the bound
/// is reached), the pipeline decides the request, and the body held so far goes on with it
/// (`Some(step)`); `None`: it waits on.
#[allow(clippy::too_many_arguments)]
pub fn request_body_estimates<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    cell: &mut StreamCell,
    context: u32,
    request: &R,
    chunk: &[u8],
    body_size: Option<usize>,
    end: bool,
    rng: &mut G,
) -> Option<Step> {
    let body_size = {
        let mut stream = cell.borrow_mut();
        let Some(Wait::Body(estimates)) = stream.wait.as_mut() else { return None };
        estimates.hold(body_size.unwrap_or_default());
        if !chunk.is_empty() {
            if let Some(stage) = &filter.body_waits {
                stage.body_arrived();
            }
        }
        let rules = &filter.rules;
        if !estimates.feed(chunk, end, |rule| rules.estimate_places(rule)) {
            return None;
        }
        let held = estimates.held();
        stream.estimates_read(false);
        held
    };
    let step = decide(filter, env, cell, context, request, false, rng);
    if !matches!(step, Step::Reply(_)) {
        // The body held so far: it waits on with the request (for the store, its turn or a
        // slot), or is counted now.
        let _ = cell.borrow_mut().request_body(filter, env, body_size, end);
    }
    Some(step)
}

/// The pipeline's stages, in the order a request meets them (the module doc's diagram;
/// `floodgate explain` tells a request's path in this order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The health endpoint and the watchdog's liveness path, answered by the filter itself.
    Endpoints,
    /// Load shedding: the loop lag, then the proxy-wide in-flight count, by priority class.
    Shed,
    /// The load-leveling queue: a request the in-flight count would shed waits for a slot.
    Queue,
    /// The per-key in-flight cap (the bulkhead).
    Cap,
    /// Leased global rules: units the store lends ahead of use.
    Leased,
    /// The rate-limit rules (local, and batched global ones).
    RateLimit,
    /// A token bucket's delay instead of refusal: the request waits for its turn.
    Delay,
    /// Cluster selection.
    Select,
}

impl Stage {
    /// Every stage, in order.
    pub const ORDER: [Stage; 8] =
        [Stage::Endpoints, Stage::Shed, Stage::Queue, Stage::Cap, Stage::Leased, Stage::RateLimit, Stage::Delay, Stage::Select];
}

/// Runs the pipeline on the request headers.
#[allow(clippy::too_many_arguments)]
pub(super) fn decide<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    cell: &mut StreamCell,
    context: u32,
    request: &R,
    end_of_stream: bool,
    rng: &mut G,
) -> Step {
    let now = env.clock.now();
    let mut stream = cell.borrow_mut();
    let reply = stream.endpoints(filter, env, request, now.mono).or_else(|| stream.shed(filter, env, request, end_of_stream, now.mono));
    if let Some(Wait::Slot(queued)) = &stream.wait {
        // The queue stage: it waits for a slot; its state is shared from now on.
        let queued = queued.clone();
        drop(stream);
        if let Some(stage) = &filter.queue {
            stage.park(&queued, context, cell.share());
        }
        return Step::Wait;
    }
    drop(stream);
    after_shed(filter, env, cell, context, request, end_of_stream, reply, rng, now)
}

/// The pipeline after the `shed` stage (`reply`: a refusal so far, if any): `cap → leased →
/// rate_limit → delay → select`, parking the stream where a stage makes it wait.
#[allow(clippy::too_many_arguments)]
pub(super) fn after_shed<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    cell: &mut StreamCell,
    context: u32,
    request: &R,
    end_of_stream: bool,
    reply: Option<Reply>,
    rng: &mut G,
    now: Now,
) -> Step {
    let mut stream = cell.borrow_mut();
    let mut reply = reply.or_else(|| stream.cap(filter, env, request, now.mono));
    if let (None, Some(stage)) = (&reply, &filter.leased) {
        let probes = stage.probes(filter, env.metrics, request, stream.estimates.as_deref());
        if !probes.is_empty() {
            match stage.admit(filter, env.store, env.metrics, &probes, context, now) {
                leased::Admission::All(taken) => stream.took(taken),
                leased::Admission::Refused(refusal) => reply = Some(stream.leased_refusal(refusal)),
                leased::Admission::Wait(key, units) => {
                    stream.wait = Some(Wait::Store(StoreWait { probes, since: now.mono, on: (key, units), end_of_stream, body: (0, false) }));
                    drop(stream);
                    stage.park(key, context, cell.share());
                    return Step::Wait;
                }
            }
        }
    }
    let step = stream.finish_headers(filter, env, request, end_of_stream, reply, rng, now);
    if let (Step::Wait, Some(asks), Some(stage)) = (&step, stream.pending_asks(), &filter.asks) {
        drop(stream);
        stage.park(context, cell.share(), &asks);
        return Step::Wait;
    }
    // A request the `delay` stage holds waits for its turn: its state is shared from now on.
    let until = match &stream.wait {
        Some(Wait::Turn(delayed)) if step == Step::Wait => Some(delayed.until),
        _ => None,
    };
    drop(stream);
    if let (Some(until), Some(stage)) = (until, &filter.delays) {
        stage.park(until, context, cell.share());
    }
    step
}

impl Stream {
    /// The rest of the pipeline after the `leased` stage (`reply`: a refusal so far, if any):
    /// `rate_limit → delay → select`, then the local reply or the request goes on; or it
    /// waits for its turn ([`Step::Wait`], the stream to park in the `delay` stage). A later
    /// stage's refusal gives the leased units back.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish_headers<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
        &mut self,
        filter: &Filter,
        env: &Env<'_, H>,
        request: &R,
        end_of_stream: bool,
        reply: Option<Reply>,
        rng: &mut G,
        now: Now,
    ) -> Step {
        let refused_before = reply.is_some();
        let reply = reply.or_else(|| self.rate_limit(filter, env, request, now.wall));
        match self.wait.as_mut() {
            Some(Wait::Asked(asking)) if asking.outcomes.is_none() => {
                // It waits for its ask's answer ([`asked`]).
                asking.end_of_stream = end_of_stream;
                return Step::Wait;
            }
            // Decided with the answer: its wait is over.
            Some(Wait::Asked(_)) => self.wait = None,
            _ => {}
        }
        if let (None, Some(Wait::Turn(delayed))) = (&reply, self.wait.as_mut()) {
            // The delay stage: it goes at its turn.
            delayed.until = now.mono.plus_ms(delayed.go_at.saturating_since(now.wall));
            delayed.since = now.mono;
            delayed.end_of_stream = end_of_stream;
            return Step::Wait;
        }
        self.finish_selected(filter, env, request, end_of_stream, reply, refused_before, rng, now)
    }

    /// The rest of the pipeline after the `delay` stage (`reply`: a refusal so far, if any;
    /// `refused_before`: by a stage before `rate_limit`): `select`, then the local reply or the
    /// request goes on. A later stage's refusal gives the leased units back.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn finish_selected<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
        &mut self,
        filter: &Filter,
        env: &Env<'_, H>,
        request: &R,
        end_of_stream: bool,
        reply: Option<Reply>,
        refused_before: bool,
        rng: &mut G,
        now: Now,
    ) -> Step {
        let mut route = None;
        let reply = reply
            .or_else(|| match self.select(filter, env, request, rng, now.mono) {
                Ok(chosen) => {
                    route = chosen;
                    self.decision.cluster = chosen;
                    None
                }
                Err(reply) => Some(reply),
            });
        if let (Some(stage), false, true) = (&filter.leased, refused_before, reply.is_some()) {
            stage.untake(env.store, &std::mem::take(&mut self.leased));
        }
        if reply.is_some() {
            self.give_back_counted(filter, env, now.wall);
        }
        if reply.is_none() {
            // The leased rules' reservations settle when the upstream reports.
            for (probe, later, limit) in std::mem::take(&mut self.leased.owed) {
                self.charges.owe(probe, later, limit, now.wall);
            }
        }
        if reply.as_ref().is_some_and(|r| r.refusal.is_some()) || self.cluster_permit.is_some() {
            self.grpc.request = grpc::is_grpc(request.get("content-type").as_deref());
        }
        match reply {
            Some(reply) => Step::Reply(self.reply(filter, env, reply, now.mono)),
            None => {
                if end_of_stream && self.cluster_permit.is_some() {
                    self.timing.request_end = Some(now.mono);
                }
                if end_of_stream && self.charges.counts_body() {
                    // No body: nothing to count.
                    let _ = self.charges.body_done();
                }
                Step::Continue { route }
            }
        }
    }
}
