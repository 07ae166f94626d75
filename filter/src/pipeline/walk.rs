//! The walk of a request through the pipeline's stages ([`Stage::ORDER`]), from its request
//! headers, or from where it waited, to its step.
//!
//! Each stage is a method of the stream ([`Stream::run`] names it) that takes what it needs and
//! says what comes next ([`Next`]): the next stage, a reply, or a wait. A filter walks the
//! stages its configuration has ([`Stage::configured_in`], built with the filter: a stage it
//! does not configure costs a request nothing). One loop runs them in order from a given one
//! ([`walk()`]); a waiting stream is parked in one place, by what it
//! waits for ([`park`]); a resumed one re-enters the walk after the stage it waited in, or at
//! that stage when the stage decides again with what came ([`super::resume`]). Whatever ends the
//! walk, its end ([`Stream::finish`]) is the one place where what the stages took goes back
//! before a reply.
//!
//! Invariant: the stages run in [`Stage::ORDER`] and nowhere else, each configured one in every
//! walk that passes its place; a stage that answers or waits ends the walk; what the stages took
//! goes back before the reply, once.

use crate::primitives::hash::Random;
use crate::primitives::time::Now;
use crate::replies::Reply;
use crate::replies::grpc;
use super::*;
use std::rc::Rc;

/// The request headers came: walks the stages from the first (the first may make the request
/// wait for its body: [`request_body_estimates`] then decides it).
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
    let mut pass = Pass { request, context, end_of_stream, rng, now: env.clock.now(), route: None };
    walk(filter, env, cell, &mut pass, Start::At(Stage::Body))
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
            if let Some(stage) = &filter.waits.body_waits {
                stage.body_arrived();
            }
        }
        let rules = &filter.limits.rules;
        if !estimates.feed(chunk, end, |rule| rules.estimate_places(rule)) {
            return None;
        }
        let held = estimates.held();
        stream.estimates_read(false);
        held
    };
    let mut pass = Pass { request, context, end_of_stream: false, rng, now: env.clock.now(), route: None };
    let step = walk(filter, env, cell, &mut pass, Start::After(Stage::Body, Next::Go));
    if !matches!(step, Step::Reply(_)) {
        // The body held so far: it waits on with the request (for the store, its turn or a
        // slot), or is counted now.
        let _ = cell.borrow_mut().request_body(filter, env, body_size, end);
    }
    Some(step)
}

/// The pipeline's stages, in the order a request meets them (the module doc's diagram;
/// `floodgate explain` tells a request's path in this order). The walk runs them in this order
/// ([`Stage::ORDER`]); a stage is a variant here, its place in the order, and its method
/// (`Stream::run`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// A request whose estimate a rule reads in its JSON body (`cost.estimate.body`) waits for
    /// its body, holding nothing.
    Body,
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
    /// The rate-limit rules (local, and batched global ones, which may ask the store first).
    RateLimit,
    /// A token bucket's delay instead of refusal: the request waits for its turn.
    Delay,
    /// Cluster selection.
    Select,
}

impl Stage {
    /// Every stage, in order.
    pub const ORDER: [Stage; 9] = [
        Stage::Body,
        Stage::Endpoints,
        Stage::Shed,
        Stage::Queue,
        Stage::Cap,
        Stage::Leased,
        Stage::RateLimit,
        Stage::Delay,
        Stage::Select,
    ];

    /// Its place in [`Stage::ORDER`].
    const fn index(self) -> usize {
        self as usize
    }

    /// Whether `filter` configures it: a stage it does not configure lets every request go on
    /// without looking at it (no rule reads a body, no health path, no shedding, ...), and is
    /// left out of the filter's walk ([`Stage::configured_in`]).
    fn configured(self, filter: &Filter) -> bool {
        match self {
            Stage::Body => filter.waits.body_waits.is_some(),
            Stage::Endpoints => filter.config.health.is_some() || filter.watchdog.is_some(),
            Stage::Shed => filter.shedding.classes.is_some(),
            Stage::Queue => filter.waits.queue.is_some(),
            Stage::Cap => filter.shedding.per_key.is_some(),
            Stage::Leased => filter.fleet.leased.is_some(),
            Stage::RateLimit => !filter.config.rate_limits.is_empty(),
            Stage::Delay => filter.waits.delays.is_some(),
            Stage::Select => filter.selection.selector.is_some(),
        }
    }

    /// The stages of [`Stage::ORDER`] that `filter` configures, in order: the list its walk
    /// runs, built once with the filter.
    pub(super) fn configured_in(filter: &Filter) -> Box<[Stage]> {
        Stage::ORDER.into_iter().filter(|stage| stage.configured(filter)).collect()
    }
}

/// Whether each stage of `stages` has its place as its discriminant.
const fn in_order(stages: &[Stage]) -> bool {
    match stages {
        [rest @ .., last] => last.index() == rest.len() && in_order(rest),
        [] => true,
    }
}

// The variants are declared in the order's order: a stage's place is its discriminant, and the
// stages compare by their place.
const _: () = assert!(in_order(&Stage::ORDER));

/// What a stage says comes next.
#[derive(Debug)]
pub(super) enum Next {
    /// The next stage (after the last, the request goes on).
    Go,
    /// The request is answered here.
    Reply(Reply),
    /// The request waits (the stage put its wait in the stream): it is parked.
    Wait(Waiting),
}

impl From<Option<Reply>> for Next {
    fn from(reply: Option<Reply>) -> Next {
        reply.map_or(Next::Go, Next::Reply)
    }
}

/// Where a walk starts.
#[derive(Debug)]
pub(super) enum Start {
    /// At a stage.
    At(Stage),
    /// After a stage that has decided already (a resumed wait's stage).
    After(Stage, Next),
}

/// What the walk carries from stage to stage: the request and what the stages read with it.
pub(super) struct Pass<'p, R: ?Sized, G: ?Sized> {
    /// The request's attributes.
    pub(super) request: &'p R,
    /// Its stream's host context.
    pub(super) context: u32,
    /// Whether the request headers ended the request.
    pub(super) end_of_stream: bool,
    /// The random source (cluster selection).
    pub(super) rng: &'p mut G,
    /// The clocks, read once for the walk.
    pub(super) now: Now,
    /// The cluster selection chose.
    pub(super) route: Option<usize>,
}

/// How a walk ended.
enum Walked {
    /// With a step.
    Done(Step),
    /// The request waits.
    Waits(Waiting),
}

/// Walks the stream's stages from `start` to its step; a request that waits is parked
/// ([`Step::Wait`]).
pub(super) fn walk<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
    filter: &Filter,
    env: &Env<'_, H>,
    cell: &mut StreamCell,
    pass: &mut Pass<'_, R, G>,
    start: Start,
) -> Step {
    let walked = {
        let mut stream = cell.borrow_mut();
        match start {
            Start::At(stage) => stream.walk_from(filter.stages.partition_point(|s| *s < stage), filter, env, pass),
            Start::After(stage, Next::Go) => stream.walk_from(filter.stages.partition_point(|s| *s <= stage), filter, env, pass),
            Start::After(stage, Next::Reply(reply)) => Walked::Done(stream.finish(filter, env, pass, Some((stage, reply)))),
            Start::After(_, Next::Wait(what)) => Walked::Waits(what),
        }
    };
    match walked {
        Walked::Done(step) => step,
        Walked::Waits(what) => park(filter, cell, pass.context, what, pass.now),
    }
}

/// Parks a stream that waits for `what` where that comes from (its state is shared from now
/// on): [`Step::Wait`].
fn park(filter: &Filter, cell: &mut StreamCell, context: u32, what: Waiting, now: Now) -> Step {
    let shared = cell.share();
    let stream = shared.borrow();
    match (what, &stream.wait) {
        (Waiting::Body, Some(Wait::Body(_))) => {
            if let Some(stage) = &filter.waits.body_waits {
                stage.park(now.mono, context, Rc::clone(&shared));
            }
        }
        (Waiting::Slot, Some(Wait::Slot(queued))) => {
            if let Some(stage) = &filter.waits.queue {
                stage.park(queued, context, Rc::clone(&shared));
            }
        }
        (Waiting::Store, Some(Wait::Store(wait))) => {
            if let Some(stage) = &filter.fleet.leased {
                stage.park(wait.on.0, context, Rc::clone(&shared));
            }
        }
        (Waiting::Asked, Some(Wait::Asked(asking))) => {
            if let Some(stage) = &filter.fleet.asks {
                stage.park(context, Rc::clone(&shared), &asking.asks);
            }
        }
        (Waiting::Turn, Some(Wait::Turn(delayed))) => {
            if let Some(stage) = &filter.waits.delays {
                stage.park(delayed.until, context, Rc::clone(&shared));
            }
        }
        _ => {}
    }
    Step::Wait
}

impl Stream {
    /// Runs the filter's stages (those it configures, in [`Stage::ORDER`]) from the `from`th
    /// on.
    fn walk_from<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
        &mut self,
        from: usize,
        filter: &Filter,
        env: &Env<'_, H>,
        pass: &mut Pass<'_, R, G>,
    ) -> Walked {
        for &stage in filter.stages.iter().skip(from) {
            match self.run(stage, filter, env, pass) {
                Next::Go => {}
                Next::Reply(reply) => return Walked::Done(self.finish(filter, env, pass, Some((stage, reply)))),
                Next::Wait(what) => return Walked::Waits(what),
            }
        }
        Walked::Done(self.finish(filter, env, pass, None))
    }

    /// Runs `stage` on the request.
    fn run<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
        &mut self,
        stage: Stage,
        filter: &Filter,
        env: &Env<'_, H>,
        pass: &mut Pass<'_, R, G>,
    ) -> Next {
        let (request, now) = (pass.request, pass.now);
        match stage {
            Stage::Body => self.body_wait(&filter.waits, &filter.limits.rules, request, pass.end_of_stream),
            Stage::Endpoints => {
                let (health, watchdog) = (filter.config.health.as_ref(), filter.watchdog.as_ref());
                self.endpoints(health, watchdog, &filter.shedding, &filter.selection, &filter.waits, env, request, now.mono).into()
            }
            Stage::Shed => self.shed(&filter.shedding, &filter.waits, &filter.limits.hasher, &filter.stats, &filter.shadows, env, request, pass.end_of_stream, now.mono).into(),
            Stage::Queue => self.queue(),
            Stage::Cap => self.cap(&filter.shedding, &filter.limits.hasher, &filter.stats, &filter.shadows, env, request, now.mono).into(),
            Stage::Leased => {
                let (limits, shadows, stats) = (&filter.limits, &filter.shadows, &filter.stats);
                self.lease(filter.fleet.leased.as_ref(), &filter.config, limits, shadows, stats, env, request, pass.context, pass.end_of_stream, now)
            }
            Stage::RateLimit => {
                let (config, limits, fleet, shadows, stats) = (&filter.config, &filter.limits, &filter.fleet, &filter.shadows, &filter.stats);
                let reply = self.rate_limit(config, limits, fleet, shadows, stats, &filter.waits, &filter.selection, env, request, now.wall);
                self.rate_limit_or_ask(reply, pass.end_of_stream)
            }
            Stage::Delay => self.delay(pass.end_of_stream, now),
            Stage::Select => match self.select(&filter.selection, &filter.stats, &filter.shadows, env, request, pass.rng, now.mono) {
                Ok(chosen) => {
                    pass.route = chosen;
                    self.decision.cluster = chosen;
                    Next::Go
                }
                Err(reply) => Next::Reply(reply),
            },
        }
    }

    /// The end of the walk (`refused`: the stage that answered, and its reply): the local reply,
    /// or the request goes on. A refused request gives back what the stages before took: the
    /// leased units (when a stage after `leased` refused), the units its rules counted, its
    /// permits.
    fn finish<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
        &mut self,
        filter: &Filter,
        env: &Env<'_, H>,
        pass: &Pass<'_, R, G>,
        refused: Option<(Stage, Reply)>,
    ) -> Step {
        let now = pass.now;
        let reply = match refused {
            Some((stage, reply)) => {
                if let (Some(leased), true) = (&filter.fleet.leased, stage > Stage::Leased) {
                    leased.untake(env.store, &std::mem::take(&mut self.leased));
                }
                self.give_back_counted(filter, env, now.wall);
                Some(reply)
            }
            None => {
                // The leased rules' reservations settle when the upstream reports.
                for (probe, later, limit) in std::mem::take(&mut self.leased.owed) {
                    self.charges.owe(probe, later, limit, now.wall);
                }
                None
            }
        };
        if reply.as_ref().is_some_and(|r| r.refusal.is_some()) || self.cluster_permit.is_some() {
            self.grpc.request = grpc::is_grpc(pass.request.get("content-type").as_deref());
        }
        match reply {
            Some(reply) => Step::Reply(self.reply(filter, env, reply, now.mono)),
            None => {
                if pass.end_of_stream && self.cluster_permit.is_some() {
                    self.timing.request_end = Some(now.mono);
                }
                if pass.end_of_stream && self.charges.counts_body() {
                    // No body: nothing to count.
                    let _ = self.charges.body_done();
                }
                Step::Continue { route: pass.route }
            }
        }
    }
}
