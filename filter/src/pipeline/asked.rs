//! The `ask` step of the `rate_limit` stage, for rules in batched global scope
//! ([`crate::fleet::batched::ask`] decides who asks and learns from the answers): a request whose
//! key the proxy has not learned, or whose projection refuses while the store may have room,
//! waits for one `POST /v1/lease` call that takes its units `at_once`, then is decided again
//! with the answer. This worker's waiting requests are listed here by call; nothing here calls
//! the host: the calls to send are queued ([`AskStage::take_outgoing`]).
//!
//! Rationale: docs/global.md, "A key a proxy has not learned".

use super::stats::{increment, GlobalStats, Metrics};
use super::{SharedStream, Wait};
use crate::config::{Config, StoreRoute};
use crate::fleet::batched::ask::{Asked, KeyAsk};
use crate::fleet::batched::{GlobalScope, VmNode};
use crate::fleet::leased::protocol;
use crate::fleet::Answer;
use crate::keys::fleet::FleetKeys;
use crate::primitives::store::SharedStore;
use crate::primitives::time::UnixMillis;
use crate::ratelimit::remote::Remote;
use crate::ratelimit::{Probe, Verdict};
use std::cell::RefCell;
use std::collections::HashMap;

/// A request that waits for its ask's answer, then to be decided with it (its stream's wait).
#[derive(Clone, Debug)]
pub struct Asking {
    /// The keys it asks for.
    pub asks: Vec<KeyAsk>,
    /// How each ended, in the order of `asks`, once answered.
    pub outcomes: Option<Vec<Asked>>,
    /// Whether the request headers ended the request.
    pub end_of_stream: bool,
    /// The body that came while it waited (bytes, and whether it ended): held, not forwarded.
    pub body: (usize, bool),
}

impl Asking {
    /// How the ask of rule `rule`'s key `key_hash` ended (`None`: not asked, or not answered).
    pub fn outcome(&self, rule: usize, key_hash: u64) -> Option<Asked> {
        let outcomes = self.outcomes.as_ref()?;
        self.asks.iter().zip(outcomes).find(|(a, _)| a.rule == rule && a.key_hash == key_hash).map(|(_, o)| *o)
    }
}

/// A call to send: its request body, for the stream `context` that waits on it.
pub struct Outgoing {
    /// The waiting stream's context.
    pub context: u32,
    /// The waiting stream.
    pub stream: SharedStream,
    /// The call's body.
    pub body: Vec<u8>,
    /// Keys asked for.
    pub keys: usize,
}

/// This worker's asks on their way.
pub struct AskStage {
    /// Where the calls go.
    pub route: StoreRoute,
    /// A call's timeout, ms (`lease_timeout`).
    pub timeout_ms: u64,
    outgoing: RefCell<Vec<Outgoing>>,
    in_flight: RefCell<HashMap<u32, (u32, SharedStream)>>,
    /// Requests whose call could not be sent, decided without the store at the next tick
    /// (not from the callback that parked them).
    ready: RefCell<Vec<(u32, SharedStream)>>,
}

/// Applies the outcomes of a request's asks to what the rest of the fleet adds to its probes'
/// keys (`remotes`, by rule): a key whose units the store granted is decided on this proxy's
/// counts alone (the store had room for them); so is a key not learned whose ask failed (the
/// store down: as the proxy decided such keys without a fleet size).
pub fn apply_outcomes(asking: &Asking, scope: &GlobalScope, node: &VmNode, probes: &[Probe], remotes: &mut [Remote]) {
    for probe in probes {
        let alone = match asking.outcome(probe.rule, probe.key_hash) {
            Some(Asked::Granted) => true,
            Some(Asked::Failed) => !scope.learned(node, probe),
            _ => false,
        };
        if let Some(remote) = remotes.get_mut(probe.rule).filter(|_| alone) {
            *remote = Remote::NONE;
        }
    }
}

impl AskStage {
    /// The asks a request refused by `verdict` makes: one per refusing rule, when every
    /// refusing rule is in batched global scope and asks ([`GlobalScope::ask_of`], with the
    /// key's fleet-wide id of `keys`, and `counts`, this proxy's count of a key in its current
    /// bucket); `None` otherwise (the refusal stands).
    #[allow(clippy::too_many_arguments)]
    pub fn asks_of(
        &self,
        scope: &GlobalScope,
        store: &dyn SharedStore,
        node: &mut VmNode,
        verdict: &Verdict,
        probes: &[Probe],
        keys: &FleetKeys,
        counts: impl Fn(&Probe) -> u32,
        now: UnixMillis,
    ) -> Option<Vec<KeyAsk>> {
        let Verdict::Refused { violations } = verdict else { return None };
        let mut asks = Vec::with_capacity(violations.len());
        for violation in violations {
            let probe = probes.iter().find(|p| p.rule == violation.standing.rule)?;
            let key = keys.of(probe.rule)?;
            asks.push(scope.ask_of(store, node, probe, key, violation.standing.limit, &counts, now)?);
        }
        (!asks.is_empty()).then_some(asks)
    }

    /// The stage of `config`, if it has rules in batched global scope (`scope`).
    pub fn new(config: &Config, scope: Option<&GlobalScope>) -> Option<AskStage> {
        let global = config.global.as_ref()?;
        scope?;
        Some(AskStage {
            route: global.route(),
            timeout_ms: global.lease_timeout.get().get(),
            outgoing: RefCell::new(Vec::new()),
            in_flight: RefCell::new(HashMap::new()),
            ready: RefCell::new(Vec::new()),
        })
    }

    /// The request of stream `context` waits for its `asks`: their call is queued.
    pub fn park(&self, context: u32, stream: SharedStream, asks: &[KeyAsk]) {
        let entries: Vec<_> = asks.iter().map(|k| (k.ask, k.carried)).collect();
        let body = protocol::exact_body(&entries);
        self.outgoing.borrow_mut().push(Outgoing { context, stream, body, keys: asks.len() });
    }

    /// The calls to send.
    pub fn take_outgoing(&self) -> Vec<Outgoing> {
        std::mem::take(&mut *self.outgoing.borrow_mut())
    }

    /// A call went out as `token`.
    pub fn sent(&self, metrics: &dyn Metrics, ids: &GlobalStats, call: Outgoing, token: u32) {
        for _ in 0..call.keys {
            increment(metrics, ids.asked);
        }
        self.in_flight.borrow_mut().insert(token, (call.context, call.stream));
    }

    /// Whether `token` is an ask's call.
    pub fn owns(&self, token: u32) -> bool {
        self.in_flight.borrow().contains_key(&token)
    }

    /// The answer to call `token` (or its failure, `Answer::Failed`): the proxy's view learns
    /// the keys' counts, the stream records how each ask ended; returns the stream to decide
    /// again.
    #[allow(clippy::too_many_arguments)]
    pub fn answered(
        &self,
        scope: &GlobalScope,
        node: &RefCell<VmNode>,
        store: &dyn SharedStore,
        metrics: &dyn Metrics,
        ids: &GlobalStats,
        token: u32,
        answer: Answer,
        now: UnixMillis,
    ) -> Option<(u32, SharedStream)> {
        let (context, stream) = self.in_flight.borrow_mut().remove(&token)?;
        Self::decide(scope, node, store, metrics, ids, &stream, answer, now);
        Some((context, stream))
    }

    /// A call that could not be sent: its stream is to be decided without the store, at the
    /// next tick ([`AskStage::take_ready`]).
    #[allow(clippy::too_many_arguments)]
    pub fn not_sent(&self, scope: &GlobalScope, node: &RefCell<VmNode>, store: &dyn SharedStore, metrics: &dyn Metrics, ids: &GlobalStats, call: Outgoing, now: UnixMillis) {
        Self::decide(scope, node, store, metrics, ids, &call.stream, Answer::Failed(None), now);
        self.ready.borrow_mut().push((call.context, call.stream));
    }

    /// The requests whose call could not be sent: to decide again.
    pub fn take_ready(&self) -> Vec<(u32, SharedStream)> {
        std::mem::take(&mut *self.ready.borrow_mut())
    }

    #[allow(clippy::too_many_arguments)]
    fn decide(scope: &GlobalScope, node: &RefCell<VmNode>, store: &dyn SharedStore, metrics: &dyn Metrics, ids: &GlobalStats, stream: &SharedStream, answer: Answer, now: UnixMillis) {
        let mut stream = stream.borrow_mut();
        let Some(Wait::Asked(asking)) = stream.wait.as_mut() else { return };
        let grants = match answer {
            Answer::Ok(body) => protocol::decode(&body, asking.asks.len()).ok(),
            Answer::Failed(_) => None,
        };
        if grants.is_none() {
            for _ in &asking.asks {
                increment(metrics, ids.ask_failures);
            }
        }
        let mut node = node.borrow_mut();
        let outcomes = asking
            .asks
            .iter()
            .enumerate()
            .map(|(i, asked)| scope.learn(store, &mut node, asked, grants.as_ref().and_then(|g| g.get(i).copied()), now))
            .collect();
        asking.outcomes = Some(outcomes);
    }

    /// Stream `context` ended: its call's answer no longer decides anything (a grant stays
    /// counted: the fleet admits less, never more).
    pub fn forget(&self, context: u32) {
        self.in_flight.borrow_mut().retain(|_, (c, _)| *c != context);
    }
}
