//! What floodgate decided about a request, as Envoy's access log shows it (`access_log`): the
//! outcome, the mechanism or rule that decided it, the tightest rule's limit and remaining
//! units, for a request shed by its flow the flow's share, the chosen cluster, and how long it
//! waited (for a slot, for its turn). The host writes [`Decision::fields`] into Envoy filter state
//! (`wasm.<plugin name>.outcome`, ...) once the request is decided, so that two instances of the
//! filter in one chain keep their own. No key appears: keys can be secrets.

use super::Filter;
use crate::ratelimit::Standing;
use crate::shedding::flows::Share;

/// How a request was decided.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Outcome {
    /// It went on: every mechanism admitted it.
    #[default]
    Admitted,
    /// It went on once its turn came: a token bucket's `max_delay` made it wait.
    Delayed,
    /// It went on, but a mechanism in shadow would have refused it.
    ShadowRefused,
    /// A rate-limit rule refused it (`429`, or the gRPC status of a refusal).
    Refused,
    /// Load shedding refused it: too many requests in flight, or the worker's loop lags.
    Shed,
    /// Its key's in-flight cap refused it.
    Capped,
    /// No cluster (of its partition) had room.
    NoCluster,
    /// A request for the health endpoint, answered by floodgate.
    Health,
    /// A request for the watchdog's liveness path, answered by floodgate.
    Watchdog,
}

impl Outcome {
    /// Its name in the access log.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Admitted => "admitted",
            Outcome::Delayed => "delayed",
            Outcome::ShadowRefused => "shadow_refused",
            Outcome::Refused => "refused",
            Outcome::Shed => "shed",
            Outcome::Capped => "capped",
            Outcome::NoCluster => "no_cluster",
            Outcome::Health => "health",
            Outcome::Watchdog => "watchdog",
        }
    }
}

/// The mechanism that decided (or, in shadow, would have).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum By {
    /// A rate-limit rule (its index).
    Rule(usize),
    /// The proxy-wide in-flight limit (`load_shedding.max_active_requests`).
    InFlight,
    /// The worker's loop lag (`load_shedding.max_loop_lag`).
    LoopLag,
    /// The per-key in-flight cap (`load_shedding.per_key`).
    PerKey,
    /// Its flow held the most of its class (`load_shedding.flow`).
    Flow,
    /// The key's partition (`cluster_selection.partition`).
    Partition,
    /// Cluster selection: no cluster had room.
    Selection,
}

/// The filter-state names of the fields, without Envoy's `wasm.` prefix: the plugin's name, a
/// dot and the field's.
#[derive(Clone, Debug, Default)]
pub struct Names {
    outcome: String,
    by: String,
    limit: String,
    remaining: String,
    flow_in_flight: String,
    flow_waiting: String,
    flows: String,
    fair_share: String,
    cluster: String,
    waited_ms: String,
}

impl Names {
    /// The names under plugin `namespace`.
    pub fn new(namespace: &str) -> Names {
        let name = |field: &str| format!("{namespace}.{field}");
        Names {
            outcome: name("outcome"),
            by: name("by"),
            limit: name("limit"),
            remaining: name("remaining"),
            flow_in_flight: name("flow_in_flight"),
            flow_waiting: name("flow_waiting"),
            flows: name("flows"),
            fair_share: name("fair_share"),
            cluster: name("cluster"),
            waited_ms: name("waited_ms"),
        }
    }
}

/// A request's decision.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Decision {
    /// The outcome.
    pub outcome: Outcome,
    /// What decided it.
    pub by: Option<By>,
    /// The tightest rule's standing (the refusing rule's, for a refusal).
    pub standing: Option<(u32, u64)>,
    /// For a request shed (or, in shadow, held back) by its flow: the flow's share of its class.
    pub share: Option<Share>,
    /// The chosen cluster (an index in `cluster_selection.clusters`).
    pub cluster: Option<usize>,
    /// How long it waited, ms: for a slot (`load_shedding.queue`), then for its turn (a token
    /// bucket's `max_delay`).
    pub waited_ms: Option<u64>,
}

impl Decision {
    /// A mechanism in shadow would have refused the request (the first such mechanism is kept).
    pub fn shadow(&mut self, by: By, standing: Option<&Standing>) {
        if self.outcome == Outcome::Admitted {
            self.outcome = Outcome::ShadowRefused;
            self.by = Some(by);
            if let Some(standing) = standing {
                self.standing = Some((standing.limit.get(), standing.remaining));
            }
        }
    }

    /// The request waited `waited_ms` for its turn, which rule `by` gave it (the outcome is
    /// `delayed` unless a shadow refusal named one).
    pub fn delayed(&mut self, by: By, waited_ms: u64) {
        if self.outcome == Outcome::Admitted {
            self.outcome = Outcome::Delayed;
            self.by = Some(by);
        }
        self.waited_ms = Some(self.waited_ms.unwrap_or(0).saturating_add(waited_ms));
    }

    /// A mechanism refused the request.
    pub fn refused(&mut self, outcome: Outcome, by: By, standing: Option<&Standing>) {
        self.outcome = outcome;
        self.by = Some(by);
        if let Some(standing) = standing {
            self.standing = Some((standing.limit.get(), standing.remaining));
        }
    }

    /// Its flow held the most of its class, which stood at `share`: shed (or, in shadow, it
    /// would have waited for its flow, unless a shadow refusal was named first).
    pub fn by_flow(&mut self, outcome: Outcome, share: Share) {
        if outcome == Outcome::ShadowRefused {
            if self.outcome != Outcome::Admitted {
                return;
            }
            self.shadow(By::Flow, None);
        } else {
            self.refused(outcome, By::Flow, None);
        }
        self.share = Some(share);
    }

    /// The request was admitted by rules standing at `standings`: the tightest one's limit and
    /// remaining, unless a shadow refusal already named one.
    pub fn admitted<'s>(&mut self, standings: impl IntoIterator<Item = &'s Standing>) {
        if self.standing.is_some() {
            return;
        }
        self.standing = standings
            .into_iter()
            .min_by(|a, b| a.remaining.cmp(&b.remaining).then(a.limit.cmp(&b.limit)))
            .map(|s| (s.limit.get(), s.remaining));
    }

    /// The filter-state fields the decision has, named as `names` says.
    pub fn fields<'n>(&self, filter: &Filter, names: &'n Names) -> Vec<(&'n str, String)> {
        let mut fields = vec![(names.outcome.as_str(), self.outcome.as_str().to_owned())];
        if let Some(by) = self.by {
            let name = match by {
                By::Rule(rule) => filter.config.rate_limits.get(rule).map_or("rate_limits", |r| r.name.as_str()),
                By::InFlight => "max_active_requests",
                By::LoopLag => "max_loop_lag",
                By::PerKey => "per_key",
                By::Flow => "flow",
                By::Partition => "partition",
                By::Selection => "cluster_selection",
            };
            fields.push((names.by.as_str(), name.to_owned()));
        }
        if let Some((limit, remaining)) = self.standing {
            fields.push((names.limit.as_str(), limit.to_string()));
            fields.push((names.remaining.as_str(), remaining.to_string()));
        }
        if let Some(share) = self.share {
            fields.push((names.flow_in_flight.as_str(), share.held.to_string()));
            fields.push((names.flow_waiting.as_str(), share.waiting.to_string()));
            fields.push((names.flows.as_str(), share.flows.max(1).to_string()));
            fields.push((names.fair_share.as_str(), share.fair_share_rounded().to_string()));
        }
        let cluster = self.cluster.and_then(|c| filter.config.cluster_selection.as_ref()?.clusters.get(c));
        if let Some(cluster) = cluster {
            fields.push((names.cluster.as_str(), cluster.as_str().to_owned()));
        }
        if let Some(waited_ms) = self.waited_ms {
            fields.push((names.waited_ms.as_str(), waited_ms.to_string()));
        }
        fields
    }
}
