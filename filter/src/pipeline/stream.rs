//! A request's state from its request headers to the end of its stream ([`Stream`]), how its
//! host context holds it ([`StreamCell`]), and its events after the request headers: the
//! body, the response, the end.
//!
//! Invariant: what the stream holds (permits, leased units, units counted, costs owed) goes back
//! exactly once, taken out of the state as it goes.

use crate::keys::fleet::{FleetKey, FleetKeys};
use crate::primitives::inflight::Permit;
use crate::primitives::time::{MonoMillis, UnixMillis};
use crate::ratelimit::Probe;
use crate::ratelimit::estimate::BodyEstimates;
use crate::ratelimit::rules::Attributes;
use crate::ratelimit::rules::{Charges, Report, Rules, Settle};
use crate::ratelimit::usage;
use crate::replies::grpc;
use crate::replies::{self, Reply, Tightest};
use crate::selection::grade::Grade;
use crate::selection::{ClusterPermit, Exhausted, Timing};
use crate::shedding::per_key::KeyPermit;
use super::*;
use super::decision::{By, Decision};
use super::leased::Taken;
use super::stats::increment;
use std::cell::RefCell;
use std::rc::Rc;

/// A request's state, from its request headers to the end of its stream.
#[derive(Debug, Default)]
pub struct Stream {
    /// Its unit of the proxy-wide in-flight count (`load_shedding.max_active_requests`).
    pub(super) permit: Option<Permit>,
    /// Its unit of its key's cap (`load_shedding.per_key`).
    pub(super) key_permit: Option<KeyPermit>,
    /// In a class shared by flow: its slot of the class's fair queues.
    pub(super) fair_slot: Option<super::queue::FairSlot>,
    /// The chosen cluster's permit.
    pub(super) cluster_permit: Option<ClusterPermit>,
    /// The units it took of the leased rules' keys.
    pub(super) leased: Taken,
    /// What it waits on while it is paused, and what it holds meanwhile (one thing at a time).
    pub(super) wait: Option<Wait>,
    /// For an admitted request: the tightest rule and its `ratelimit` value.
    pub(super) fields: Option<Tightest>,
    /// Costs it still owes its rules (a streamed body, a reported count).
    pub(super) charges: Charges,
    /// It was answered locally.
    pub(super) replied: bool,
    /// The stream ended (`end`).
    pub(super) ended: bool,
    /// Whether it is gRPC, and the status its response ended with.
    pub(super) grpc: GrpcCall,
    /// When the request ended and the response headers came (with a cluster permit): the
    /// upstream's latency, which decides "slow".
    pub(super) timing: Timing,
    /// How the request was decided, for the access log.
    pub(super) decision: Decision,
    /// What the estimates its rules read in its body (`cost.estimate.body`) found, once read
    /// (while they are read, its wait holds them: [`Wait::Body`]).
    pub(super) estimates: Option<Box<BodyEstimates>>,
    /// With cluster selection, the rules' keys that counted the admitted request, and when:
    /// given back if selection refuses it.
    pub(super) counted: Option<(Vec<Probe>, UnixMillis)>,
    /// Its keys' fleet-wide ids, for the rules in global scope that apply to it.
    pub(super) fleet_keys: FleetKeys,
}

/// A stream's state as its host context and the leased stage's waiting lists share it.
pub type SharedStream = Rc<RefCell<Stream>>;

/// A stream's state as its host context holds it: its own, until the leased stage parks the
/// request ([`StreamCell::share`]); shared with the waiting list from then on. Most requests
/// never wait, and their state is never allocated on its own.
#[derive(Debug)]
// Inline on purpose: the host context that holds it is on the heap already.
#[allow(clippy::large_enum_variant)]
pub enum StreamCell {
    /// Held by the host context alone.
    Own(RefCell<Stream>),
    /// Shared with the leased stage.
    Shared(SharedStream),
}

impl Default for StreamCell {
    fn default() -> StreamCell {
        StreamCell::Own(RefCell::default())
    }
}

impl std::ops::Deref for StreamCell {
    type Target = RefCell<Stream>;

    fn deref(&self) -> &RefCell<Stream> {
        match self {
            StreamCell::Own(stream) => stream,
            StreamCell::Shared(stream) => stream,
        }
    }
}

impl StreamCell {
    /// The state, shared from now on (moved out of the host context the first time).
    pub fn share(&mut self) -> SharedStream {
        let shared = match self {
            StreamCell::Shared(stream) => return Rc::clone(stream),
            StreamCell::Own(stream) => Rc::new(RefCell::new(std::mem::take(stream.get_mut()))),
        };
        *self = StreamCell::Shared(Rc::clone(&shared));
        shared
    }
}

impl Stream {
    /// How the request was decided (complete once a step other than [`Step::Wait`] came).
    pub fn decision(&self) -> &Decision {
        &self.decision
    }

    /// Whether it holds anything a stage gave it (for tests and the host's checks).
    pub fn holds_permits(&self) -> bool {
        self.permit.is_some() || self.key_permit.is_some() || self.cluster_permit.is_some() || self.fair_slot.is_some()
    }

    /// The reply, in the request's protocol. A refused request gives its permits back at once:
    /// it never reaches an upstream, and a client that reads its refusal slowly (an HTTP/2
    /// client withholding flow-control credit) must not hold a unit of the proxy's capacity
    /// meanwhile.
    pub(super) fn reply<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, reply: Reply, now: MonoMillis) -> LocalReply {
        self.release(filter, env, now);
        self.replied = true;
        match grpc::reply(&reply, &filter.config.grpc).filter(|_| self.grpc.request) {
            Some(grpc) => LocalReply::Grpc(grpc),
            None => LocalReply::Http(reply.with_exact_wait()),
        }
    }

    /// The host could not set the route header: the request cannot reach its cluster, whose
    /// permit ends unused; the 503 of no capacity.
    pub fn unroutable<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>) -> LocalReply {
        let now = env.clock.now().mono;
        let selector = filter.selection.selector.as_ref();
        if let (Some(permit), Some(selector)) = (self.cluster_permit.take(), selector) {
            selector.finish(env.store, &mut filter.selection.vm.borrow_mut(), permit, Grade::Ignored, now);
        }
        self.decision.refused(decision::Outcome::NoCluster, By::Selection, None);
        self.decision.cluster = None;
        if let Some(stage) = &filter.fleet.leased {
            stage.untake(env.store, &std::mem::take(&mut self.leased));
        }
        self.give_back_counted(filter, env, env.clock.now().wall);
        let reply = match selector {
            Some(selector) => replies::no_capacity(selector, &Exhausted { clusters: Vec::new(), contention: true }),
            None => replies::health(&replies::LocalLoad::default(), None),
        };
        self.reply(filter, env, reply, now)
    }

    /// A request body frame (`bytes` of it; `end`: the last): held while the request waits for
    /// the store, counted for a cost of body bytes.
    pub fn request_body<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, bytes: usize, end: bool) -> Flow {
        if let Some(body) = self.held_body() {
            // Held until the request is decided or its turn comes; counted then.
            *body = (bytes, end);
            return Flow::Pause;
        }
        if end && self.cluster_permit.is_some() && self.timing.request_end.is_none() {
            self.timing.request_end = Some(env.clock.now().mono);
        }
        if self.charges.counts_body() {
            self.charges.body(bytes);
            if end {
                let owed = self.charges.body_done();
                self.charge(filter, env, owed);
            }
        }
        Flow::Continue
    }

    /// The request trailers: the request ended.
    pub fn request_trailers<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>) -> Flow {
        if let Some(body) = self.held_body() {
            body.1 = true;
            return Flow::Pause;
        }
        if self.cluster_permit.is_some() && self.timing.request_end.is_none() {
            self.timing.request_end = Some(env.clock.now().mono);
        }
        if self.charges.counts_body() {
            let owed = self.charges.body_done();
            self.charge(filter, env, owed);
        }
        Flow::Continue
    }

    /// The response headers (`headers`; `end_of_stream`: they end the response): charges the
    /// units the upstream reports, notes gRPC's status and the latency, and returns, for an
    /// admitted request, the tightest rule whose `RateLimit` fields the response gets
    /// ([`AdmittedFields::policy`](crate::replies::AdmittedFields::policy) and [`Tightest::ratelimit`]).
    pub fn response_headers<H: Host, A: Attributes + ?Sized>(&mut self, filter: &Filter, env: &Env<'_, H>, headers: &A, end_of_stream: bool) -> Option<Tightest> {
        if self.replied {
            return None;
        }
        if self.cluster_permit.is_some() {
            if self.grpc.request && end_of_stream {
                self.grpc.status = headers.get("grpc-status").map(|v| grpc::parse_status(&v));
            }
            if self.timing.response_headers.is_none() {
                self.timing.response_headers = Some(env.clock.now().mono);
            }
        }
        if self.charges.awaits_response() {
            let rules = &filter.limits.rules;
            let body = rules.reads_response_bodies() && !end_of_stream;
            let content_type = if body { headers.get("content-type") } else { None };
            let encoded = body && usage::is_encoded(headers.get("content-encoding").as_deref());
            let owed = self.charges.response(
                |rule| Rules::response_report(rules.response_header(rule).and_then(|name| headers.get(name)).as_deref()),
                |rule| if end_of_stream { None } else { rules.body_scan(rule, content_type.as_deref(), encoded) },
            );
            if encoded && owed.iter().any(|s| s.report == Report::Compressed) && !filter.said_compressed.replace(true) {
                log::warn!(
                    "floodgate: a response whose usage a rule reads came compressed (content-encoding: {}): it cannot be read, and is settled as unreported (counted in unreadable and unreadable_compressed). Put Envoy's decompressor filter after floodgate, or remove accept-encoding from the requests (docs/llm.md). Said once.",
                    String::from_utf8_lossy(headers.get("content-encoding").as_deref().unwrap_or_default())
                );
            }
            self.charge(filter, env, owed);
        }
        self.fields.take()
    }

    /// Whether the response body is read (a rule's count is in it).
    pub fn reads_response_body(&self) -> bool {
        self.charges.reads_response_body()
    }

    /// A chunk of the response body (`end`: the last): read for the counts the rules wait for;
    /// those it settles are charged (or given back).
    pub fn response_body<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, chunk: &[u8], end: bool) {
        if !self.charges.reads_response_body() {
            return;
        }
        let rules = &filter.limits.rules;
        let owed = self.charges.response_body(chunk, end, |rule| rules.body_usage(rule));
        self.charge(filter, env, owed);
    }

    /// The response trailers: a gRPC call's status.
    pub fn response_trailers<A: Attributes + ?Sized>(&mut self, trailers: &A) {
        if self.cluster_permit.is_some() && self.grpc.request {
            self.grpc.status = trailers.get("grpc-status").map(|v| grpc::parse_status(&v));
        }
    }

    /// Whether the stream still needs what [`Stream::end`] reads of the host.
    pub fn needs_end(&self) -> bool {
        !self.charges.is_empty() || self.holds_permits() || self.wait.as_ref().is_some_and(Wait::holds) || self.pending_asks().is_some()
    }

    /// The stream ended, whatever ended it (`context`: its host context): a waiting request
    /// stops waiting, costs still owed are charged (what is known, or the rule's default), the
    /// permits are released and the chosen cluster's is finished with the stream's grade.
    pub fn end<H: Host, E: StreamEnd + ?Sized>(&mut self, filter: &Filter, env: &Env<'_, H>, context: u32, ended: &E) {
        if self.ended {
            return;
        }
        self.ended = true;
        // What its wait holds goes back (one for its body or its ask holds nothing).
        let held = self.wait.take_if(|wait| wait.holds());
        if let Some(stage) = &filter.fleet.leased {
            let wait = match &held {
                Some(Wait::Store(wait)) => Some(wait),
                _ => None,
            };
            stage.stream_ended(env.store, context, wait, env.clock.now());
        }
        if let (Some(_), Some(stage)) = (self.pending_asks(), &filter.fleet.asks) {
            stage.forget(context);
        }
        match (held, &filter.waits.queue) {
            (Some(Wait::Turn(delayed)), _) => {
                // Its client went away while it waited for its turn.
                self.give_back_turns(filter, env, &delayed);
            }
            (Some(Wait::Slot(queued)), Some(stage)) => {
                // Its client went away while it waited for a slot (or before its resumption).
                stage.abandon(&filter.stats, env, &queued);
            }
            _ => {}
        }
        if !self.charges.is_empty() {
            let owed = self.charges.end();
            self.charge(filter, env, owed);
        }
        if self.holds_permits() {
            let now = env.clock.now().mono;
            self.release(filter, env, now);
            self.finish_cluster(filter, env, ended, now);
        }
    }

    /// Ends the chosen cluster's permit with the stream's grade.
    fn finish_cluster<H: Host, E: StreamEnd + ?Sized>(&mut self, filter: &Filter, env: &Env<'_, H>, ended: &E, now: MonoMillis) {
        let (Some(permit), Some(selector)) = (self.cluster_permit.take(), filter.selection.selector.as_ref()) else {
            return;
        };
        let status = ended.status().filter(|c| *c > 0);
        // Flags change the grade of a stream without a status or with a 5xx; a status below
        // 500 already sent downstream stands (one host call saved on the common path), unless
        // a gRPC call's status needs them.
        let failures = filter.config.cluster_selection.as_ref().map_or(&[][..], |s| &s.failure_grpc_statuses);
        let grpc_status = self.grpc.request.then_some(self.grpc.status);
        let flags = match status {
            Some(code) if code < 500 && grpc_status.is_none_or(|s| !grpc::needs_flags(s, failures)) => 0,
            _ => ended.flags(),
        };
        let mut grade = selector.classify(&permit, status, flags, self.timing);
        if let Some(grpc_status) = grpc_status {
            grade = grpc::grade(grade, grpc::effective_status(grpc_status, status, flags), failures);
        }
        let finished = selector.finish(env.store, &mut filter.selection.vm.borrow_mut(), permit, grade, now);
        if filter.is_retired() {
            // Its configuration is gone: no heartbeat of it will write what is pending.
            selector.heartbeat(env.store, &mut filter.selection.vm.borrow_mut(), now);
        }
        let ids = filter.stats.cluster(finished.cluster);
        increment(
            env.metrics,
            match grade {
                Grade::Success => ids.success,
                Grade::Slow => ids.slow,
                Grade::Failure | Grade::Overflow => ids.failure,
                Grade::Timeout => ids.timeout,
                Grade::Ignored => ids.ignored,
            },
        );
        if !finished.recorded {
            increment(env.metrics, filter.stats.selection.contention);
        }
        log::debug!("floodgate: {grade:?} (status {status:?}, gRPC {grpc_status:?}, flags {flags:#x}) on cluster {}", finished.cluster);
    }

    /// Settles costs the admitted request owes its rules, known after admission: what was
    /// counted at admission (a reservation, or nothing) becomes the units the rule charges for
    /// what came (a count, capped at the limit; without one, the rule's policy): the difference
    /// is charged into the key's counters, or given back to the window bucket it was counted in;
    /// fleet-wide too for rules in global scope.
    pub(super) fn charge<H: Host>(&self, filter: &Filter, env: &Env<'_, H>, owed: Vec<Settle>) {
        let now = env.clock.now().wall;
        for Settle { probe, report, limit } in owed {
            let ids = filter.stats.rule(probe.rule);
            match report {
                Report::Count(_) | Report::Missing => {}
                Report::Invalid => increment(env.metrics, ids.invalid_cost),
                Report::Unreadable => increment(env.metrics, ids.unreadable),
                Report::Compressed => {
                    increment(env.metrics, ids.unreadable);
                    increment(env.metrics, ids.unreadable_compressed);
                }
            }
            if !matches!(report, Report::Count(_)) {
                increment(env.metrics, ids.unreported);
            }
            let units = filter.limits.rules.settled_units(probe.rule, report, probe.cost, limit);
            let reserved = probe.cost;
            let key = self.fleet_keys.of(probe.rule);
            if let Some(stage) = filter.fleet.leased.as_ref().filter(|l| l.is_leased(probe.rule)) {
                if let Some(key) = key {
                    stage.settle(env.store, &probe, key, units, limit, self.charges.admitted_at(), now);
                }
                let (charged, refunded) = (units.saturating_sub(reserved), reserved.saturating_sub(units));
                stats::add_count(env.metrics, ids.charged, u64::from(charged));
                stats::add_count(env.metrics, ids.refunded, u64::from(refunded));
            } else if units > reserved {
                let extra = units.saturating_sub(reserved);
                if filter.limits.limiter.charge(env.store, probe, extra, now) {
                    stats::add_count(env.metrics, ids.charged, u64::from(extra));
                } else {
                    increment(env.metrics, ids.contention);
                }
                if let (Some(scope), Some(node), Some(key)) = (&filter.fleet.global, &filter.fleet.global_node, key) {
                    batched::count(env.metrics, &filter.stats.global, scope, &mut node.borrow_mut(), &probe, key, now, extra, 0);
                }
            } else if units < reserved {
                let back = reserved.saturating_sub(units);
                give_back(filter, env, &probe, key, back, self.charges.admitted_at(), now);
                stats::add_count(env.metrics, ids.refunded, u64::from(back));
            }
        }
    }

    /// An admitted request that cluster selection refused (or that could not be routed) never
    /// reaches an upstream: the units its rules counted at admission go back, as a settlement
    /// gives back a reservation's unused part, and it owes nothing more.
    pub(super) fn give_back_counted<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, now: UnixMillis) {
        let Some((probes, admitted_at)) = self.counted.take() else { return };
        for probe in &probes {
            give_back(filter, env, probe, self.fleet_keys.of(probe.rule), probe.cost, admitted_at, now);
        }
        self.charges = Charges::default();
    }

    /// Releases the in-flight and per-key permits (each once: taken out of the state).
    pub(super) fn release<H: Host>(&mut self, filter: &Filter, env: &Env<'_, H>, now: MonoMillis) {
        // The fair slot before the in-flight permit: a class's record never counts fewer slots
        // than the in-flight count holds for it, which its heartbeat relies on.
        if let Some(held) = self.fair_slot.take() {
            if let Some(fair) = filter.waits.queue.as_ref().and_then(|q| q.flows.as_ref()).and_then(|f| f.class(held.class)) {
                fair.release(env.store, &held.slot, now);
            }
        }
        if let (Some(permit), Some(shedder)) = (self.permit.take(), filter.shedding.shedder.as_ref()) {
            shedder.release(env.store, env.vm, permit, now);
        }
        if let (Some(permit), Some(cap)) = (self.key_permit.take(), filter.shedding.per_key.as_ref()) {
            cap.release(env.store, env.vm, permit, now);
        }
    }
}

/// Gives back `units` that `probe`'s key counted at `admitted_at` and that were not used: out
/// of the key's counters, and fleet-wide (`key`, its fleet-wide id) for a rule in batched
/// global scope.
fn give_back<H: Host>(filter: &Filter, env: &Env<'_, H>, probe: &Probe, key: Option<FleetKey>, units: u32, admitted_at: UnixMillis, now: UnixMillis) {
    filter.limits.limiter.refund(env.store, *probe, units, admitted_at);
    if let (Some(scope), Some(node), Some(key)) = (&filter.fleet.global, &filter.fleet.global_node, key) {
        // A give-back with no room in the VM's buffer is lost: the fleet over-counts.
        let _ = scope.refund(&mut node.borrow_mut(), probe, key, units, admitted_at, now);
    }
}
