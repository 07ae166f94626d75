//! Every metric the filter defines, in one place. Envoy 1.40 shows them in `/stats` under
//! `wasmcustom.<name>`, and in `/stats/prometheus` as `<name>` with dots and dashes turned into
//! underscores (`floodgate_rate_limit_per_api_key_allowed`).
//!
//! | name | type | meaning |
//! |---|---|---|
//! | `<prefix>.rate_limit.<rule>.allowed` | counter | requests the rule admitted (and the request went on) |
//! | `<prefix>.rate_limit.<rule>.rejected` | counter | requests the rule refused with 429 |
//! | `<prefix>.rate_limit.<rule>.skipped` | counter | requests lacking a key part (`missing_key: skip`) |
//! | `<prefix>.rate_limit.<rule>.contention` | counter | requests refused because the counters could not be updated (CAS attempts ran out) |
//! | `<prefix>.rate_limit.<rule>.evictions` | counter | keys with live counts that lost their exact entry to a more frequent key (counts moved to the set's overflow) |
//! | `<prefix>.rate_limit.<rule>.invalid_cost` | counter | values that are not a count: a request's cost header, `content-length`, estimate header or body estimate (at admission, admitted or refused), a response's count (at settlement) |
//! | `<prefix>.rate_limit.<rule>.charged` | counter | units charged after admission (a streamed request body, a count the upstream reported) |
//! | `<prefix>.rate_limit.<rule>.refunded` | counter | units given back when a reported count came under the request's estimate, or a whole reservation by `"unreported": "refund"` (defined only for a cost the upstream reports) |
//! | `<prefix>.rate_limit.<rule>.unreported` | counter | responses that reported no valid count: settled by `cost.unreported` (or `cost.default`) (defined only for a cost the upstream reports) |
//! | `<prefix>.rate_limit.<rule>.unreadable` | counter | of those, responses whose body could not be read for a count: not JSON, nested too deep, longer than `cost.max_body_bytes`, or compressed (defined only for `response_body`) |
//! | `<prefix>.rate_limit.<rule>.unreadable_compressed` | counter | of those, responses that came compressed (a `content-encoding`): not read (defined only for `response_body`) |
//! | `<prefix>.rate_limit.<rule>.delayed` | counter | requests a token bucket with `max_delay` let in to wait for their turn (defined only for such a rule) |
//! | `<prefix>.rate_limit.<rule>.delay_abandoned` | counter | of those, requests whose client went away before their turn: their slot went back (defined only for such a rule) |
//! | `<prefix>.rate_limit.<rule>.reserved` | gauge | quota units workers counted ahead for their next requests and have not used yet, as of each worker's last heartbeat |
//! | `<prefix>.load_shedding.<class>.shed` | counter | requests of the class refused with 503 (for the in-flight count or the loop lag) |
//! | `<prefix>.load_shedding.<class>.shed_by_lag` | counter | of those, refused because this worker's event loop lagged (`max_loop_lag`; 0 without it) |
//! | `<prefix>.load_shedding.loop_lag_ms` | histogram | how late each worker's lag probe ran, in milliseconds, one sample per probe (`max_loop_lag`; no samples without it) |
//! | `<prefix>.load_shedding.contention` | counter | requests shed because the in-flight count could not be updated |
//! | `<prefix>.load_shedding.in_flight` | gauge | proxy-wide in-flight requests, refreshed every second (`max_active_requests`) |
//! | `<prefix>.load_shedding.<class>.queued` | counter | requests of the class the in-flight limit would have shed that waited for a slot instead (`queue`) |
//! | `<prefix>.load_shedding.<class>.dequeued` | counter | of those, admitted once a slot was theirs |
//! | `<prefix>.load_shedding.<class>.queue_timeout` | counter | of those, shed with 503 when their wait ended (`max_wait`, or `target` in a standing queue) |
//! | `<prefix>.load_shedding.<class>.queue_abandoned` | counter | of those, whose client went away while they waited |
//! | `<prefix>.load_shedding.queue_length` | gauge | requests waiting for a slot now, proxy-wide (every worker moves it by its own waiters) |
//! | `<prefix>.load_shedding.queue_wait_ms` | histogram | how long each waiting request waited, in milliseconds, until admitted or shed |
//! | `<prefix>.cluster.<cluster>.selected` | counter | requests routed to the cluster |
//! | `<prefix>.cluster.<cluster>.success` | counter | of those, answered in time with a non-failure status |
//! | `<prefix>.cluster.<cluster>.slow` | counter | answered successfully, slower than `concurrency_limit.timeout` |
//! | `<prefix>.cluster.<cluster>.failure` | counter | failure status, reset, connection failure, overflow, unknown cluster |
//! | `<prefix>.cluster.<cluster>.timeout` | counter | upstream timeouts (`504`, flags UT / UMSDR) |
//! | `<prefix>.cluster.<cluster>.ignored` | counter | ended without a response (client left first) |
//! | `<prefix>.cluster.<cluster>.success_rate_ppm` | gauge | the success rate the shuffle uses, in millionths, set at configuration and refreshed every second |
//! | `<prefix>.cluster.<cluster>.concurrency_limit` | gauge | the cluster's current concurrency limit, set at configuration and refreshed every second |
//! | `<prefix>.cluster.<cluster>.in_flight` | gauge | permits held on the cluster (requests routed to it and not ended), proxy-wide, set at configuration and refreshed every second |
//! | `<prefix>.cluster_selection.exhausted` | counter | requests refused with 503: no cluster had room |
//! | `<prefix>.cluster_selection.contention` | counter | permit or outcome writes that ran out of CAS attempts |
//! | `<prefix>.cluster_selection.partition.spilled` | counter | requests routed outside their key's partition (`when_unavailable: spill`; 0 without `partition`) |
//! | `<prefix>.cluster_selection.partition.unkeyed` | counter | requests without the partition's key: they may use every cluster (0 without `partition`) |
//! | `<prefix>.load_shedding.per_key.refused` | counter | requests refused with 503: their key had `per_key.max_active_requests` in flight (0 without `per_key`) |
//! | `<prefix>.load_shedding.per_key.untracked` | counter | requests refused with 503: their key could not be counted (no free entry in its set, or contention) |
//! | `<prefix>.load_shedding.per_key.unkeyed` | counter | requests without the cap's key: not capped |
//! | `<prefix>.rate_limit.<rule>.shadow_rejected` | counter | requests the rule, in shadow, would have refused |
//! | `<prefix>.load_shedding.<class>.shadow_shed` | counter | requests of the class shedding, in shadow, would have refused (either signal) |
//! | `<prefix>.load_shedding.per_key.shadow_refused` | counter | requests the per-key cap, in shadow, would have refused |
//! | `<prefix>.cluster_selection.partition.shadow_refused` | counter | requests their partition, in shadow, had no room for |
//! | `<prefix>.global.batches` | counter | batches sent to `floodgate-sync` (retries included) |
//! | `<prefix>.global.confirmed` | counter | batches the store confirmed |
//! | `<prefix>.global.failures` | counter | batches that failed (a non-`200`, no answer, an unreadable answer), to be sent again |
//! | `<prefix>.global.counters` | counter | counters sent in batches |
//! | `<prefix>.global.dropped` | counter | admitted requests never sent to the store: their bucket ended first, or the VM's buffer was full |
//! | `<prefix>.global.errors` | counter | shared-data errors met by the global machinery |
//! | `<prefix>.global.staleness_ms` | gauge | how long ago the proxy's last batch was confirmed (its view of the fleet's counts is that old), refreshed every `sync_interval` |
//! | `<prefix>.global.view_keys` | gauge | keys whose fleet-wide counts the proxy knows |
//! | `<prefix>.global.asked` | counter | requests that asked the store for their units (a key not learned, or room the projection would not give) |
//! | `<prefix>.global.ask_failures` | counter | asks that got no answer: decided without the store |
//! | `<prefix>.global.proxies` | gauge | the fleet size the store last gave (0: not known yet) |
//! | `<prefix>.lease.calls` | counter | calls to `floodgate-sync`'s `/v1/lease` (for waiting requests, refills of running-low leases, give-backs) |
//! | `<prefix>.lease.failures` | counter | of those, failed (not sent, a non-`200`, no answer within `lease_timeout`, an unreadable answer) |
//! | `<prefix>.lease.waited` | counter | requests that waited for the store (their key's lease in this proxy was empty) |
//! | `<prefix>.lease.wait_ms` | histogram | how long each waiting request waited, in milliseconds, until it was decided by the store's answer |
//! | `<prefix>.lease.call_ms` | histogram | how long each call took, in milliseconds, answered or failed |
//! | `<prefix>.lease.without_store` | counter | decisions made without the store (after a failure of the key's call, or a wait past `lease_timeout + timeout`), by `on_store_failure` |
//! | `<prefix>.lease.granted` | counter | units the store granted to this proxy |
//! | `<prefix>.lease.returned` | counter | unused units this proxy gave back |
//! | `<prefix>.lease.held` | gauge | units the proxy holds and has not used, of the keys a worker follows, as of that worker's last heartbeat (each worker sets it) |
//! | `<prefix>.lease.keys` | gauge | keys a worker follows (it took units of them), likewise |
//!
//! A cluster name's characters other than letters, digits, `-`, `_` and `.` appear as `_` in
//! metric names (`outbound|80||a.b` → `outbound_80__a.b`).

use crate::config::{Config, Consistency, CostSource, Scope};

/// What a metric is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetricKind {
    /// Only grows.
    Counter,
    /// Set, or moved by several VMs each by its share.
    Gauge,
    /// Samples.
    Histogram,
}

/// The host's metrics: Envoy's stats through proxy-wasm in the module, a map in tests.
pub trait Metrics {
    /// Defines a metric (every VM that defines the same name gets the same stat); its id, or
    /// `None` if the host refused.
    fn define(&self, kind: MetricKind, name: &str) -> Option<u32>;
    /// Adds `delta` to a counter (`delta` > 0) or a gauge.
    fn add(&self, id: u32, delta: i64);
    /// Sets a gauge, or records a histogram sample.
    fn record(&self, id: u32, value: u64);
}

/// Adds `n` to a counter (nothing for 0).
pub fn add_count<M: Metrics + ?Sized>(metrics: &M, id: Option<u32>, n: u64) {
    if let (Some(id), Ok(n @ 1..)) = (id, i64::try_from(n)) {
        metrics.add(id, n);
    }
}

/// Adds one to a counter.
pub fn increment<M: Metrics + ?Sized>(metrics: &M, id: Option<u32>) {
    if let Some(id) = id {
        metrics.add(id, 1);
    }
}

/// Moves a gauge by `delta` (a gauge that several VMs feed, each with its own share).
pub fn add<M: Metrics + ?Sized>(metrics: &M, id: Option<u32>, delta: i64) {
    if let (Some(id), false) = (id, delta == 0) {
        metrics.add(id, delta);
    }
}

/// Sets a gauge, or records a histogram sample.
pub fn set<M: Metrics + ?Sized>(metrics: &M, id: Option<u32>, value: u64) {
    if let Some(id) = id {
        metrics.record(id, value);
    }
}

/// Metric ids of one rule.
#[derive(Clone, Copy, Debug, Default)]
pub struct RuleStats {
    /// Admitted.
    pub allowed: Option<u32>,
    /// Refused.
    pub rejected: Option<u32>,
    /// Key part missing.
    pub skipped: Option<u32>,
    /// CAS attempts exhausted.
    pub contention: Option<u32>,
    /// Live entries evicted.
    pub evictions: Option<u32>,
    /// Gauge: units held in reserves, summed over the VMs.
    pub reserved: Option<u32>,
    /// Values that are not a count (cost, estimate or reported count).
    pub invalid_cost: Option<u32>,
    /// Units charged after admission.
    pub charged: Option<u32>,
    /// Units given back after admission (a count under the estimate).
    pub refunded: Option<u32>,
    /// Responses without a valid count, settled by policy.
    pub unreported: Option<u32>,
    /// Of those, bodies that could not be read.
    pub unreadable: Option<u32>,
    /// Of those, bodies that came compressed (a `content-encoding`).
    pub unreadable_compressed: Option<u32>,
    /// Requests the rule would have refused, let through in shadow.
    pub shadow_rejected: Option<u32>,
    /// Requests let in to wait for their turn (`max_delay`).
    pub delayed: Option<u32>,
    /// Of those, requests whose client went away first.
    pub delay_abandoned: Option<u32>,
}

/// All metric ids, defined once per configuration.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Per rule, in configuration order.
    pub rules: Vec<RuleStats>,
    /// Per priority class, in configuration order: requests shed.
    pub shed: Vec<Option<u32>>,
    /// Per priority class: requests shed for the loop lag.
    pub shed_by_lag: Vec<Option<u32>>,
    /// Per priority class: requests shedding would have refused (either signal), let through in
    /// shadow.
    pub shadow_shed: Vec<Option<u32>>,
    /// Histogram of the lag probes.
    pub loop_lag_ms: Option<u32>,
    /// Requests shed on contention.
    pub shed_contention: Option<u32>,
    /// The in-flight gauge.
    pub in_flight: Option<u32>,
    /// Load leveling's (`queue`).
    pub queue: QueueStats,
    /// Per cluster, in configuration order.
    pub clusters: Vec<ClusterStats>,
    /// Requests refused for lack of cluster capacity.
    pub exhausted: Option<u32>,
    /// Cluster-record writes that ran out of attempts.
    pub selection_contention: Option<u32>,
    /// Requests routed outside their partition.
    pub partition_spilled: Option<u32>,
    /// Requests without the partition's key.
    pub partition_unkeyed: Option<u32>,
    /// Requests over their key's cap.
    pub per_key_refused: Option<u32>,
    /// Requests whose key could not be counted.
    pub per_key_untracked: Option<u32>,
    /// Requests without the cap's key.
    pub per_key_unkeyed: Option<u32>,
    /// Requests the per-key cap would have refused, let through in shadow.
    pub per_key_shadow_refused: Option<u32>,
    /// Requests their partition would have refused, sent to another cluster in shadow.
    pub partition_shadow_refused: Option<u32>,
    /// The global scope's, when a rule is in it.
    pub global: GlobalStats,
}

/// Metric ids of load leveling (`load_shedding.queue`).
#[derive(Clone, Debug, Default)]
pub struct QueueStats {
    /// Per priority class, in configuration order.
    pub classes: Vec<QueueClassStats>,
    /// Gauge: requests waiting, proxy-wide.
    pub length: Option<u32>,
    /// Histogram: each wait, ms.
    pub wait_ms: Option<u32>,
}

/// Metric ids of one class's queue.
#[derive(Clone, Copy, Debug, Default)]
pub struct QueueClassStats {
    /// Requests that waited.
    pub queued: Option<u32>,
    /// Of those, admitted.
    pub dequeued: Option<u32>,
    /// Of those, shed when their wait ended.
    pub timed_out: Option<u32>,
    /// Of those, whose client went away.
    pub abandoned: Option<u32>,
}

impl QueueStats {
    /// The ids of class `index` (all absent for an unknown index).
    pub fn class(&self, index: usize) -> QueueClassStats {
        self.classes.get(index).copied().unwrap_or_default()
    }
}

/// Metric ids of the global scope.
#[derive(Clone, Copy, Debug, Default)]
pub struct GlobalStats {
    /// Batches sent.
    pub batches: Option<u32>,
    /// Batches confirmed.
    pub confirmed: Option<u32>,
    /// Batches failed.
    pub failures: Option<u32>,
    /// Counters sent.
    pub counters: Option<u32>,
    /// Admissions never sent.
    pub dropped: Option<u32>,
    /// Shared-data errors.
    pub errors: Option<u32>,
    /// Gauge: age of the last confirmed batch.
    pub staleness_ms: Option<u32>,
    /// Gauge: keys in the view.
    pub view_keys: Option<u32>,
    /// Requests that asked the store.
    pub asked: Option<u32>,
    /// Asks without an answer.
    pub ask_failures: Option<u32>,
    /// Gauge: the fleet size.
    pub proxies: Option<u32>,
}

/// Metric ids of the leased rules (`consistency: leased`).
#[derive(Clone, Copy, Debug, Default)]
pub struct LeaseStats {
    /// Calls sent.
    pub calls: Option<u32>,
    /// Calls failed.
    pub failures: Option<u32>,
    /// Requests that waited.
    pub waited: Option<u32>,
    /// Histogram: wait of each waiting request, ms.
    pub wait_ms: Option<u32>,
    /// Histogram: duration of each call, ms.
    pub call_ms: Option<u32>,
    /// Decisions without the store.
    pub without_store: Option<u32>,
    /// Units granted.
    pub granted: Option<u32>,
    /// Units given back.
    pub returned: Option<u32>,
    /// Gauge: units held.
    pub held: Option<u32>,
    /// Gauge: keys with a lease.
    pub keys: Option<u32>,
}

impl LeaseStats {
    /// Defines them, when `config` has a leased rule.
    pub fn define(config: &Config, metrics: &dyn Metrics) -> LeaseStats {
        let d = Define(metrics);
        let leased = config.global.is_some()
            && config.rate_limits.iter().any(|r| r.scope == Scope::Global && r.consistency == Consistency::Leased);
        if !leased {
            return LeaseStats::default();
        }
        let name = |what: &str| format!("{}.lease.{what}", config.stat_prefix.as_str());
        LeaseStats {
            calls: d.counter(&name("calls")),
            failures: d.counter(&name("failures")),
            waited: d.counter(&name("waited")),
            wait_ms: d.histogram(&name("wait_ms")),
            call_ms: d.histogram(&name("call_ms")),
            without_store: d.counter(&name("without_store")),
            granted: d.counter(&name("granted")),
            returned: d.counter(&name("returned")),
            held: d.gauge(&name("held")),
            keys: d.gauge(&name("keys")),
        }
    }
}

/// Metric ids of one cluster.
#[derive(Clone, Copy, Debug, Default)]
pub struct ClusterStats {
    /// Routed to it.
    pub selected: Option<u32>,
    /// Succeeded in time.
    pub success: Option<u32>,
    /// Succeeded slowly.
    pub slow: Option<u32>,
    /// Failed.
    pub failure: Option<u32>,
    /// Timed out.
    pub timeout: Option<u32>,
    /// No response.
    pub ignored: Option<u32>,
    /// Gauge: success rate in millionths.
    pub success_rate_ppm: Option<u32>,
    /// Gauge: concurrency limit.
    pub concurrency_limit: Option<u32>,
    /// Gauge: permits held proxy-wide.
    pub in_flight: Option<u32>,
}

/// Defines metrics of one kind.
struct Define<'m>(&'m dyn Metrics);

impl Define<'_> {
    fn counter(&self, name: &str) -> Option<u32> {
        self.0.define(MetricKind::Counter, name)
    }
    fn gauge(&self, name: &str) -> Option<u32> {
        self.0.define(MetricKind::Gauge, name)
    }
    fn histogram(&self, name: &str) -> Option<u32> {
        self.0.define(MetricKind::Histogram, name)
    }
}

/// A cluster name as a metric-name segment: characters other than letters, digits, `-`, `_`
/// and `.` become `_`.
fn metric_safe(name: &str) -> String {
    name.chars()
        .map(|c| if c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.') { c } else { '_' })
        .collect()
}

impl Stats {
    /// Defines every metric of `config`.
    pub fn define(config: &Config, metrics: &dyn Metrics) -> Stats {
        let d = Define(metrics);
        let prefix = config.stat_prefix.as_str();
        let rules = config
            .rate_limits
            .iter()
            .map(|rule| {
                let name = |what: &str| format!("{prefix}.rate_limit.{}.{what}", rule.name);
                let from = rule.cost.as_ref().map(|c| c.from);
                let body = from == Some(CostSource::ResponseBody);
                let reported = body || from == Some(CostSource::ResponseHeader);
                RuleStats {
                    allowed: d.counter(&name("allowed")),
                    rejected: d.counter(&name("rejected")),
                    skipped: d.counter(&name("skipped")),
                    contention: d.counter(&name("contention")),
                    evictions: d.counter(&name("evictions")),
                    reserved: d.gauge(&name("reserved")),
                    invalid_cost: d.counter(&name("invalid_cost")),
                    charged: d.counter(&name("charged")),
                    refunded: reported.then(|| d.counter(&name("refunded"))).flatten(),
                    unreported: reported.then(|| d.counter(&name("unreported"))).flatten(),
                    unreadable: body.then(|| d.counter(&name("unreadable"))).flatten(),
                    unreadable_compressed: body.then(|| d.counter(&name("unreadable_compressed"))).flatten(),
                    shadow_rejected: d.counter(&name("shadow_rejected")),
                    delayed: rule.max_delay.and_then(|_| d.counter(&name("delayed"))),
                    delay_abandoned: rule.max_delay.and_then(|_| d.counter(&name("delay_abandoned"))),
                }
            })
            .collect();
        let shedding = config.load_shedding.as_ref();
        let shed = shedding.map_or_else(Vec::new, |s| {
            s.classes
                .iter()
                .map(|c| d.counter(&format!("{prefix}.load_shedding.{}.shed", c.name)))
                .collect()
        });
        // Defined whenever shedding is: a dashboard's series exist (at 0) before lag shedding is
        // turned on.
        let by_lag = shedding;
        let shed_by_lag = by_lag.map_or_else(Vec::new, |s| {
            s.classes
                .iter()
                .map(|c| d.counter(&format!("{prefix}.load_shedding.{}.shed_by_lag", c.name)))
                .collect()
        });
        let shadow_shed = shedding.map_or_else(Vec::new, |s| {
            s.classes
                .iter()
                .map(|c| d.counter(&format!("{prefix}.load_shedding.{}.shadow_shed", c.name)))
                .collect()
        });
        let loop_lag_ms = by_lag.and_then(|_| d.histogram(&format!("{prefix}.load_shedding.loop_lag_ms")));
        let in_flight_limit = shedding.filter(|s| s.max_active_requests.is_some());
        let shed_contention = in_flight_limit.and_then(|_| d.counter(&format!("{prefix}.load_shedding.contention")));
        let in_flight = in_flight_limit.and_then(|_| d.gauge(&format!("{prefix}.load_shedding.in_flight")));
        let queue = shedding.filter(|s| s.queue.is_some() && s.max_active_requests.is_some()).map_or_else(QueueStats::default, |s| QueueStats {
            classes: s
                .classes
                .iter()
                .map(|c| {
                    let name = |what: &str| format!("{prefix}.load_shedding.{}.{what}", c.name);
                    QueueClassStats {
                        queued: d.counter(&name("queued")),
                        dequeued: d.counter(&name("dequeued")),
                        timed_out: d.counter(&name("queue_timeout")),
                        abandoned: d.counter(&name("queue_abandoned")),
                    }
                })
                .collect(),
            length: d.gauge(&format!("{prefix}.load_shedding.queue_length")),
            wait_ms: d.histogram(&format!("{prefix}.load_shedding.queue_wait_ms")),
        });
        let selection = config.cluster_selection.as_ref();
        let clusters = selection.map_or_else(Vec::new, |s| {
            s.clusters
                .iter()
                .map(|cluster| {
                    let base = format!("{prefix}.cluster.{}", metric_safe(cluster.as_str()));
                    ClusterStats {
                        selected: d.counter(&format!("{base}.selected")),
                        success: d.counter(&format!("{base}.success")),
                        slow: d.counter(&format!("{base}.slow")),
                        failure: d.counter(&format!("{base}.failure")),
                        timeout: d.counter(&format!("{base}.timeout")),
                        ignored: d.counter(&format!("{base}.ignored")),
                        success_rate_ppm: d.gauge(&format!("{base}.success_rate_ppm")),
                        concurrency_limit: d.gauge(&format!("{base}.concurrency_limit")),
                        in_flight: d.gauge(&format!("{base}.in_flight")),
                    }
                })
                .collect()
        });
        let global = if config.global.is_some()
            && config.rate_limits.iter().any(|r| r.scope == Scope::Global && r.consistency == Consistency::Batched)
        {
            let name = |what: &str| format!("{prefix}.global.{what}");
            GlobalStats {
                batches: d.counter(&name("batches")),
                confirmed: d.counter(&name("confirmed")),
                failures: d.counter(&name("failures")),
                counters: d.counter(&name("counters")),
                dropped: d.counter(&name("dropped")),
                errors: d.counter(&name("errors")),
                staleness_ms: d.gauge(&name("staleness_ms")),
                view_keys: d.gauge(&name("view_keys")),
                asked: d.counter(&name("asked")),
                ask_failures: d.counter(&name("ask_failures")),
                proxies: d.gauge(&name("proxies")),
            }
        } else {
            GlobalStats::default()
        };
        // Defined with their sections, partition or cap configured or not (as shed_by_lag): a
        // dashboard's series exist, at 0, before the bulkhead is turned on.
        let (partition, per_key) = (config.cluster_selection.as_ref(), config.load_shedding.as_ref());
        Stats {
            global,
            rules,
            shed,
            shed_by_lag,
            shadow_shed,
            loop_lag_ms,
            shed_contention,
            in_flight,
            queue,
            clusters,
            exhausted: selection.and_then(|_| d.counter(&format!("{prefix}.cluster_selection.exhausted"))),
            selection_contention: selection.and_then(|_| d.counter(&format!("{prefix}.cluster_selection.contention"))),
            partition_spilled: partition.and_then(|_| d.counter(&format!("{prefix}.cluster_selection.partition.spilled"))),
            partition_unkeyed: partition.and_then(|_| d.counter(&format!("{prefix}.cluster_selection.partition.unkeyed"))),
            per_key_refused: per_key.and_then(|_| d.counter(&format!("{prefix}.load_shedding.per_key.refused"))),
            per_key_untracked: per_key.and_then(|_| d.counter(&format!("{prefix}.load_shedding.per_key.untracked"))),
            per_key_unkeyed: per_key.and_then(|_| d.counter(&format!("{prefix}.load_shedding.per_key.unkeyed"))),
            per_key_shadow_refused: per_key.and_then(|_| d.counter(&format!("{prefix}.load_shedding.per_key.shadow_refused"))),
            partition_shadow_refused: partition.and_then(|_| d.counter(&format!("{prefix}.cluster_selection.partition.shadow_refused"))),
        }
    }

    /// The ids of cluster `index` (all absent for an unknown index).
    pub fn cluster(&self, index: usize) -> ClusterStats {
        self.clusters.get(index).copied().unwrap_or_default()
    }

    /// The ids of rule `index` (all absent for an unknown index).
    pub fn rule(&self, index: usize) -> RuleStats {
        self.rules.get(index).copied().unwrap_or_default()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// Every metric defined, as `kind name`.
    #[derive(Default)]
    struct Defined(RefCell<Vec<String>>);

    impl Metrics for Defined {
        fn define(&self, kind: MetricKind, name: &str) -> Option<u32> {
            let mut names = self.0.borrow_mut();
            names.push(format!("{kind:?} {name}"));
            u32::try_from(names.len()).ok()
        }
        fn add(&self, _id: u32, _delta: i64) {}
        fn record(&self, _id: u32, _value: u64) {}
    }

    /// The metrics `config` defines, sorted.
    fn defined(config: &str) -> Vec<String> {
        let config = Config::parse(config.as_bytes()).unwrap();
        let metrics = Defined::default();
        Stats::define(&config, &metrics);
        LeaseStats::define(&config, &metrics);
        let mut names = metrics.0.into_inner();
        names.sort();
        names
    }

    #[test]
    fn every_stage_defines_its_metrics_by_name_and_kind() {
        let everything = r#"{"stat_prefix":"fg","global":{"cluster":"sync"},
            "rate_limits":[
              {"name":"tokens","key":["source_ip"],"limit":100,"window":"1m","scope":"global",
               "cost":{"from":"response_body","path":"usage.total_tokens","estimate":{"default":10,"max":10}}},
              {"name":"units","key":["source_ip"],"limit":100,"window":"1m","scope":"global","consistency":"leased",
               "cost":{"from":"request_header","header":"x-units"}},
              {"name":"reported","key":["path"],"limit":9,"window":"1m","cost":{"from":"response_header","header":"x-units"}},
              {"name":"burst","key":["path"],"limit":10,"window":"1s","algorithm":"token_bucket","burst":5,"max_delay":"1s"}],
            "load_shedding":{"max_active_requests":10,"max_loop_lag":"50ms","queue":{"max_queued":3,"max_wait":"1s"},
              "classes":[{"name":"high","shed_at":1.0},{"name":"low","shed_at":0.5}],"default_class":"high",
              "per_key":{"key":[{"header":"x-client"}],"max_active_requests":2}},
            "cluster_selection":{"clusters":["a","outbound|80||b"]}}"#;
        assert_eq!(defined(everything).join("\n"), "\
         Counter fg.cluster.a.failure\n\
         Counter fg.cluster.a.ignored\n\
         Counter fg.cluster.a.selected\n\
         Counter fg.cluster.a.slow\n\
         Counter fg.cluster.a.success\n\
         Counter fg.cluster.a.timeout\n\
         Counter fg.cluster.outbound_80__b.failure\n\
         Counter fg.cluster.outbound_80__b.ignored\n\
         Counter fg.cluster.outbound_80__b.selected\n\
         Counter fg.cluster.outbound_80__b.slow\n\
         Counter fg.cluster.outbound_80__b.success\n\
         Counter fg.cluster.outbound_80__b.timeout\n\
         Counter fg.cluster_selection.contention\n\
         Counter fg.cluster_selection.exhausted\n\
         Counter fg.cluster_selection.partition.shadow_refused\n\
         Counter fg.cluster_selection.partition.spilled\n\
         Counter fg.cluster_selection.partition.unkeyed\n\
         Counter fg.global.ask_failures\n\
         Counter fg.global.asked\n\
         Counter fg.global.batches\n\
         Counter fg.global.confirmed\n\
         Counter fg.global.counters\n\
         Counter fg.global.dropped\n\
         Counter fg.global.errors\n\
         Counter fg.global.failures\n\
         Counter fg.lease.calls\n\
         Counter fg.lease.failures\n\
         Counter fg.lease.granted\n\
         Counter fg.lease.returned\n\
         Counter fg.lease.waited\n\
         Counter fg.lease.without_store\n\
         Counter fg.load_shedding.contention\n\
         Counter fg.load_shedding.high.dequeued\n\
         Counter fg.load_shedding.high.queue_abandoned\n\
         Counter fg.load_shedding.high.queue_timeout\n\
         Counter fg.load_shedding.high.queued\n\
         Counter fg.load_shedding.high.shadow_shed\n\
         Counter fg.load_shedding.high.shed\n\
         Counter fg.load_shedding.high.shed_by_lag\n\
         Counter fg.load_shedding.low.dequeued\n\
         Counter fg.load_shedding.low.queue_abandoned\n\
         Counter fg.load_shedding.low.queue_timeout\n\
         Counter fg.load_shedding.low.queued\n\
         Counter fg.load_shedding.low.shadow_shed\n\
         Counter fg.load_shedding.low.shed\n\
         Counter fg.load_shedding.low.shed_by_lag\n\
         Counter fg.load_shedding.per_key.refused\n\
         Counter fg.load_shedding.per_key.shadow_refused\n\
         Counter fg.load_shedding.per_key.unkeyed\n\
         Counter fg.load_shedding.per_key.untracked\n\
         Counter fg.rate_limit.burst.allowed\n\
         Counter fg.rate_limit.burst.charged\n\
         Counter fg.rate_limit.burst.contention\n\
         Counter fg.rate_limit.burst.delay_abandoned\n\
         Counter fg.rate_limit.burst.delayed\n\
         Counter fg.rate_limit.burst.evictions\n\
         Counter fg.rate_limit.burst.invalid_cost\n\
         Counter fg.rate_limit.burst.rejected\n\
         Counter fg.rate_limit.burst.shadow_rejected\n\
         Counter fg.rate_limit.burst.skipped\n\
         Counter fg.rate_limit.reported.allowed\n\
         Counter fg.rate_limit.reported.charged\n\
         Counter fg.rate_limit.reported.contention\n\
         Counter fg.rate_limit.reported.evictions\n\
         Counter fg.rate_limit.reported.invalid_cost\n\
         Counter fg.rate_limit.reported.refunded\n\
         Counter fg.rate_limit.reported.rejected\n\
         Counter fg.rate_limit.reported.shadow_rejected\n\
         Counter fg.rate_limit.reported.skipped\n\
         Counter fg.rate_limit.reported.unreported\n\
         Counter fg.rate_limit.tokens.allowed\n\
         Counter fg.rate_limit.tokens.charged\n\
         Counter fg.rate_limit.tokens.contention\n\
         Counter fg.rate_limit.tokens.evictions\n\
         Counter fg.rate_limit.tokens.invalid_cost\n\
         Counter fg.rate_limit.tokens.refunded\n\
         Counter fg.rate_limit.tokens.rejected\n\
         Counter fg.rate_limit.tokens.shadow_rejected\n\
         Counter fg.rate_limit.tokens.skipped\n\
         Counter fg.rate_limit.tokens.unreadable\n\
         Counter fg.rate_limit.tokens.unreadable_compressed\n\
         Counter fg.rate_limit.tokens.unreported\n\
         Counter fg.rate_limit.units.allowed\n\
         Counter fg.rate_limit.units.charged\n\
         Counter fg.rate_limit.units.contention\n\
         Counter fg.rate_limit.units.evictions\n\
         Counter fg.rate_limit.units.invalid_cost\n\
         Counter fg.rate_limit.units.rejected\n\
         Counter fg.rate_limit.units.shadow_rejected\n\
         Counter fg.rate_limit.units.skipped\n\
         Gauge fg.cluster.a.concurrency_limit\n\
         Gauge fg.cluster.a.in_flight\n\
         Gauge fg.cluster.a.success_rate_ppm\n\
         Gauge fg.cluster.outbound_80__b.concurrency_limit\n\
         Gauge fg.cluster.outbound_80__b.in_flight\n\
         Gauge fg.cluster.outbound_80__b.success_rate_ppm\n\
         Gauge fg.global.proxies\n\
         Gauge fg.global.staleness_ms\n\
         Gauge fg.global.view_keys\n\
         Gauge fg.lease.held\n\
         Gauge fg.lease.keys\n\
         Gauge fg.load_shedding.in_flight\n\
         Gauge fg.load_shedding.queue_length\n\
         Gauge fg.rate_limit.burst.reserved\n\
         Gauge fg.rate_limit.reported.reserved\n\
         Gauge fg.rate_limit.tokens.reserved\n\
         Gauge fg.rate_limit.units.reserved\n\
         Histogram fg.lease.call_ms\n\
         Histogram fg.lease.wait_ms\n\
         Histogram fg.load_shedding.loop_lag_ms\n\
         Histogram fg.load_shedding.queue_wait_ms");
        let plain = r#"{"rate_limits":[{"name":"r","key":["path"],"limit":5,"window":"1m"}],
            "load_shedding":{"max_loop_lag":"50ms"}}"#;
        assert_eq!(defined(plain).join("\n"), "\
         Counter floodgate.load_shedding.critical.shadow_shed\n\
         Counter floodgate.load_shedding.critical.shed\n\
         Counter floodgate.load_shedding.critical.shed_by_lag\n\
         Counter floodgate.load_shedding.low.shadow_shed\n\
         Counter floodgate.load_shedding.low.shed\n\
         Counter floodgate.load_shedding.low.shed_by_lag\n\
         Counter floodgate.load_shedding.normal.shadow_shed\n\
         Counter floodgate.load_shedding.normal.shed\n\
         Counter floodgate.load_shedding.normal.shed_by_lag\n\
         Counter floodgate.load_shedding.per_key.refused\n\
         Counter floodgate.load_shedding.per_key.shadow_refused\n\
         Counter floodgate.load_shedding.per_key.unkeyed\n\
         Counter floodgate.load_shedding.per_key.untracked\n\
         Counter floodgate.rate_limit.r.allowed\n\
         Counter floodgate.rate_limit.r.charged\n\
         Counter floodgate.rate_limit.r.contention\n\
         Counter floodgate.rate_limit.r.evictions\n\
         Counter floodgate.rate_limit.r.invalid_cost\n\
         Counter floodgate.rate_limit.r.rejected\n\
         Counter floodgate.rate_limit.r.shadow_rejected\n\
         Counter floodgate.rate_limit.r.skipped\n\
         Gauge floodgate.rate_limit.r.reserved\n\
         Histogram floodgate.load_shedding.loop_lag_ms");
        assert!(defined("{}").is_empty());
    }
}
