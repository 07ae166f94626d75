//! The stages' decisions on one stream: each takes what it needs of the request and the parts
//! of the filter it uses (the walk hands them over), and lets the request go on (holding what
//! it took in the stream) or answers it.
//!
//! Invariant: a stage records in the stream what it took before it returns, so that what it
//! holds goes back whatever a later stage decides.

use crate::config::{Config, Dependencies, Health, KeyPart, RateLimitHeaders};
use crate::keys;
use crate::keys::KeyHasher;
use crate::primitives::hash::Random;
use crate::primitives::time::{MonoMillis, UnixMillis};
use crate::ratelimit::rules::{self, Later, Rules};
use crate::ratelimit::{Cause, Limiter, Probe, Standing, Verdict, Violation};
use crate::replies::{self, Reply};
use crate::selection::Confinement;
use crate::shedding::per_key::CapRefusal;
use crate::watchdog::Watchdog;
use super::*;
use super::leased::{LeasedStage, StoreWait};
use super::walk::Next;
use crate::keys::fleet::FleetKey;
use crate::primitives::time::Now;
use super::decision::By;
use super::delay::Delayed;
use super::leased::Taken;
use super::queue::{FairSlot, QueueStage, Queued, Ready};
use super::stats;
use crate::shedding::fair::{Arrival, Victim};
use crate::shedding::flows::FlowClass;
use super::stats::{increment, Stats};

impl Stream {
    /// The `body` stage: a request whose estimate a rule that applies reads in its body waits
    /// for the body (the stage exists only where some rule reads its estimate in request
    /// bodies). Nothing is taken yet: a client that goes away now leaves nothing behind.
    pub(super) fn body_wait<R: Request + ?Sized>(&mut self, waits: &Waits, rules: &Rules, request: &R, end_of_stream: bool) -> Next {
        if end_of_stream || waits.body_waits.as_ref().is_none_or(|s| s.withheld()) {
            return Next::Go;
        }
        let Some(estimates) = rules.body_estimates(request) else { return Next::Go };
        self.wait = Some(Wait::Body(Box::new(estimates)));
        Next::Wait(Waiting::Body)
    }

    /// The `queue` stage: a request `shed` let wait for a slot ([`Stream::wait_for_slot`])
    /// waits here.
    pub(super) fn queue(&self) -> Next {
        match &self.wait {
            Some(Wait::Slot(_)) => Next::Wait(Waiting::Slot),
            _ => Next::Go,
        }
    }

    /// The `leased` stage: takes the request's units of the leased rules' keys, or, for a
    /// request the store's answer woke (its wait for the store is in the stream), takes them
    /// again with the answer.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn lease<H: Host, R: Request + ?Sized>(
        &mut self,
        leased: Option<&LeasedStage>,
        config: &Config,
        limits: &Limits,
        shadows: &Shadows,
        stats: &Stats,
        env: &Env<'_, H>,
        request: &R,
        context: u32,
        end_of_stream: bool,
        now: Now,
    ) -> Next {
        let Some(stage) = leased else { return Next::Go };
        if let Some(Wait::Store(wait)) = self.take_wait(Waiting::Store) {
            let admission = stage.decide(&limits.limiter, shadows, stats, env.store, env.metrics, &wait, now);
            return self.leased_admission(admission, |on| StoreWait { on, ..wait });
        }
        let probes = stage.probes(config, limits, stats, env.metrics, request, self.estimates.as_deref());
        if probes.is_empty() {
            return Next::Go;
        }
        for probe in &probes {
            self.fleet_keys.insert(probe.probe.rule, probe.key);
        }
        let admission = stage.admit(&limits.limiter, shadows, stats, env.store, env.metrics, &probes, context, now);
        self.leased_admission(admission, |on| StoreWait { probes, since: now.mono, on, end_of_stream, body: (0, false) })
    }

    /// What the leased rules' `admission` makes of the request: it goes on holding the units
    /// it took, is refused, or waits for the store (`wait`, for the key and units it waits on).
    fn leased_admission(&mut self, admission: leased::Admission, wait: impl FnOnce((FleetKey, u32)) -> StoreWait) -> Next {
        match admission {
            leased::Admission::All(taken) => {
                self.took(taken);
                Next::Go
            }
            leased::Admission::Refused(refusal) => Next::Reply(self.leased_refusal(refusal)),
            leased::Admission::Wait(key, units) => {
                self.wait = Some(Wait::Store(wait((key, units))));
                Next::Wait(Waiting::Store)
            }
        }
    }

    /// The `rate_limit` stage's step, once the rules decided the request ([`Stream::rate_limit`]:
    /// `reply`): for a batched global rule, it waits for its ask's answer first ([`asked`]);
    /// decided with the answer, its wait is over.
    pub(super) fn rate_limit_or_ask(&mut self, reply: Option<Reply>, end_of_stream: bool) -> Next {
        match self.wait.as_mut() {
            Some(Wait::Asked(asking)) if asking.outcomes.is_none() => {
                asking.end_of_stream = end_of_stream;
                return Next::Wait(Waiting::Asked);
            }
            Some(Wait::Asked(_)) => self.wait = None,
            _ => {}
        }
        reply.into()
    }

    /// The `delay` stage: a request a token bucket let in to wait for its turn
    /// ([`Stream::delay_for_turn`]) waits here until it comes.
    pub(super) fn delay(&mut self, end_of_stream: bool, now: Now) -> Next {
        let Some(Wait::Turn(delayed)) = self.wait.as_mut() else { return Next::Go };
        delayed.until = now.mono.plus_ms(delayed.go_at.saturating_since(now.wall));
        delayed.since = now.mono;
        delayed.end_of_stream = end_of_stream;
        Next::Wait(Waiting::Turn)
    }

    /// The leased rules took the request's units (shadow rules that would have refused it
    /// took none).
    pub(super) fn took(&mut self, taken: Taken) {
        for standing in &taken.shadowed {
            self.decision.shadow(By::Rule(standing.rule), Some(standing));
        }
        self.leased = taken;
    }

    /// A leased rule refused the request.
    fn leased_refusal(&mut self, refusal: leased::Refused) -> Reply {
        self.decision.refused(decision::Outcome::Refused, By::Rule(refusal.rule), refusal.standing.as_ref());
        refusal.reply
    }

    /// The paths the filter answers itself, if this request is for one: a `GET` or `HEAD` of
    /// the health endpoint's or the watchdog's path. Other methods on those paths are ordinary
    /// requests (they go on to the upstream, through the other stages). Without either, nothing
    /// is read; with them, `:path` is (one lookup, and one comparison per path).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn endpoints<H: Host, R: Request + ?Sized>(
        &mut self,
        health: Option<&Health>,
        watchdog: Option<&Watchdog>,
        shedding: &Shedding,
        selection: &Selection,
        waits: &Waits,
        env: &Env<'_, H>,
        request: &R,
        now: MonoMillis,
    ) -> Option<Reply> {
        if health.is_none() && watchdog.is_none() {
            return None;
        }
        let path = request.get(":path")?;
        let path = KeyPart::Path.normalize(&path);
        let health = health.filter(|h| path == h.path.as_bytes());
        let dog = watchdog.filter(|w| health.is_none() && path == w.path.as_bytes());
        if health.is_none() && dog.is_none() {
            return None;
        }
        // Read only for those paths (one host call there, none on the common path).
        let method = request.get(":method")?;
        if !replies::is_health_method(&method) {
            return None;
        }
        if let Some(dog) = dog {
            let verdict = dog.verdict(env.store, now);
            if !verdict.alive() {
                log::warn!("floodgate: the watchdog fails liveness: {verdict:?}");
            }
            self.decision.outcome = decision::Outcome::Watchdog;
            return Some(replies::liveness(dog, &verdict));
        }
        self.health(health?, shedding, selection, waits, env, now)
    }

    /// The health endpoint's answer: the proxy-wide in-flight count (and queue), this worker's
    /// loop lag, and, when configured, the clusters.
    pub(super) fn health<H: Host>(&mut self, health: &Health, shedding: &Shedding, selection: &Selection, waits: &Waits, env: &Env<'_, H>, now: MonoMillis) -> Option<Reply> {
        let in_flight = shedding.shedder.as_ref().map(|s| (s, s.in_flight(env.store, env.vm, &shedding.local, now)));
        let lag = shedding.lag.as_ref().map(|lag| {
            let lag = lag.borrow();
            let default_class = shedding.classes.as_ref().map_or(0, |c| c.default_class);
            replies::LagStatus {
                lag_ms: lag.lag_ms(),
                max_loop_lag_ms: lag.max_loop_lag_ms(),
                sheds_default_class: lag.sheds(default_class).is_some(),
                shedding: lag.is_shedding(),
            }
        });
        let dependencies = match (health.dependencies, selection.selector.as_ref()) {
            (Dependencies::Off, _) | (_, None) => None,
            (mode, Some(selector)) => {
                let states = selector.states(env.store, &selection.vm.borrow(), now);
                let clusters = selector
                    .clusters
                    .iter()
                    .zip(states)
                    .filter_map(|(cluster, state)| {
                        let state = state?;
                        Some(replies::ClusterHealth {
                            name: cluster.name.as_str().to_owned(),
                            success_rate: state.success_rate,
                            limit: state.limit,
                            in_flight: state.in_flight,
                        })
                    })
                    .collect();
                Some(replies::DependencyView { fail: mode == Dependencies::Fail, min_success_rate: health.min_success_rate.get(), clusters })
            }
        };
        let queued = waits.queue.as_ref().map(|stage| stage.waiting(env, now));
        Some(replies::health(&replies::LocalLoad { in_flight, queued, lag }, dependencies.as_ref()))
            .inspect(|_| self.decision.outcome = decision::Outcome::Health)
    }

    /// Load shedding: on this worker's loop lag, then on the proxy-wide in-flight count (taking
    /// a permit); returns the 503 of either. With a queue, a request the in-flight count would
    /// shed, or that finds a waiter ahead of it, waits instead (`queued` set) while its class's
    /// queue has room. In a class shared by flow, its flow's fair queue decides
    /// ([`Stream::shed_fairly`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn shed<H: Host, R: Request + ?Sized>(
        &mut self,
        shedding: &Shedding,
        waits: &Waits,
        hasher: &KeyHasher,
        stats: &Stats,
        shadows: &Shadows,
        env: &Env<'_, H>,
        request: &R,
        end_of_stream: bool,
        now: MonoMillis,
    ) -> Option<Reply> {
        let classes = shedding.classes.as_ref()?;
        let value = request.get(&classes.priority_header);
        let class = classes.class_of(value.as_deref());
        let shadow = shadows.shedding;
        if let Some(lag) = &shedding.lag {
            let lag = lag.borrow();
            if let Some(shed) = lag.sheds(class) {
                if shadow {
                    // Shed requests hold no permit: neither does this one.
                    increment(env.metrics, stats.class(class).shadow_shed);
                    self.decision.shadow(By::LoopLag, None);
                    return None;
                }
                increment(env.metrics, stats.class(class).shed);
                increment(env.metrics, stats.class(class).shed_by_lag);
                log::debug!("floodgate: shed for the loop lag {shed:?}");
                self.decision.refused(decision::Outcome::Shed, By::LoopLag, None);
                return Some(replies::shed_by_lag(classes, &lag, &shed, shedding.retry_after_secs));
            }
        }
        let shedder = shedding.shedder.as_ref()?;
        if let Some(stage) = waits.queue.as_ref().filter(|q| q.flows.is_some()) {
            if let Some(decided) = self.shed_by_flow_class(shedding, stage, hasher, stats, env, request, class, shadow, end_of_stream, now) {
                return decided;
            }
        }
        let queue = waits.queue.as_ref().filter(|_| !shadow);
        if let Some(stage) = queue.filter(|stage| stage.must_wait(env, class, now)) {
            // Waiters come first: it waits behind them.
            let in_flight = || shedder.in_flight(env.store, env.vm, &shedding.local, now);
            return self.wait_for_slot(shedding, stats, env, stage, class, end_of_stream, in_flight, now);
        }
        match shedder.try_acquire(env.store, env.vm, &shedding.local, class, now) {
            Ok(permit) => {
                self.permit = Some(permit);
                None
            }
            Err(shed) => {
                if shed.contention {
                    increment(env.metrics, stats.shedding.contention);
                }
                if shadow {
                    increment(env.metrics, stats.class(class).shadow_shed);
                    self.decision.shadow(By::InFlight, None);
                    self.give_back_fair_slot(waits, env, now);
                    return None;
                }
                if let Some(stage) = queue.filter(|_| !shed.contention) {
                    return self.wait_for_slot(shedding, stats, env, stage, class, end_of_stream, || shed.in_flight, now);
                }
                increment(env.metrics, stats.class(class).shed);
                log::debug!("floodgate: shed {shed:?}");
                self.decision.refused(decision::Outcome::Shed, By::InFlight, None);
                Some(replies::shed(shedder, &shed))
            }
        }
    }

    /// Load shedding with flows. In a class shared by flow its flow decides, and the answer is
    /// `Some` of what [`Stream::shed_fairly`] decided; in shadow it is `Some(None)` for a
    /// request that would have waited for its flow (counted; it goes on holding nothing). `None`
    /// (the in-flight count decides) in a class without a flow key, and in shadow for a request
    /// its flow let go (holding its fair slot).
    #[allow(clippy::too_many_arguments)]
    #[inline(never)]
    fn shed_by_flow_class<H: Host, R: Request + ?Sized>(
        &mut self,
        shedding: &Shedding,
        stage: &QueueStage,
        hasher: &KeyHasher,
        stats: &Stats,
        env: &Env<'_, H>,
        request: &R,
        class: usize,
        shadow: bool,
        end_of_stream: bool,
        now: MonoMillis,
    ) -> Option<Option<Reply>> {
        let fair = stage.flows.as_ref()?.class(class)?;
        let flow = keys::hash_key(&fair.flow_key, hasher, |source| request.fetch(source)).unwrap_or(0);
        if !shadow {
            return Some(self.shed_fairly(shedding, stage, fair, stats, env, class, flow, end_of_stream, now));
        }
        self.would_wait_for_its_flow(fair, stats, env, class, flow, now).then_some(None)
    }

    /// Load shedding in a class shared by flow: the request takes a slot the in-flight count
    /// has room for if its flow's fair queue is due one (no request of a flow holding less
    /// waits), else waits in that queue; when the class's queue is full, the request shed is
    /// the newest of the flow holding the most, which may be this one (its `503`) or a waiter
    /// elsewhere (shed at its worker's next tick).
    #[allow(clippy::too_many_arguments)]
    fn shed_fairly<H: Host>(
        &mut self,
        shedding: &Shedding,
        stage: &QueueStage,
        fair: &FlowClass,
        stats: &Stats,
        env: &Env<'_, H>,
        class: usize,
        flow: u64,
        end_of_stream: bool,
        now: MonoMillis,
    ) -> Option<Reply> {
        let shedder = shedding.shedder.as_ref()?;
        let contended = |this: &mut Stream, shed: crate::shedding::Shed| {
            increment(env.metrics, stats.shedding.contention);
            increment(env.metrics, stats.class(class).shed);
            this.decision.refused(decision::Outcome::Shed, By::InFlight, None);
            Some(replies::shed(shedder, &shed))
        };
        // Waiters of a class ranked above it in the proxy's line come first.
        let permit = if stage.must_wait(env, class, now) {
            None
        } else {
            match shedder.try_acquire(env.store, env.vm, &shedding.local, class, now) {
                Ok(permit) => Some(permit),
                Err(shed) if shed.contention => return contended(self, shed),
                Err(_) => None,
            }
        };
        let arrived = match fair.arrive(env.store, flow, permit.is_some(), now) {
            Ok(arrived) => arrived,
            Err(_) => {
                if let Some(permit) = permit {
                    shedder.release(env.store, env.vm, permit, now);
                }
                let in_flight = shedder.in_flight(env.store, env.vm, &shedding.local, now);
                return contended(self, crate::shedding::Shed { in_flight, class, contention: true });
            }
        };
        match arrived.arrival {
            Arrival::Admitted(slot) => {
                self.permit = permit;
                self.fair_slot = Some(FairSlot { class, slot });
                stats::set(env.metrics, stats.flow(class).flow_wait_ms, 0);
                None
            }
            Arrival::Queued(place) | Arrival::Shed(Victim::Waiter { place, .. }) => {
                if let Some(permit) = permit {
                    shedder.release(env.store, env.vm, permit, now);
                }
                let ticket = crate::shedding::queue::Ticket { class, ticket: place.ticket, wait_ms: arrived.wait_ms };
                let queued = stage.enter_fair(stats, env, ticket, place.queue, end_of_stream, now);
                log::debug!("floodgate: waits for a slot of its flow's queue {place:?}");
                self.wait = Some(Wait::Slot(queued));
                None
            }
            Arrival::Shed(Victim::Arrival) => {
                if let Some(permit) = permit {
                    shedder.release(env.store, env.vm, permit, now);
                }
                increment(env.metrics, stats.class(class).shed);
                increment(env.metrics, stats.flow(class).shed_by_flow);
                let shed = crate::shedding::Shed { in_flight: shedder.in_flight(env.store, env.vm, &shedding.local, now), class, contention: false };
                log::debug!("floodgate: shed, its flow holds the most {:?}", arrived.share);
                self.decision.by_flow(decision::Outcome::Shed, arrived.share);
                Some(replies::shed_by_flow(shedder, &shed, &arrived.share, None))
            }
        }
    }

    /// In shadow, in a class shared by flow: the request takes a slot of its flow's fair queue
    /// (held while it holds an in-flight permit, so the class sees its load); returns whether
    /// it would have waited for its flow instead of going on (counted as a shadow shed).
    fn would_wait_for_its_flow<H: Host>(&mut self, fair: &FlowClass, stats: &Stats, env: &Env<'_, H>, class: usize, flow: u64, now: MonoMillis) -> bool {
        let Ok((slot, due, share)) = fair.arrive_in_shadow(env.store, flow, now) else { return false };
        if due {
            self.fair_slot = Some(FairSlot { class, slot });
            return false;
        }
        fair.release(env.store, &slot, now);
        increment(env.metrics, stats.class(class).shadow_shed);
        log::debug!("floodgate: in shadow, would wait for its flow {share:?}");
        self.decision.by_flow(decision::Outcome::ShadowRefused, share);
        true
    }

    /// A request that holds a fair slot but no in-flight permit (in shadow, shed) gives it back.
    fn give_back_fair_slot<H: Host>(&mut self, waits: &Waits, env: &Env<'_, H>, now: MonoMillis) {
        let Some(held) = self.fair_slot.take() else { return };
        if let Some(fair) = waits.queue.as_ref().and_then(|q| q.flows.as_ref()).and_then(|f| f.class(held.class)) {
            fair.release(env.store, &held.slot, now);
        }
    }

    /// Load leveling: the request takes a ticket of its class and waits for a slot (`None`), or,
    /// its class's queue full, is shed (`in_flight`: the count, for the reply).
    #[allow(clippy::too_many_arguments)]
    fn wait_for_slot<H: Host>(
        &mut self,
        shedding: &Shedding,
        stats: &Stats,
        env: &Env<'_, H>,
        stage: &QueueStage,
        class: usize,
        end_of_stream: bool,
        in_flight: impl FnOnce() -> u32,
        now: MonoMillis,
    ) -> Option<Reply> {
        let shedder = shedding.shedder.as_ref()?;
        match stage.enter(stats, env, class, end_of_stream, now) {
            Ok(queued) => {
                log::debug!("floodgate: waits for a slot {:?}", queued.ticket);
                self.wait = Some(Wait::Slot(queued));
                None
            }
            Err(no_room) => {
                let contention = no_room == crate::shedding::queue::NoRoom::Contention;
                if contention {
                    increment(env.metrics, stats.shedding.contention);
                }
                increment(env.metrics, stats.class(class).shed);
                let shed = crate::shedding::Shed { in_flight: in_flight(), class, contention };
                log::debug!("floodgate: shed, no room to wait ({no_room:?}) {shed:?}");
                self.decision.refused(decision::Outcome::Shed, By::InFlight, None);
                Some(replies::shed(shedder, &shed))
            }
        }
    }

    /// A request's wait for a slot ended without one (`waited_ms` long): the shed `503`; in a
    /// class shared by flow, the one by flow when a lighter flow's request took its place or
    /// its flow, holding the most, waited CoDel's `target`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn wait_ended<H: Host>(&mut self, shedding: &Shedding, waits: &Waits, stats: &Stats, env: &Env<'_, H>, queued: &Queued, waited_ms: u64, now: MonoMillis) -> Option<Reply> {
        let shedder = shedding.shedder.as_ref()?;
        let class = queued.ticket.class;
        increment(env.metrics, stats.class(class).shed);
        let shed = crate::shedding::Shed { in_flight: shedder.in_flight(env.store, env.vm, &shedding.local, now), class, contention: false };
        let fair = waits.queue.as_ref().and_then(|q| q.flows.as_ref()).and_then(|f| f.class(class));
        let by_flow = match (queued.ready, fair, queued.fair_queue) {
            (Some(Ready::Evicted(share)), _, _) => Some(share),
            (_, Some(fair), Some(queue)) if queued.ticket.wait_ms < fair.limits().max_wait_ms() => Some(fair.share(env.store, queue)),
            _ => None,
        };
        if let Some(share) = by_flow {
            increment(env.metrics, stats.flow(class).shed_by_flow);
            log::debug!("floodgate: shed after waiting {waited_ms} ms, its flow holds the most {share:?}");
            self.decision.by_flow(decision::Outcome::Shed, share);
            return Some(replies::shed_by_flow(shedder, &shed, &share, Some(waited_ms)));
        }
        log::debug!("floodgate: shed after waiting {waited_ms} ms {shed:?}");
        self.decision.refused(decision::Outcome::Shed, By::InFlight, None);
        Some(replies::shed_after_wait(shedder, &shed, waited_ms))
    }

    /// The per-key cap: takes a unit of the request's key's in-flight cap, or returns its 503.
    /// A request without the key is not capped.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn cap<H: Host, R: Request + ?Sized>(
        &mut self,
        shedding: &Shedding,
        hasher: &KeyHasher,
        stats: &Stats,
        shadows: &Shadows,
        env: &Env<'_, H>,
        request: &R,
        now: MonoMillis,
    ) -> Option<Reply> {
        let cap = shedding.per_key.as_ref()?;
        let Some(key) = keys::hash_key(&cap.key, hasher, |source| request.fetch(source)) else {
            increment(env.metrics, stats.shedding.per_key_unkeyed);
            return None;
        };
        match cap.try_acquire(env.store, env.vm, &shedding.key_counts, key, now) {
            Ok(permit) => {
                self.key_permit = Some(permit);
                None
            }
            Err(refusal) => {
                if shadows.per_key {
                    increment(env.metrics, stats.shedding.per_key_shadow_refused);
                    self.decision.shadow(By::PerKey, None);
                    return None;
                }
                increment(
                    env.metrics,
                    match refusal {
                        CapRefusal::Full { .. } => stats.shedding.per_key_refused,
                        CapRefusal::Untracked => stats.shedding.per_key_untracked,
                    },
                );
                log::debug!("floodgate: per-key cap {refusal:?}");
                self.decision.refused(decision::Outcome::Capped, By::PerKey, None);
                Some(replies::per_key_capped(cap, &refusal, shedding.retry_after_secs))
            }
        }
    }

    /// Rate limiting: records the admission in every applicable rule, or returns the 429.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rate_limit<H: Host, R: Request + ?Sized>(
        &mut self,
        config: &Config,
        limits: &Limits,
        fleet: &Fleet,
        shadows: &Shadows,
        stats: &Stats,
        waits: &Waits,
        selection: &Selection,
        env: &Env<'_, H>,
        request: &R,
        now: UnixMillis,
    ) -> Option<Reply> {
        if config.rate_limits.is_empty() {
            return None;
        }
        let mut skipped = Vec::new();
        let rules = &limits.rules;
        let headers = request;
        let fleet_keys = &mut self.fleet_keys;
        let mut probes = crate::ratelimit::probes::probes_where(
            config,
            &limits.hasher,
            |source| request.fetch(source),
            &mut skipped,
            |rule| !fleet.leased.as_ref().is_some_and(|l| l.is_leased(rule)) && rules.applies(rule, headers),
            |index, rule, parts| {
                if let Some(scope) = &fleet.global {
                    fleet_keys.keep(&scope.hasher, index, rule, parts);
                }
            },
        );
        // What the rest of the fleet adds to each key's counts, by rule (none in proxy scope).
        let mut remotes = Vec::new();
        if let (Some(scope), Some(node)) = (&fleet.global, &fleet.global_node) {
            remotes = scope.remotes(&node.borrow(), &probes, now);
            if let Some(asking) = self.asking() {
                asked::apply_outcomes(asking, scope, &node.borrow(), &probes, &mut remotes);
            }
        }
        // Each rule's limit for the key and the request's cost against it.
        let mut later = Vec::new();
        let mut invalid = Vec::new();
        for probe in &mut probes {
            probe.limit = rules.limit(probe.rule, probe.key_hash, headers);
            let limit = probe.limit.or_else(|| limits.limiter.tables().get(probe.rule).map(|t| t.limit));
            let admission = rules.admission(probe.rule, headers, self.estimates.as_deref());
            if admission.invalid {
                invalid.push(probe.rule);
            }
            probe.cost = limit.map_or(admission.now, |limit| rules::capped(admission.now, limit));
            if let (Later::BodyBytes | Later::ResponseHeader | Later::ResponseBody, Some(limit)) = (admission.later, limit) {
                later.push((*probe, admission.later, limit));
            }
        }
        let mut verdict = limits.limiter.check(env.store, &mut limits.reserves.borrow_mut(), &probes, &remotes, now);
        // Rules in shadow: a request only they refuse goes on, counted by the other rules alone.
        let (mut shadowed, mut shadow_refusals) = (Vec::new(), Vec::new());
        if shadows.any_rule() {
            while let Verdict::Refused { violations } = &verdict {
                if !violations.iter().all(|v| shadows.rule(v.standing.rule)) {
                    break;
                }
                shadow_refusals.extend(violations.iter().copied());
                let (refused, admitting): (Vec<Probe>, Vec<Probe>) =
                    probes.iter().partition(|p| violations.iter().any(|v| v.standing.rule == p.rule));
                shadowed.extend(refused);
                probes = admitting;
                verdict = limits.limiter.check(env.store, &mut limits.reserves.borrow_mut(), &probes, &remotes, now);
            }
        }
        if let (Some(scope), Some(node), Some(stage), None) = (&fleet.global, &fleet.global_node, &fleet.asks, self.asking()) {
            // A refusal of a batched global rule may ask the store first ([`asked`]), with this
            // proxy's count of the key (the units the store has not counted yet are those its
            // view has not confirmed).
            let counts = |probe: &Probe| {
                let counts = limits.limiter.counts_of(env.store, &limits.reserves.borrow(), probe, now);
                counts.map_or(0, |c| c.current)
            };
            if let Some(asks) = stage.asks_of(scope, env.store, &mut node.borrow_mut(), &verdict, &probes, &self.fleet_keys, counts, now) {
                self.wait = Some(Wait::Asked(asked::Asking { asks, outcomes: None, end_of_stream: false, body: (0, false) }));
                return None;
            }
        }
        // Counted once the request is decided (not when it goes to ask first).
        for rule in skipped {
            increment(env.metrics, stats.rule(rule).skipped);
        }
        for rule in invalid {
            increment(env.metrics, stats.rule(rule).invalid_cost);
        }
        for violation in &shadow_refusals {
            increment(env.metrics, stats.rule(violation.standing.rule).shadow_refused);
            self.decision.shadow(By::Rule(violation.standing.rule), Some(&violation.standing));
        }
        if let (Some(scope), Some(node)) = (&fleet.global, &fleet.global_node) {
            // An admission counts fleet-wide; a refusal asks for the key's fleet-wide count.
            let admitted = matches!(verdict, Verdict::Admitted { .. });
            let mut node = node.borrow_mut();
            for probe in &probes {
                // Units the store granted to an ask are counted there already.
                let asked = self.asking().and_then(|a| a.outcome(probe.rule, probe.key_hash));
                let granted = asked == Some(crate::fleet::batched::ask::Asked::Granted);
                let Some(key) = self.fleet_keys.of(probe.rule) else { continue };
                if granted && !admitted {
                    let back = scope.refund(&mut node, probe, key, probe.cost, now, now);
                    stats::add_count(env.metrics, stats.global.dropped, back);
                }
                let cost = if admitted && !granted { probe.cost } else { 0 };
                // An answered ask has just read the key's totals into the view and counted the
                // request there (`GlobalScope::learn`): no read of it goes in the next batch.
                if cost == 0 && matches!(asked, Some(crate::fleet::batched::ask::Asked::Granted | crate::fleet::batched::ask::Asked::Refused)) {
                    continue;
                }
                batched::count(env.metrics, &stats.global, scope, &mut node, probe, key, now, cost, 1);
            }
            for probe in &shadowed {
                let Some(key) = self.fleet_keys.of(probe.rule) else { continue };
                batched::count(env.metrics, &stats.global, scope, &mut node, probe, key, now, 0, 1);
            }
        }
        match &verdict {
            Verdict::Admitted { standings, evictions } => {
                for (probe, when, limit) in later {
                    self.charges.owe(probe, when, limit, now);
                }
                for standing in standings {
                    increment(env.metrics, stats.rule(standing.rule).allowed);
                }
                if waits.delays.is_some() {
                    self.delay_for_turn(&limits.limiter, shadows, stats, env, standings, &probes);
                }
                if selection.selector.is_some() {
                    // Selection may still refuse it: its units then go back.
                    self.counted = Some((std::mem::take(&mut probes), now));
                }
                for rule in evictions {
                    increment(env.metrics, stats.rule(*rule).evictions);
                }
                if config.access_log {
                    self.decision.admitted(standings.iter().chain(&self.leased.standings));
                }
                if config.ratelimit_headers == RateLimitHeaders::Always {
                    self.fields = if self.leased.standings.is_empty() {
                        limits.admitted_fields.tightest(standings)
                    } else {
                        let all: Vec<Standing> = standings.iter().chain(&self.leased.standings).copied().collect();
                        limits.admitted_fields.tightest(&all)
                    };
                }
                None
            }
            Verdict::Refused { violations } => {
                for violation in violations {
                    let ids = stats.rule(violation.standing.rule);
                    if shadows.rule(violation.standing.rule) {
                        // Refused by another rule; this one would have refused it too.
                        increment(env.metrics, ids.shadow_refused);
                        continue;
                    }
                    increment(env.metrics, ids.refused);
                    if violation.cause == Cause::Contention {
                        increment(env.metrics, ids.contention);
                    }
                }
                let enforced: Vec<Violation> = if shadows.any_rule() {
                    violations.iter().filter(|v| !shadows.rule(v.standing.rule)).copied().collect()
                } else {
                    Vec::new()
                };
                let verdict = if enforced.is_empty() { verdict } else { Verdict::Refused { violations: enforced } };
                if let Verdict::Refused { violations } = &verdict {
                    if let Some(first) = violations.first() {
                        self.decision.refused(decision::Outcome::Refused, By::Rule(first.standing.rule), Some(&first.standing));
                    }
                }
                let reply = replies::rate_limited(&limits.limiter, &verdict, now)?;
                log::debug!("floodgate: 429 {}", reply.body);
                Some(reply)
            }
        }
    }

    /// The `delay` stage's part of an admission: the latest turn of the enforced token buckets
    /// that let the request in to wait (a bucket in shadow lets it go at once), and the turns
    /// it took of every bucket, to give back if its client goes away while it waits.
    fn delay_for_turn<H: Host>(&mut self, limiter: &Limiter, shadows: &Shadows, stats: &Stats, env: &Env<'_, H>, standings: &[Standing], probes: &[Probe]) {
        let waits = standings.iter().filter(|s| s.go_at.is_some() && !shadows.rule(s.rule));
        let Some((go_at, rule)) = waits.clone().filter_map(|s| Some((s.go_at?, s.rule))).max_by_key(|(go_at, _)| *go_at) else { return };
        for standing in waits {
            increment(env.metrics, stats.rule(standing.rule).delayed);
        }
        let tables = limiter.tables();
        let turns = probes.iter().filter(|p| tables.get(p.rule).is_some_and(|t| t.bucket.is_some())).copied().collect();
        // After an ask, this ends its wait for the answer (decided with it).
        self.wait = Some(Wait::Turn(Delayed { go_at, rule, turns, ..Delayed::default() }));
    }

    /// Cluster selection: takes a permit on a cluster (the request goes there: `Ok(Some(index))`),
    /// or returns the 503 when none has room; `Ok(None)` without cluster selection.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn select<H: Host, R: Request + ?Sized, G: Random + ?Sized>(
        &mut self,
        selection: &Selection,
        stats: &Stats,
        shadows: &Shadows,
        env: &Env<'_, H>,
        request: &R,
        rng: &mut G,
        now: MonoMillis,
    ) -> Result<Option<usize>, Reply> {
        let Some(selector) = selection.selector.as_ref() else { return Ok(None) };
        // The request's partition, when its key is confined to one; a request without the key
        // may use every cluster.
        let confinement: Option<Confinement> = selection.partitioner.as_ref().and_then(|partitioner| {
            let confinement = partitioner.key_hash(|source| request.fetch(source)).map(|hash| partitioner.confine(hash));
            if confinement.is_none() {
                increment(env.metrics, stats.selection.partition_unkeyed);
            }
            confinement
        });
        let chosen = {
            let mut state = selection.vm.borrow_mut();
            match &confinement {
                Some(within) => selector.choose_within(env.store, &mut state, now, rng, within).or_else(|exhausted| {
                    if !shadows.partition || within.spill_below.is_some() {
                        return Err(exhausted);
                    }
                    // In shadow, a request its partition would refuse may use every cluster.
                    let anywhere = selector.choose(env.store, &mut state, now, rng);
                    if anywhere.is_ok() {
                        increment(env.metrics, stats.selection.partition_shadow_refused);
                        self.decision.shadow(By::Partition, None);
                    }
                    anywhere
                }),
                None => selector.choose(env.store, &mut state, now, rng),
            }
        };
        let permit = match chosen {
            Ok(permit) => permit,
            Err(exhausted) => {
                increment(env.metrics, stats.selection.exhausted);
                if exhausted.contention {
                    increment(env.metrics, stats.selection.contention);
                }
                log::debug!("floodgate: no cluster has room: {exhausted:?}");
                let by = if confinement.as_ref().is_some_and(|c| c.spill_below.is_none()) { By::Partition } else { By::Selection };
                self.decision.refused(decision::Outcome::NoCluster, by, None);
                return Err(replies::no_capacity_within(selector, &exhausted, confinement.as_ref()));
            }
        };
        increment(env.metrics, stats.cluster(permit.cluster).selected);
        if confinement.is_some_and(|c| !c.members.contains(&permit.cluster) && c.spill_below.is_some()) {
            increment(env.metrics, stats.selection.partition_spilled);
        }
        log::debug!("floodgate: routed to cluster {} ({} in flight)", permit.cluster, permit.in_flight);
        let cluster = permit.cluster;
        self.cluster_permit = Some(permit);
        Ok(Some(cluster))
    }
}
