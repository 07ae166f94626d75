//! The leased rules' host side (issue 17; [`crate::lease`] decides): the `lease` stage of the
//! request pipeline, the calls to `floodgate-sync`'s `POST /v1/lease`, and the requests that
//! wait for their answers.
//!
//! A request whose key's lease is empty is paused (`Action::Pause`) and listed under its key.
//! One call per key is on its way at a time. The SDK hands an answer to the context that sent
//! the call, and the host cancels a stream's calls when the stream ends, so a call goes from a
//! context that outlives it: the waiting request's own stream for the call it waits on, the
//! root context for everything else (a refill of a lease running low, give-backs, a second call
//! for requests still waiting), queued and sent at the root's next tick (every 10 ms at most
//! with leased rules). Calls are always sent with the effective context back on the sender, so
//! the host's idea of the call's owner and the SDK's agree.
//!
//! The answer wakes every request waiting on the key, in order, from that callback: each is made
//! the effective context, takes its units again and runs the rest of the pipeline
//! (`rate_limit → select`) on a stream value of its own, which its real stream takes over at its
//! next callback ([`Parked`]).
//!
//! A stream that ends with its call on the way (its client left) loses the answer: the root
//! context sends the call again at its next tick. It also decides the requests waiting past
//! `lease_timeout` as `on_store_failure` says (a call's own timeout is `lease_timeout`, so this
//! only happens after a lost call, or to a request that had to wait for a second call).

use super::call;
use super::stats::{self, increment, LeaseStats};
use super::{header_map, FilterStream, Filter, RequestHeaders};
use crate::config::{Config, Consistency, Scope};
use crate::global::flusher::Answer;
use crate::global::{FleetHasher, FleetKey};
use crate::keys;
use crate::lease::protocol::{self, LEASE_PATH};
use crate::lease::{Ask, LeaseBook, LeaseSpec, Refusal, Take};
use crate::ratelimit::window::{Counts, Window};
use crate::ratelimit::{Cause, Probe, Standing, Verdict, Violation};
use crate::replies::{self, Reply};
use crate::primitives::time::{MonoMillis, Now};
use proxy_wasm::hostcalls;
use proxy_wasm::types::Action;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::num::NonZeroU64;
use std::rc::Rc;
use std::time::Duration;

/// A request's key of one leased rule.
#[derive(Clone, Copy, Debug)]
pub struct LeaseProbe {
    /// The rule, the key's limit and the request's cost (as for any rule).
    pub probe: Probe,
    /// The key's fleet-wide id.
    pub key: FleetKey,
    /// The window and the limit.
    pub spec: LeaseSpec,
}

impl LeaseProbe {
    /// The units the request takes: its cost, and at least one.
    fn units(&self) -> u32 {
        self.probe.needs()
    }
}

/// A request waiting for the store, shared by its stream and the waiting list.
pub struct Parked {
    probes: Vec<LeaseProbe>,
    /// When it started to wait.
    since: MonoMillis,
    /// The key it waits on, and the units it wants of it.
    waiting_on: Cell<(FleetKey, u32)>,
    /// Whether the request headers ended the request.
    pub end_of_stream: bool,
    /// Request body seen while waiting: bytes, and whether it ended.
    pub body: Cell<(usize, bool)>,
    /// The stream that ran the rest of the pipeline once the request was decided.
    pub resumed: RefCell<Option<FilterStream>>,
    /// The stream ended while waiting.
    gone: Cell<bool>,
}

/// The units a request took of the leased rules' keys.
#[derive(Clone, Debug, Default)]
pub struct Taken {
    /// Their standings, for the `RateLimit` fields.
    pub standings: Vec<Standing>,
    /// The keys and units, given back if a later stage refuses the request.
    pub units: Vec<(FleetKey, u32)>,
    /// When they were taken.
    pub at: crate::primitives::time::UnixMillis,
}

/// What the `lease` stage says of a request.
pub enum Step {
    /// Every leased rule admitted it.
    Go(Taken),
    /// Refused: the reply.
    Refuse(Reply),
    /// It waits for the store.
    Wait(Rc<Parked>),
}

/// How the rules took their units.
enum Outcome {
    All(Taken),
    Refused(Reply),
    Wait(FleetKey, u32),
}

/// The requests waiting on one key: their context ids and states, in arrival order.
type Waiting = VecDeque<(u32, Rc<Parked>)>;

/// A call on its way.
struct Call {
    /// The context that sent it (the one the host answers).
    owner: u32,
    asks: Vec<Ask>,
    sent: MonoMillis,
}

/// The leased rules of a configuration, and this worker's leases, calls and waiting requests.
pub struct LeaseStage {
    book: RefCell<LeaseBook>,
    /// Per rule, in configuration order: the window of a leased rule.
    windows: Vec<Option<Window>>,
    hasher: FleetHasher,
    cluster: String,
    authority: String,
    /// `lease_timeout`, ms: the timeout of the calls requests wait on.
    pub timeout_ms: u64,
    /// `timeout`, ms: the timeout of the calls the root sends (no request waits on them when
    /// they go; a slow answer is better than a failure that makes the keys decide without the
    /// store).
    background_timeout_ms: u64,
    /// The root context's id.
    root: u32,
    calls: RefCell<HashMap<u32, Call>>,
    /// Calls the root sends at its next tick.
    queued: RefCell<Vec<Ask>>,
    /// Per key, the requests waiting on it in arrival order: their context ids and states.
    waiting: RefCell<HashMap<FleetKey, Waiting>>,
    stats: LeaseStats,
}

impl LeaseStage {
    /// The stage of `config`, if it has leased rules, under the root context `root`.
    pub fn new(config: &Config, stats: LeaseStats, root: u32) -> Option<LeaseStage> {
        let global = config.global.as_ref()?;
        let windows: Vec<Option<Window>> = config
            .rate_limits
            .iter()
            .map(|r| {
                (r.scope == Scope::Global && r.consistency == Consistency::Leased)
                    .then(|| Window::new(NonZeroU64::new(r.window.get().get()).unwrap_or(NonZeroU64::MIN)))
            })
            .collect();
        if windows.iter().all(Option::is_none) {
            return None;
        }
        let max_keys = usize::try_from(global.max_keys.get().get()).unwrap_or(usize::MAX);
        Some(LeaseStage {
            book: RefCell::new(LeaseBook::new(
                max_keys,
                global.sync_interval.get().get(),
                global.on_store_failure,
                global.max_lease.map_or(u32::MAX, |m| m.get().get()),
                global.lease_timeout.get().get(),
            )),
            windows,
            hasher: FleetHasher::new(global.key_secret.as_deref()),
            cluster: global.cluster.as_str().to_owned(),
            authority: global.authority().to_owned(),
            timeout_ms: global.lease_timeout.get().get(),
            root,
            background_timeout_ms: global.timeout.get().get().max(global.lease_timeout.get().get()),
            calls: RefCell::new(HashMap::new()),
            queued: RefCell::new(Vec::new()),
            waiting: RefCell::new(HashMap::new()),
            stats,
        })
    }

    /// Whether rule `rule` is leased.
    pub fn is_leased(&self, rule: usize) -> bool {
        self.windows.get(rule).is_some_and(Option::is_some)
    }

    /// The stage: takes the request's units of every leased rule that applies, or refuses it,
    /// or parks it (`context_id`: its stream) until the store answers.
    pub fn admit(&self, filter: &Filter, headers: &RequestHeaders<'_, '_>, context_id: u32, end_of_stream: bool, now: Now) -> Step {
        let probes = self.probes(filter, headers);
        if probes.is_empty() {
            return Step::Go(Taken::default());
        }
        let mut sends = Vec::new();
        let taken = self.take_all(filter, &probes, None, false, now, &mut sends);
        // The call this request waits on goes from its stream (alive until the answer); a
        // refill from the root.
        let waits_on = match &taken {
            Outcome::Wait(key, _) => Some(*key),
            _ => None,
        };
        let (own, background): (Vec<Ask>, Vec<Ask>) = sends.into_iter().partition(|a| Some(a.key) == waits_on);
        self.send(own, context_id, now);
        self.queued.borrow_mut().extend(background);
        match taken {
            Outcome::All(taken) => Step::Go(taken),
            Outcome::Refused(reply) => Step::Refuse(reply),
            Outcome::Wait(key, units) => {
                increment(self.stats.waited);
                let parked = Rc::new(Parked {
                    probes,
                    since: now.mono,
                    waiting_on: Cell::new((key, units)),
                    end_of_stream,
                    body: Cell::new((0, false)),
                    resumed: RefCell::new(None),
                    gone: Cell::new(false),
                });
                self.waiting.borrow_mut().entry(key).or_default().push_back((context_id, Rc::clone(&parked)));
                Step::Wait(parked)
            }
        }
    }

    /// The request's keys of the leased rules that apply to it, with their limits and costs.
    fn probes(&self, filter: &Filter, headers: &RequestHeaders<'_, '_>) -> Vec<LeaseProbe> {
        let rules = &filter.rules;
        let mut skipped = Vec::new();
        let probes = keys::probes_where(
            &filter.config,
            &filter.hasher,
            Some(&self.hasher),
            |source| headers.fetch(source),
            &mut skipped,
            |rule| self.is_leased(rule) && rules.applies(rule, headers),
        );
        for rule in skipped {
            increment(filter.stats.rule(rule).skipped);
        }
        probes
            .into_iter()
            .filter_map(|mut probe| {
                let window = self.windows.get(probe.rule).copied().flatten()?;
                let key = probe.fleet?;
                probe.limit = rules.limit(probe.rule, probe.key_hash, headers);
                let limit = probe.limit.or_else(|| filter.limiter.tables().get(probe.rule).map(|t| t.limit))?;
                let admission = rules.admission(probe.rule, headers);
                if admission.invalid {
                    increment(filter.stats.rule(probe.rule).invalid_cost);
                }
                probe.cost = crate::ratelimit::rules::capped(admission.now, limit);
                Some(LeaseProbe { probe, key, spec: LeaseSpec { window, limit } })
            })
            .collect()
    }

    /// Takes the units of every probe, or none (`waited_on`: the key the request waited for;
    /// `fallback`: its wait is over, decide without the store). Calls to send go to `sends`.
    fn take_all(
        &self,
        filter: &Filter,
        probes: &[LeaseProbe],
        waited_on: Option<FleetKey>,
        fallback: bool,
        now: Now,
        sends: &mut Vec<Ask>,
    ) -> Outcome {
        let mut book = self.book.borrow_mut();
        let mut standings = Vec::with_capacity(probes.len());
        let mut taken: Vec<&LeaseProbe> = Vec::with_capacity(probes.len());
        let verdict = 'rules: {
            for lp in probes {
                let units = lp.units();
                let take = if fallback {
                    increment(self.stats.without_store);
                    book.without_store(lp.key, lp.spec, units, now.wall)
                } else {
                    book.take(lp.key, lp.spec, units, waited_on == Some(lp.key), now.wall)
                };
                match take {
                    Take::Admitted { counts, held, refill } => {
                        sends.extend(refill);
                        let mut standing = self.standing(filter, lp, counts, now);
                        standing.remaining = standing.remaining.saturating_add(u64::from(held));
                        standings.push(standing);
                        taken.push(lp);
                    }
                    Take::Wait { call } => {
                        sends.extend(call);
                        break 'rules Outcome::Wait(lp.key, units);
                    }
                    Take::Refused { refusal, counts } => {
                        let reply = match refusal {
                            Refusal::OverLimit => {
                                let standing = self.standing(filter, lp, counts, now);
                                let verdict = Verdict::Rejected { violations: vec![Violation { standing, cause: Cause::OverLimit }] };
                                replies::rate_limited(&filter.limiter, &verdict, now.wall)
                            }
                            Refusal::StoreDown => Some(replies::quota_store_unavailable(&filter.limiter, lp.probe.rule)),
                        };
                        let stats = filter.stats.rule(lp.probe.rule);
                        increment(stats.rejected);
                        break 'rules Outcome::Refused(
                            reply.unwrap_or_else(|| replies::quota_store_unavailable(&filter.limiter, lp.probe.rule)),
                        );
                    }
                }
            }
            for lp in &taken {
                increment(filter.stats.rule(lp.probe.rule).allowed);
            }
            let units = taken.iter().map(|lp| (lp.key, lp.units())).collect();
            return Outcome::All(Taken { standings, units, at: now.wall });
        };
        for lp in taken {
            book.untake(lp.key, lp.units(), now.wall);
        }
        verdict
    }

    /// Where a key stands with the fleet's `counts`.
    fn standing(&self, filter: &Filter, lp: &LeaseProbe, counts: Counts, now: Now) -> Standing {
        filter.limiter.standing_of(&lp.probe, counts, now.wall).unwrap_or(Standing {
            rule: lp.probe.rule,
            estimate: 0.0,
            remaining: 0,
            reset_ms: 0,
            retry_at: None,
            limit: lp.spec.limit,
        })
    }

    /// Sends one call from `owner`, the context whose callback runs (and the effective one).
    fn send(&self, asks: Vec<Ask>, owner: u32, now: Now) {
        if asks.is_empty() {
            return;
        }
        let body = protocol::body(&asks, super::vm_id());
        let timeout = Duration::from_millis(if owner == self.root { self.background_timeout_ms } else { self.timeout_ms });
        match call::post_json(&self.cluster, &self.authority, LEASE_PATH, &body, timeout) {
            Ok(token) => {
                increment(self.stats.calls);
                self.calls.borrow_mut().insert(token, Call { owner, asks, sent: now.mono });
            }
            Err(status) => {
                increment(self.stats.failures);
                log::warn!("floodgate: lease call to cluster {:?} not sent: {status:?}", self.cluster);
                let mut book = self.book.borrow_mut();
                for ask in &asks {
                    book.answered(ask, None, now.wall);
                }
                // The requests waiting on these keys are decided at the next tick, without the
                // store (their keys' calls failed).
            }
        }
    }

    /// The answer to call `token` (`false`: not a lease call). Wakes the requests waiting on
    /// its keys from the context `current` (whose callback runs).
    pub fn answered(&self, filter: &Rc<Filter>, token: u32, num_headers: usize, body_size: usize, current: u32, now: Now) -> bool {
        let Some(call) = self.calls.borrow_mut().remove(&token) else {
            return false;
        };
        let grants = match call::answer(num_headers, body_size) {
            Answer::Ok(body) => protocol::decode(&body, call.asks.len()).map_err(|e| log::warn!("floodgate: {e}")).ok(),
            Answer::Failed(other) => {
                log::debug!("floodgate: lease call failed ({other:?}, after {} ms)", now.mono.saturating_since(call.sent));
                None
            }
        };
        {
            let mut book = self.book.borrow_mut();
            match &grants {
                Some(grants) => {
                    for (ask, grant) in call.asks.iter().zip(grants) {
                        stats::add_count(self.stats.granted, u64::from(grant.granted));
                        stats::add_count(self.stats.returned, u64::from(ask.returned).saturating_add(u64::from(ask.returned_previous)));
                        book.answered(ask, Some(*grant), now.wall);
                    }
                }
                None => {
                    increment(self.stats.failures);
                    for ask in &call.asks {
                        book.answered(ask, None, now.wall);
                    }
                }
            }
        }
        stats::record(self.stats.call_ms, now.mono.saturating_since(call.sent));
        for ask in call.asks.iter().filter(|a| a.want > 0) {
            self.wake(filter, ask.key, current, now);
        }
        true
    }

    /// Decides the requests waiting on `key` again, in order, from the context `current`.
    fn wake(&self, filter: &Rc<Filter>, key: FleetKey, current: u32, now: Now) {
        let Some(queue) = self.waiting.borrow_mut().remove(&key) else { return };
        let mut sends = Vec::new();
        for (context_id, parked) in queue {
            if parked.gone.get() {
                continue;
            }
            if hostcalls::set_effective_context(context_id).is_err() {
                parked.gone.set(true);
                let (on, units) = parked.waiting_on.get();
                self.book.borrow_mut().abandon(on, units);
                continue;
            }
            let expired = now.mono.saturating_since(parked.since) >= self.timeout_ms;
            let (on, _) = parked.waiting_on.get();
            match self.take_all(filter, &parked.probes, Some(on), expired, now, &mut sends) {
                Outcome::All(taken) => {
                    let elapsed = now.mono.saturating_since(parked.since);
                    stats::record(self.stats.wait_ms, elapsed);
                    let mut stream = FilterStream::new(Rc::clone(filter), context_id);
                    stream.lease_taken = taken;
                    let map = if filter.headers.whole_map() { header_map::request_headers() } else { None };
                    let headers = RequestHeaders::new(&filter.headers, map.as_deref());
                    let action = stream.finish_headers(filter, &headers, now, parked.end_of_stream, None);
                    if action == Action::Continue {
                        if let Err(status) = hostcalls::resume_http_request() {
                            log::debug!("floodgate: cannot resume a request: {status:?}");
                        }
                    }
                    *parked.resumed.borrow_mut() = Some(stream);
                }
                Outcome::Refused(reply) => {
                    let mut stream = FilterStream::new(Rc::clone(filter), context_id);
                    let map = if filter.headers.whole_map() { header_map::request_headers() } else { None };
                    let headers = RequestHeaders::new(&filter.headers, map.as_deref());
                    stream.finish_headers(filter, &headers, now, parked.end_of_stream, Some(reply));
                    *parked.resumed.borrow_mut() = Some(stream);
                }
                Outcome::Wait(next, units) => {
                    parked.waiting_on.set((next, units));
                    self.waiting.borrow_mut().entry(next).or_default().push_back((context_id, parked));
                }
            }
        }
        if let Err(status) = hostcalls::set_effective_context(current) {
            log::debug!("floodgate: cannot restore the effective context: {status:?}");
        }
        self.queued.borrow_mut().extend(sends);
    }

    /// A stream ended (`on_log`): its request stops waiting, and the calls it sent are lost
    /// (the host cancels them): their keys' waiting requests get a new call at the next tick.
    pub fn stream_ended(&self, context_id: u32, parked: Option<&Rc<Parked>>) {
        if let Some(parked) = parked {
            if parked.resumed.borrow().is_none() && !parked.gone.replace(true) {
                let (on, units) = parked.waiting_on.get();
                self.book.borrow_mut().abandon(on, units);
            }
        }
        let mut calls = self.calls.borrow_mut();
        let lost: Vec<u32> = calls.iter().filter(|(_, c)| c.owner == context_id).map(|(t, _)| *t).collect();
        let mut book = self.book.borrow_mut();
        for token in lost {
            if let Some(call) = calls.remove(&token) {
                for ask in &call.asks {
                    book.lost(ask);
                }
            }
        }
    }

    /// The root's tick (`root`: its context id): the requests whose key has no call on its way
    /// (it was lost) get one, those waiting past `lease_timeout` are decided without the store.
    pub fn tick(&self, filter: &Rc<Filter>, root: u32, now: Now) {
        // A lease's bucket ended: settle it at once (the store takes back, after a grace, what
        // a holder did not settle).
        if self.book.borrow().roll_due(now.wall) {
            self.heartbeat(root, now);
        }
        let queued = std::mem::take(&mut *self.queued.borrow_mut());
        self.send(queued, root, now);
        let keys: Vec<FleetKey> = {
            let waiting = self.waiting.borrow();
            let calls = self.calls.borrow();
            waiting
                .iter()
                .filter(|(key, queue)| {
                    let expired = queue.iter().any(|(_, p)| !p.gone.get() && now.mono.saturating_since(p.since) >= self.timeout_ms);
                    let on_its_way = calls.values().any(|c| c.asks.iter().any(|a| a.key == **key && a.want > 0));
                    expired || !on_its_way
                })
                .map(|(key, _)| *key)
                .collect()
        };
        for key in keys {
            let resend = self.book.borrow_mut().resend(key, now.wall);
            if let Some(ask) = resend {
                self.send(vec![ask], root, now);
            }
            self.wake(filter, key, root, now);
        }
        let queued = std::mem::take(&mut *self.queued.borrow_mut());
        self.send(queued, root, now);
        // Waiting lists of requests that are all gone.
        self.waiting.borrow_mut().retain(|_, queue| queue.iter().any(|(_, p)| !p.gone.get()));
    }

    /// Once a second, and at the first tick of a bucket: the leases unused or of an ended
    /// bucket go back, in one call.
    pub fn heartbeat(&self, root: u32, now: Now) {
        let returns = self.book.borrow_mut().heartbeat(now.wall);
        stats::set(self.stats.keys, u64::try_from(self.book.borrow().keys()).unwrap_or(u64::MAX));
        stats::set(self.stats.held, self.book.borrow().held());
        self.send(returns, root, now);
    }

    /// Gives back the units a request took, another stage having refused it.
    pub fn untake(&self, taken: &Taken) {
        let mut book = self.book.borrow_mut();
        for (key, units) in &taken.units {
            book.untake(*key, *units, taken.at);
        }
    }

    /// Everything held goes back (the configuration is replaced).
    pub fn drain(&self, root: u32, now: Now) {
        let returns = self.book.borrow_mut().drain(now.wall);
        self.send(returns, root, now);
    }
}

impl Parked {
    /// Takes the stream that ran the rest of the pipeline, once the request was decided.
    pub fn take_resumed(&self) -> Option<FilterStream> {
        self.resumed.borrow_mut().take()
    }

    /// Whether the request still waits.
    pub fn waits(&self) -> bool {
        self.resumed.borrow().is_none() && !self.gone.get()
    }
}
