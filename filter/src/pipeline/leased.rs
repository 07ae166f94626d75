//! The `leased` stage: rules in `consistency: leased` ([`crate::fleet::leased`] keeps the proxy's
//! leases in shared data, and the keys this worker follows), the calls to `floodgate-sync`'s
//! `POST /v1/lease` that refill them, and this worker's requests that wait for an answer, listed
//! per key in arrival order.
//!
//! Invariants: one call per key is on its way at a time, for the whole proxy. A call goes from a
//! context that outlives it: the waiting request's own stream for the call it waits on, the root
//! context for everything else (refills, give-backs, a call sent again after its stream ended),
//! queued and sent at the root's next tick. An answer wakes this worker's requests waiting on its
//! keys: each takes its units again ([`super::resume`]) on its own stream state; requests waiting
//! on another worker's call are told through this worker's wake queue when it ends
//! ([`LeasedStage::take_notices`]), and look at their key again at every tick besides. A request
//! is decided as `on_store_failure` says once its key's call failed, or once it waited
//! `lease_timeout + timeout` ([`LeasedStage::overdue`]). Nothing here calls the host: calls to
//! send are queued ([`LeasedStage::take_outgoing`]).
//!
//! Rationale: docs/design.md, sections "A request's path" and "Leased consistency".

use super::stats::{self, increment, LeaseStats, Metrics, Stats};
use super::{Limits, Request, Shadows, SharedStream};
use crate::config::{Config, Consistency, Scope, StoreRoute};
use crate::fleet::Answer;
use crate::keys::fleet::{FleetHasher, FleetKey, FleetKeys};
use crate::fleet::leased::protocol;
use crate::fleet::leased::{Ask, LeaseBook, LeaseSpec, Refusal, Take, Terms, Waited};
use crate::primitives::store::SharedStore;
use crate::primitives::time::{MonoMillis, Now, UnixMillis};
use crate::ratelimit::estimate::BodyEstimates;
use crate::ratelimit::window::{Counts, Window};
use crate::ratelimit::rules::Later;
use crate::ratelimit::{Cause, Limiter, Probe, Standing, Verdict, Violation};
use crate::replies::{self, Reply};
use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::num::{NonZeroU32, NonZeroU64};


/// A request's key of one leased rule.
#[derive(Clone, Copy, Debug)]
pub struct LeaseProbe {
    /// The rule, the key's limit and the request's cost (as for any rule).
    pub probe: Probe,
    /// The key's fleet-wide id.
    pub key: FleetKey,
    /// The window and the limit.
    pub spec: LeaseSpec,
    /// A cost the upstream reports: the request takes an estimate, settled later.
    pub later: Later,
}

impl LeaseProbe {
    /// The units the request takes: its cost, and at least one.
    fn units(&self) -> u32 {
        self.probe.needs()
    }
}

/// A request waiting for the store (kept in its stream's state).
#[derive(Clone, Debug)]
pub struct StoreWait {
    /// Its keys of the leased rules.
    pub probes: Vec<LeaseProbe>,
    /// When it started to wait.
    pub since: MonoMillis,
    /// The key it waits on, and the units it wants of it.
    pub on: (FleetKey, u32),
    /// Whether the request headers ended the request.
    pub end_of_stream: bool,
    /// Request body seen while waiting: bytes, and whether it ended.
    pub body: (usize, bool),
}

/// The units a request took of the leased rules' keys.
#[derive(Clone, Debug, Default)]
pub struct Taken {
    /// Their standings, for the `RateLimit` fields.
    pub standings: Vec<Standing>,
    /// The keys and units, given back if a later stage refuses the request.
    pub units: Vec<(FleetKey, u32)>,
    /// When they were taken.
    pub at: UnixMillis,
    /// The standings of the rules in shadow that would have refused the request (they took
    /// nothing).
    pub shadowed: Vec<Standing>,
    /// The reservations among them, settled when the upstream reports (owed once the request
    /// goes on): the probe, the cost's source, the key's limit.
    pub owed: Vec<(Probe, Later, NonZeroU32)>,
}

/// A leased rule's refusal.
#[derive(Clone, Debug, PartialEq)]
pub struct Refused {
    /// The reply.
    pub reply: Reply,
    /// The refusing rule.
    pub rule: usize,
    /// Where its key stands, when the store could tell.
    pub standing: Option<Standing>,
}

/// How the leased rules took a request's units.
pub enum Admission {
    /// Every leased rule admitted it.
    All(Taken),
    /// Refused by a rule.
    Refused(Refused),
    /// It waits for the store, on this key, for these units.
    Wait(FleetKey, u32),
}

/// A call to send, from `owner` (the context whose callback runs when the host sends it).
#[derive(Clone, Debug)]
pub struct Outgoing {
    /// The context the call goes from.
    pub owner: u32,
    /// What it asks.
    pub asks: Vec<Ask>,
    /// Its body.
    pub body: Vec<u8>,
    /// Its timeout, ms.
    pub timeout_ms: u64,
}

/// A call on its way.
struct Call {
    /// The context that sent it (the one the host answers).
    owner: u32,
    asks: Vec<Ask>,
    sent: MonoMillis,
}

/// The requests waiting on one key: their context ids and streams, in arrival order.
pub type Waiting = VecDeque<(u32, SharedStream)>;

/// The leased rules of a configuration, the keys this worker follows of the proxy's leases, its
/// calls and its waiting requests.
pub struct LeasedStage {
    book: RefCell<LeaseBook>,
    /// Per rule, in configuration order: the window of a leased rule.
    windows: Vec<Option<Window>>,
    hasher: FleetHasher,
    /// Where the calls to floodgate-sync go, and their credential.
    pub route: StoreRoute,
    /// `lease_timeout`, ms: the timeout of the calls requests wait on.
    pub timeout_ms: u64,
    /// `timeout`, ms: the timeout of the calls the root sends (no request waits on them when
    /// they go; a slow answer is better than a failure that makes the keys decide without the
    /// store).
    background_timeout_ms: u64,
    /// The root context's id.
    root: u32,
    /// The proxy's id, which names it in its calls (the same on every worker).
    holder: u64,
    /// The start of the workers' wake queues' names.
    wake_prefix: String,
    calls: RefCell<HashMap<u32, Call>>,
    /// Calls for the host to send now (from the context whose callback runs).
    outgoing: RefCell<Vec<Outgoing>>,
    /// Calls the root sends at its next tick.
    queued: RefCell<Vec<Ask>>,
    /// Per key, the requests waiting on it.
    waiting: RefCell<HashMap<FleetKey, Waiting>>,
    /// Metric ids.
    pub stats: LeaseStats,
}

impl LeasedStage {
    /// The stage of `config`, if it has leased rules, under the root context `root` of VM `vm`
    /// in the proxy `holder`, whose leases are in shared data under `namespace`.
    pub fn new(config: &Config, namespace: &str, stats: LeaseStats, root: u32, vm: u64, holder: u64) -> Option<LeasedStage> {
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
        let background_timeout_ms = global.timeout.get().get().max(global.lease_timeout.get().get());
        Some(LeasedStage {
            book: RefCell::new(LeaseBook::new(
                namespace,
                max_keys,
                Terms {
                    period_ms: global.sync_interval.get().get(),
                    policy: global.on_store_failure,
                    max_lease: global.max_lease.map_or(u32::MAX, |m| m.get().get()),
                    lease_timeout_ms: global.lease_timeout.get().get(),
                    call_timeout_ms: background_timeout_ms,
                    caller: vm,
                },
            )),
            windows,
            hasher: FleetHasher::new(global.key_secret.as_deref()),
            route: global.route(),
            timeout_ms: global.lease_timeout.get().get(),
            root,
            holder,
            wake_prefix: format!("floodgate/{namespace}/lease-wake/"),
            background_timeout_ms,
            calls: RefCell::new(HashMap::new()),
            outgoing: RefCell::new(Vec::new()),
            queued: RefCell::new(Vec::new()),
            waiting: RefCell::new(HashMap::new()),
            stats,
        })
    }

    /// Whether rule `rule` is leased.
    pub fn is_leased(&self, rule: usize) -> bool {
        self.windows.get(rule).is_some_and(Option::is_some)
    }

    /// The request's keys of the leased rules that apply to it, with their limits and costs
    /// (`body`: the estimates its rules read in its body, `cost.estimate.body`).
    pub fn probes<R: Request + ?Sized>(&self, config: &Config, limits: &Limits, stats: &Stats, metrics: &dyn Metrics, request: &R, body: Option<&BodyEstimates>) -> Vec<LeaseProbe> {
        let rules = &limits.rules;
        let mut skipped = Vec::new();
        let mut keys = FleetKeys::default();
        let probes = crate::ratelimit::probes::probes_where(
            config,
            &limits.hasher,
            |source| request.fetch(source),
            &mut skipped,
            |rule| self.is_leased(rule) && rules.applies(rule, request),
            |index, rule, parts| keys.keep(&self.hasher, index, rule, parts),
        );
        for rule in skipped {
            increment(metrics, stats.rule(rule).skipped);
        }
        probes
            .into_iter()
            .filter_map(|mut probe| {
                let window = self.windows.get(probe.rule).copied().flatten()?;
                let key = keys.of(probe.rule)?;
                probe.limit = rules.limit(probe.rule, probe.key_hash, request);
                let limit = probe.limit.or_else(|| limits.limiter.tables().get(probe.rule).map(|t| t.limit))?;
                let admission = rules.admission(probe.rule, request, body);
                if admission.invalid {
                    increment(metrics, stats.rule(probe.rule).invalid_cost);
                }
                probe.cost = crate::ratelimit::rules::capped(admission.now, limit);
                Some(LeaseProbe { probe, key, spec: LeaseSpec { window, limit }, later: admission.later })
            })
            .collect()
    }

    /// Settles a reservation of a leased rule's key (`probe`, of fleet-wide id `key`, admitted at `admitted_at`) at
    /// `units`: the unused part goes back ([`LeaseBook::refund`]: to the lease in the bucket it
    /// was taken in, to the store after); a count above the reservation is charged as units
    /// admitted without a grant, reported with the key's next call ([`LeaseBook::consume`]).
    #[allow(clippy::too_many_arguments)]
    pub fn settle(&self, store: &dyn SharedStore, probe: &Probe, key: FleetKey, units: u32, limit: NonZeroU32, admitted_at: UnixMillis, now: UnixMillis) {
        let Some(window) = self.windows.get(probe.rule).copied().flatten() else { return };
        let reserved = probe.needs();
        let mut book = self.book.borrow_mut();
        let spec = LeaseSpec { window, limit };
        if units > reserved {
            book.consume(store, key, spec, units.saturating_sub(reserved), now);
        } else if units < reserved {
            book.refund(store, key, spec, reserved.saturating_sub(units), admitted_at, now);
        }
    }

    /// A new request: takes the units of every probe, or refuses it, or has it wait. The call
    /// it would wait on goes from its own stream (`context`, alive until the answer); a refill
    /// from the root.
    #[allow(clippy::too_many_arguments)]
    pub fn admit(&self, limiter: &Limiter, shadows: &Shadows, stats: &Stats, store: &dyn SharedStore, metrics: &dyn Metrics, probes: &[LeaseProbe], context: u32, now: Now) -> Admission {
        let mut sends = Vec::new();
        let admission = self.take_all(limiter, shadows, stats, store, metrics, probes, None, Waited::No, now, &mut sends);
        let waits_on = match &admission {
            Admission::Wait(key, _) => Some(*key),
            _ => None,
        };
        let (own, background): (Vec<Ask>, Vec<Ask>) = sends.into_iter().partition(|a| Some(a.key) == waits_on);
        self.send(own, context);
        self.queued.borrow_mut().extend(background);
        if waits_on.is_some() {
            increment(metrics, self.stats.waited);
        }
        admission
    }

    /// A waiting request, woken by an answer or a tick: takes its units again (`wait`: what it
    /// waits for); past `lease_timeout` it is decided without the store, unless a call of its
    /// key is on its way and not past its timeout ([`Waited`]). Calls it needs go from the root.
    #[allow(clippy::too_many_arguments)]
    pub fn decide(&self, limiter: &Limiter, shadows: &Shadows, stats: &Stats, store: &dyn SharedStore, metrics: &dyn Metrics, wait: &StoreWait, now: Now) -> Admission {
        let waited = if self.overdue(wait.since, now) { Waited::Overdue } else { Waited::Within };
        let mut sends = Vec::new();
        let admission = self.take_all(limiter, shadows, stats, store, metrics, &wait.probes, Some(wait.on.0), waited, now, &mut sends);
        self.queued.borrow_mut().extend(sends);
        if matches!(admission, Admission::All(_)) {
            stats::set(metrics, self.stats.wait_ms, now.mono.saturating_since(wait.since));
        }
        admission
    }

    /// Takes the units of every probe, or none (`waited_on`: the key the request waited for,
    /// `waited`: how long). Calls to send go to `sends`.
    #[allow(clippy::too_many_arguments)]
    fn take_all(
        &self,
        limiter: &Limiter,
        shadows: &Shadows,
        stats: &Stats,
        store: &dyn SharedStore,
        metrics: &dyn Metrics,
        probes: &[LeaseProbe],
        waited_on: Option<FleetKey>,
        waited: Waited,
        now: Now,
        sends: &mut Vec<Ask>,
    ) -> Admission {
        let mut book = self.book.borrow_mut();
        let mut standings = Vec::with_capacity(probes.len());
        let mut taken: Vec<&LeaseProbe> = Vec::with_capacity(probes.len());
        let mut shadowed = Vec::new();
        let admission = 'rules: {
            for lp in probes {
                let units = lp.units();
                // A request waits on one key: overdue, the others decide without the store too;
                // before, they take as for a new request.
                let waited = match waited {
                    Waited::Within if waited_on != Some(lp.key) => Waited::No,
                    other => other,
                };
                let (take, alone) = book.take(store, lp.key, lp.spec, units, waited, now.wall);
                if alone {
                    increment(metrics, self.stats.without_store);
                }
                match take {
                    Take::Admitted { counts, held, refill } => {
                        sends.extend(refill);
                        let mut standing = standing(limiter, lp, counts, now.wall);
                        standing.remaining = standing.remaining.saturating_add(u64::from(held));
                        standings.push(standing);
                        taken.push(lp);
                    }
                    Take::Wait { call } => {
                        sends.extend(call);
                        break 'rules Admission::Wait(lp.key, units);
                    }
                    Take::Refused { refusal, counts, refill } => {
                        sends.extend(refill);
                        let rule = lp.probe.rule;
                        let standing = standing(limiter, lp, counts, now.wall);
                        if shadows.rule(rule) {
                            // It takes nothing, as a refused request does; the others go on.
                            increment(metrics, stats.rule(rule).shadow_refused);
                            shadowed.push(standing);
                            continue;
                        }
                        let (reply, standing) = match refusal {
                            Refusal::OverLimit => {
                                let verdict = Verdict::Refused { violations: vec![Violation { standing, cause: Cause::OverLimit }] };
                                (replies::rate_limited(limiter, &verdict, now.wall), Some(standing))
                            }
                            Refusal::StoreDown => (None, None),
                        };
                        increment(metrics, stats.rule(rule).refused);
                        break 'rules Admission::Refused(Refused {
                            reply: reply.unwrap_or_else(|| replies::quota_store_unavailable(limiter, rule)),
                            rule,
                            standing,
                        });
                    }
                }
            }
            for lp in &taken {
                increment(metrics, stats.rule(lp.probe.rule).allowed);
            }
            let units = taken.iter().map(|lp| (lp.key, lp.units())).collect();
            let owed = taken.iter().filter(|lp| lp.later != Later::Nothing).map(|lp| (lp.probe, lp.later, lp.spec.limit)).collect();
            return Admission::All(Taken { standings, units, at: now.wall, shadowed, owed });
        };
        for lp in taken {
            book.untake(store, lp.key, lp.units(), now.wall);
        }
        admission
    }

    /// Queues one call from `owner` (nothing for no asks).
    fn send(&self, asks: Vec<Ask>, owner: u32) {
        if asks.is_empty() {
            return;
        }
        let body = protocol::body(&asks, self.holder);
        let timeout_ms = if owner == self.root { self.background_timeout_ms } else { self.timeout_ms };
        self.outgoing.borrow_mut().push(Outgoing { owner, asks, body, timeout_ms });
    }

    /// The calls for the host to send now, each from its owner.
    pub fn take_outgoing(&self) -> Vec<Outgoing> {
        std::mem::take(&mut *self.outgoing.borrow_mut())
    }

    /// Whether call `token` is a lease call of this stage.
    pub fn owns(&self, token: u32) -> bool {
        self.calls.borrow().contains_key(&token)
    }

    /// The host sent `call` as `token`.
    pub fn sent(&self, metrics: &dyn Metrics, call: Outgoing, token: u32, now: Now) {
        increment(metrics, self.stats.calls);
        self.calls.borrow_mut().insert(token, Call { owner: call.owner, asks: call.asks, sent: now.mono });
    }

    /// The host could not send `call`: its keys decide without the store until they retry
    /// (their waiting requests are decided at the next tick).
    pub fn not_sent(&self, store: &dyn SharedStore, metrics: &dyn Metrics, call: &Outgoing, now: Now) {
        increment(metrics, self.stats.failures);
        let mut book = self.book.borrow_mut();
        for ask in &call.asks {
            book.answered(store, ask, None, now.wall);
        }
    }

    /// The answer to call `token`: the keys whose waiting requests it wakes (`None`: not a
    /// lease call).
    pub fn answered(&self, store: &dyn SharedStore, metrics: &dyn Metrics, token: u32, answer: Answer, now: Now) -> Option<Vec<FleetKey>> {
        let call = self.calls.borrow_mut().remove(&token)?;
        let grants = match answer {
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
                        stats::add_count(metrics, self.stats.granted, u64::from(grant.granted));
                        let back = [ask.returned, ask.returned_previous, ask.refunded, ask.refunded_previous].iter().map(|n| u64::from(*n)).sum();
                        stats::add_count(metrics, self.stats.returned, back);
                        book.answered(store, ask, Some(*grant), now.wall);
                    }
                }
                None => {
                    increment(metrics, self.stats.failures);
                    for ask in &call.asks {
                        book.answered(store, ask, None, now.wall);
                    }
                }
            }
        }
        stats::set(metrics, self.stats.call_ms, now.mono.saturating_since(call.sent));
        Some(call.asks.iter().filter(|a| a.want > 0).map(|a| a.key).collect())
    }

    /// Lists `stream` (context `context`) as waiting on `key`.
    pub fn park(&self, key: FleetKey, context: u32, stream: SharedStream) {
        self.waiting.borrow_mut().entry(key).or_default().push_back((context, stream));
    }

    /// Takes the requests waiting on `key`, to be decided again in order.
    pub fn take_waiting(&self, key: FleetKey) -> Waiting {
        self.waiting.borrow_mut().remove(&key).unwrap_or_default()
    }

    /// A waiting request will never be decided (its stream is gone): its units are not wanted.
    pub fn abandon(&self, store: &dyn SharedStore, wait: &StoreWait, now: Now) {
        let (on, units) = wait.on;
        self.book.borrow_mut().abandon(store, on, units, now.wall);
    }

    /// Stream `context` ended (`wait`: what it still waited for): its request stops waiting,
    /// and the calls it sent are lost (the host cancels them): their keys' waiting requests get
    /// a new call at the next tick.
    pub fn stream_ended(&self, store: &dyn SharedStore, context: u32, wait: Option<&StoreWait>, now: Now) {
        if let Some(wait) = wait {
            self.abandon(store, wait, now);
        }
        let mut calls = self.calls.borrow_mut();
        let lost: Vec<u32> = calls.iter().filter(|(_, c)| c.owner == context).map(|(t, _)| *t).collect();
        let mut book = self.book.borrow_mut();
        for token in lost {
            if let Some(call) = calls.remove(&token) {
                for ask in &call.asks {
                    book.lost(store, ask, now.wall);
                }
            }
        }
    }

    /// The root's tick: a lease whose bucket ended is settled; the keys whose waiting requests
    /// have no call of this worker on its way (another worker's, or one that was lost), and
    /// those with an overdue request ([`LeasedStage::overdue`]), are to be decided again:
    /// returns the keys to wake. The calls they need, and the root's queued ones, go from the root.
    pub fn tick(&self, store: &dyn SharedStore, metrics: &dyn Metrics, now: Now) -> Vec<FleetKey> {
        if self.book.borrow().roll_due(now.wall) {
            self.heartbeat(store, metrics, now);
        }
        let keys: Vec<FleetKey> = {
            let waiting = self.waiting.borrow();
            let calls = self.calls.borrow();
            waiting
                .iter()
                .filter(|(key, queue)| {
                    let overdue = queue.iter().any(|(_, s)| s.borrow().waiting_since().is_some_and(|since| self.overdue(since, now)));
                    let on_its_way = calls.values().any(|c| c.asks.iter().any(|a| a.key == **key && a.want > 0));
                    overdue || !on_its_way
                })
                .map(|(key, _)| *key)
                .collect()
        };
        // Waiting lists of requests that are all gone.
        self.waiting.borrow_mut().retain(|_, queue| queue.iter().any(|(_, s)| s.borrow().waiting_since().is_some()));
        keys
    }

    /// Whether a request waiting since `since` waited as long as any call of its key can take
    /// (`lease_timeout + timeout`): it is decided without the store.
    pub fn overdue(&self, since: MonoMillis, now: Now) -> bool {
        now.mono.saturating_since(since) >= self.timeout_ms.saturating_add(self.background_timeout_ms)
    }

    /// The workers to tell that a call of a key their requests wait on ended, and the key:
    /// each looks at it at once when told (the host's shared queue [`LeasedStage::wake_queue`]
    /// of that worker).
    pub fn take_notices(&self) -> Vec<(u64, FleetKey)> {
        self.book.borrow_mut().take_notices()
    }

    /// The name of worker `vm`'s queue of keys to look at again.
    pub fn wake_queue(&self, vm: u64) -> String {
        format!("{}{vm:016x}", self.wake_prefix)
    }

    /// The root's queued calls go out (at its tick, after the keys it woke queued theirs).
    pub fn flush(&self) {
        let queued = std::mem::take(&mut *self.queued.borrow_mut());
        self.send(queued, self.root);
    }

    /// Once a second, and at the first tick of a bucket: the leases unused or of an ended
    /// bucket go back, in one call from the root.
    pub fn heartbeat(&self, store: &dyn SharedStore, metrics: &dyn Metrics, now: Now) {
        let returns = self.book.borrow_mut().heartbeat(store, now.wall);
        stats::set(metrics, self.stats.keys, u64::try_from(self.book.borrow().keys()).unwrap_or(u64::MAX));
        stats::set(metrics, self.stats.held, self.book.borrow().held());
        self.send(returns, self.root);
    }

    /// Gives back the units a request took, another stage having refused it.
    pub fn untake(&self, store: &dyn SharedStore, taken: &Taken) {
        let mut book = self.book.borrow_mut();
        for (key, units) in &taken.units {
            book.untake(store, *key, *units, taken.at);
        }
    }

    /// Everything held goes back (the configuration is replaced), from the root.
    pub fn drain(&self, store: &dyn SharedStore, now: Now) {
        let returns = self.book.borrow_mut().drain(store, now.wall);
        self.send(returns, self.root);
    }
}

/// Where a key stands with the fleet's `counts`.
fn standing(limiter: &Limiter, lp: &LeaseProbe, counts: Counts, now: UnixMillis) -> Standing {
    limiter.standing_of(&lp.probe, counts, now).unwrap_or(Standing {
        rule: lp.probe.rule,
        estimate: 0.0,
        remaining: 0,
        reset_ms: 0,
        retry_at: None,
        limit: lp.spec.limit,
        go_at: None,
    })
}
