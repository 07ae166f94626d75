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
//! | `<prefix>.load_shedding.<class>.flows` | gauge | flows active in the class, proxy-wide (its fair queues holding a slot or a waiter), refreshed every second (a class shared by flow: `flow`) |
//! | `<prefix>.load_shedding.<class>.fair_share_ppm` | gauge | each active flow's fair share of the class's slots, in millionths (1 000 000 ÷ `flows`; 0 while none), refreshed every second (`flow`) |
//! | `<prefix>.load_shedding.<class>.flow_wait_ms` | histogram | how long each admitted request of the class waited for its slot, in milliseconds (0 when admitted at once) (`flow`) |
//! | `<prefix>.load_shedding.<class>.shed_by_flow` | counter | requests of the class shed because their flow held the most of it: the class's queue was full, or their wait in a standing queue (`target`) ended; also in `shed` (`flow`) |
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
//! | `<prefix>.cluster_selection.contention` | counter | permit or grade writes that ran out of CAS attempts |
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
//!
//! Each stage declares its metrics once, as one list of (field, kind, name) entries
//! (`metric_ids!`): the list makes both the struct of the stage's ids and the function that
//! defines them, so a field's id is always the metric of its entry's name and kind. The table
//! above describes them: a unit test holds it to what the stages define (every metric, with its
//! kind), and docs/configuration.md's table is held to it by the docs' tests.

use crate::config::{Config, Consistency, CostSource, LoadShedding, RateLimitRule, Scope};

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

/// Declares the metric ids of one stage once, from one list of `field: Kind "name"` entries
/// (`Kind` a [`MetricKind`], `name` the last segments of the metric's name), each optionally
/// followed by `if condition` (defined only when it holds; its id `None` otherwise): the struct
/// (an `Option<u32>` per entry, documented by the entry's doc) and its `define_named`, which defines
/// every entry under the names its caller gives (`name(last segments)`), in list order. A stage
/// whose conditions read its configuration names it after the struct's name: `Stage(on: &T)`.
macro_rules! metric_ids {
    (@when) => { true };
    (@when $when:expr) => { $when };
    (
        $(#[$meta:meta])*
        pub struct $stage:ident $(($on:ident: $on_type:ty))? {
            $( $(#[$doc:meta])* $field:ident: $kind:ident $name:literal $(if $when:expr)?, )*
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, Default)]
        pub struct $stage {
            $( $(#[$doc])* pub $field: Option<u32>, )*
        }

        impl $stage {
            /// Defines the stage's metrics, each named `name(its last segments)`.
            fn define_named(metrics: &dyn Metrics, name: &dyn Fn(&str) -> String $(, $on: $on_type)?) -> $stage {
                $stage {
                    $( $field: define_if(metrics, metric_ids!(@when $($when)?), MetricKind::$kind, || name($name)), )*
                }
            }
        }
    };
}

/// Defines a metric of `kind` named `name()` when `when` holds.
fn define_if(metrics: &dyn Metrics, when: bool, kind: MetricKind, name: impl FnOnce() -> String) -> Option<u32> {
    if when {
        metrics.define(kind, &name())
    } else {
        None
    }
}

/// Whether a rule's cost is a count the upstream reports.
fn reported(rule: &RateLimitRule) -> bool {
    matches!(rule.cost.as_ref().map(|c| c.from), Some(CostSource::ResponseHeader | CostSource::ResponseBody))
}

/// Whether a rule's cost is read from the response body.
fn reads_body(rule: &RateLimitRule) -> bool {
    rule.cost.as_ref().is_some_and(|c| c.from == CostSource::ResponseBody)
}

/// Whether shedding has an in-flight limit (`max_active_requests`).
fn limits_in_flight(shedding: &LoadShedding) -> bool {
    shedding.max_active_requests.is_some()
}

/// Whether shedding has load leveling (`queue`, with the in-flight limit it needs).
fn levels(shedding: &LoadShedding) -> bool {
    shedding.queue.is_some() && limits_in_flight(shedding)
}

metric_ids! {
    /// Metric ids of one rule: `<prefix>.rate_limit.<rule>.<name>`.
    pub struct RuleStats(rule: &RateLimitRule) {
        /// Admitted.
        allowed: Counter "allowed",
        /// Refused.
        refused: Counter "rejected",
        /// Key part missing.
        skipped: Counter "skipped",
        /// CAS attempts exhausted.
        contention: Counter "contention",
        /// Live entries evicted.
        evictions: Counter "evictions",
        /// Gauge: units held in reserves, summed over the VMs.
        reserved: Gauge "reserved",
        /// Values that are not a count (cost, estimate or reported count).
        invalid_cost: Counter "invalid_cost",
        /// Units charged after admission.
        charged: Counter "charged",
        /// Units given back after admission (a count under the estimate).
        refunded: Counter "refunded" if reported(rule),
        /// Responses without a valid count, settled by policy.
        unreported: Counter "unreported" if reported(rule),
        /// Of those, bodies that could not be read.
        unreadable: Counter "unreadable" if reads_body(rule),
        /// Of those, bodies that came compressed (a `content-encoding`).
        unreadable_compressed: Counter "unreadable_compressed" if reads_body(rule),
        /// Requests the rule would have refused, let through in shadow.
        shadow_refused: Counter "shadow_rejected",
        /// Requests let in to wait for their turn (`max_delay`).
        delayed: Counter "delayed" if rule.max_delay.is_some(),
        /// Of those, requests whose client went away first.
        delay_abandoned: Counter "delay_abandoned" if rule.max_delay.is_some(),
    }
}

metric_ids! {
    /// Metric ids of one priority class: `<prefix>.load_shedding.<class>.<name>`.
    pub struct ClassStats(shedding: &LoadShedding) {
        /// Requests shed.
        shed: Counter "shed",
        /// Of those, shed for the loop lag (defined whenever shedding is: a dashboard's series
        /// exist, at 0, before lag shedding is turned on).
        shed_by_lag: Counter "shed_by_lag",
        /// Requests shedding would have refused (either signal), let through in shadow.
        shadow_shed: Counter "shadow_shed",
        /// Requests that waited for a slot (`queue`).
        queued: Counter "queued" if levels(shedding),
        /// Of those, admitted.
        dequeued: Counter "dequeued" if levels(shedding),
        /// Of those, shed when their wait ended.
        timed_out: Counter "queue_timeout" if levels(shedding),
        /// Of those, whose client went away.
        abandoned: Counter "queue_abandoned" if levels(shedding),
    }
}

metric_ids! {
    /// Metric ids of one priority class shared by flow (`load_shedding.flow`, or the class's
    /// own): `<prefix>.load_shedding.<class>.<name>`.
    pub struct FlowStats {
        /// Gauge: flows active in the class, proxy-wide (fair queues holding a slot or a waiter).
        flows: Gauge "flows",
        /// Gauge: each active flow's fair share of the class's slots, in millionths.
        fair_share_ppm: Gauge "fair_share_ppm",
        /// Histogram: how long each admitted request of the class waited for its slot, ms.
        flow_wait_ms: Histogram "flow_wait_ms",
        /// Requests shed because their flow held the most of the class.
        shed_by_flow: Counter "shed_by_flow",
    }
}

metric_ids! {
    /// Metric ids of load shedding as a whole: `<prefix>.load_shedding.<name>`. The per-key
    /// cap's are defined with the section, cap configured or not (as `shed_by_lag`).
    pub struct SheddingStats(shedding: &LoadShedding) {
        /// Histogram of the lag probes.
        loop_lag_ms: Histogram "loop_lag_ms",
        /// Requests shed on contention.
        contention: Counter "contention" if limits_in_flight(shedding),
        /// Gauge: the proxy-wide in-flight count.
        in_flight: Gauge "in_flight" if limits_in_flight(shedding),
        /// Gauge: requests waiting for a slot, proxy-wide.
        queue_length: Gauge "queue_length" if levels(shedding),
        /// Histogram: each wait for a slot, ms.
        queue_wait_ms: Histogram "queue_wait_ms" if levels(shedding),
        /// Requests over their key's cap.
        per_key_refused: Counter "per_key.refused",
        /// Requests whose key could not be counted.
        per_key_untracked: Counter "per_key.untracked",
        /// Requests without the cap's key.
        per_key_unkeyed: Counter "per_key.unkeyed",
        /// Requests the per-key cap would have refused, let through in shadow.
        per_key_shadow_refused: Counter "per_key.shadow_refused",
    }
}

metric_ids! {
    /// Metric ids of one cluster: `<prefix>.cluster.<cluster>.<name>`.
    pub struct ClusterStats {
        /// Routed to it.
        selected: Counter "selected",
        /// Succeeded in time.
        success: Counter "success",
        /// Succeeded slowly.
        slow: Counter "slow",
        /// Failed.
        failure: Counter "failure",
        /// Timed out.
        timeout: Counter "timeout",
        /// No response.
        ignored: Counter "ignored",
        /// Gauge: success rate in millionths.
        success_rate_ppm: Gauge "success_rate_ppm",
        /// Gauge: concurrency limit.
        concurrency_limit: Gauge "concurrency_limit",
        /// Gauge: permits held proxy-wide.
        in_flight: Gauge "in_flight",
    }
}

metric_ids! {
    /// Metric ids of cluster selection as a whole: `<prefix>.cluster_selection.<name>`. The
    /// partition's are defined with the section, partition configured or not.
    pub struct SelectionStats {
        /// Requests refused for lack of cluster capacity.
        exhausted: Counter "exhausted",
        /// Cluster-record writes that ran out of attempts.
        contention: Counter "contention",
        /// Requests routed outside their partition.
        partition_spilled: Counter "partition.spilled",
        /// Requests without the partition's key.
        partition_unkeyed: Counter "partition.unkeyed",
        /// Requests their partition would have refused, sent to another cluster in shadow.
        partition_shadow_refused: Counter "partition.shadow_refused",
    }
}

metric_ids! {
    /// Metric ids of the global scope's batches: `<prefix>.global.<name>`.
    pub struct GlobalStats {
        /// Batches sent.
        batches: Counter "batches",
        /// Batches confirmed.
        confirmed: Counter "confirmed",
        /// Batches failed.
        failures: Counter "failures",
        /// Counters sent.
        counters: Counter "counters",
        /// Admissions never sent.
        dropped: Counter "dropped",
        /// Shared-data errors.
        errors: Counter "errors",
        /// Gauge: age of the last confirmed batch.
        staleness_ms: Gauge "staleness_ms",
        /// Gauge: keys in the view.
        view_keys: Gauge "view_keys",
        /// Requests that asked the store.
        asked: Counter "asked",
        /// Asks without an answer.
        ask_failures: Counter "ask_failures",
        /// Gauge: the fleet size.
        proxies: Gauge "proxies",
    }
}

metric_ids! {
    /// Metric ids of the leased rules (`consistency: leased`): `<prefix>.lease.<name>`.
    pub struct LeaseStats {
        /// Calls sent.
        calls: Counter "calls",
        /// Calls failed.
        failures: Counter "failures",
        /// Requests that waited.
        waited: Counter "waited",
        /// Histogram: wait of each waiting request, ms.
        wait_ms: Histogram "wait_ms",
        /// Histogram: duration of each call, ms.
        call_ms: Histogram "call_ms",
        /// Decisions without the store.
        without_store: Counter "without_store",
        /// Units granted.
        granted: Counter "granted",
        /// Units given back.
        returned: Counter "returned",
        /// Gauge: units held.
        held: Gauge "held",
        /// Gauge: keys with a lease.
        keys: Gauge "keys",
    }
}

/// Whether `config` has a global rule of `consistency`.
fn global_rules(config: &Config, consistency: Consistency) -> bool {
    config.global.is_some() && config.rate_limits.iter().any(|r| r.scope == Scope::Global && r.consistency == consistency)
}

impl LeaseStats {
    /// Defines them, when `config` has a leased rule.
    pub fn define(config: &Config, metrics: &dyn Metrics) -> LeaseStats {
        if !global_rules(config, Consistency::Leased) {
            return LeaseStats::default();
        }
        let prefix = config.stat_prefix.as_str();
        LeaseStats::define_named(metrics, &|name| format!("{prefix}.lease.{name}"))
    }
}

/// All metric ids, defined once per configuration.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    /// Per rule, in configuration order.
    pub rules: Vec<RuleStats>,
    /// Per priority class, in configuration order.
    pub classes: Vec<ClassStats>,
    /// Per priority class, in configuration order: its flows', for a class shared by flow.
    pub flows: Vec<FlowStats>,
    /// Load shedding's, when the section is there.
    pub shedding: SheddingStats,
    /// Per cluster, in configuration order.
    pub clusters: Vec<ClusterStats>,
    /// Cluster selection's, when the section is there.
    pub selection: SelectionStats,
    /// The global scope's, when a rule is in it (batched).
    pub global: GlobalStats,
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
        let prefix = config.stat_prefix.as_str();
        let rules = config
            .rate_limits
            .iter()
            .map(|rule| RuleStats::define_named(metrics, &|name| format!("{prefix}.rate_limit.{}.{name}", rule.name), rule))
            .collect();
        let (classes, shedding) = config.load_shedding.as_ref().map_or_else(Default::default, |s| {
            let classes =
                s.classes.iter().map(|c| ClassStats::define_named(metrics, &|name| format!("{prefix}.load_shedding.{}.{name}", c.name), s)).collect();
            (classes, SheddingStats::define_named(metrics, &|name| format!("{prefix}.load_shedding.{name}"), s))
        });
        let flows = config.load_shedding.as_ref().filter(|s| levels(s)).map_or_else(Vec::new, |s| {
            let shared = |index: usize| s.flow_of(index).is_some();
            let define = |(index, class): (usize, &crate::config::PriorityClass)| {
                if shared(index) {
                    FlowStats::define_named(metrics, &|name| format!("{prefix}.load_shedding.{}.{name}", class.name))
                } else {
                    FlowStats::default()
                }
            };
            s.classes.iter().enumerate().map(define).collect()
        });
        let (clusters, selection) = config.cluster_selection.as_ref().map_or_else(Default::default, |s| {
            let clusters = s
                .clusters
                .iter()
                .map(|cluster| ClusterStats::define_named(metrics, &|name| format!("{prefix}.cluster.{}.{name}", metric_safe(cluster.as_str()))))
                .collect();
            (clusters, SelectionStats::define_named(metrics, &|name| format!("{prefix}.cluster_selection.{name}")))
        });
        let global = if global_rules(config, Consistency::Batched) {
            GlobalStats::define_named(metrics, &|name| format!("{prefix}.global.{name}"))
        } else {
            GlobalStats::default()
        };
        Stats { rules, classes, flows, shedding, clusters, selection, global }
    }

    /// The ids of cluster `index` (all absent for an unknown index).
    pub fn cluster(&self, index: usize) -> ClusterStats {
        self.clusters.get(index).copied().unwrap_or_default()
    }

    /// The ids of rule `index` (all absent for an unknown index).
    pub fn rule(&self, index: usize) -> RuleStats {
        self.rules.get(index).copied().unwrap_or_default()
    }

    /// The ids of priority class `index` (all absent for an unknown index).
    pub fn class(&self, index: usize) -> ClassStats {
        self.classes.get(index).copied().unwrap_or_default()
    }

    /// The flows' ids of class `index` (all absent for a class not shared by flow).
    pub fn flow(&self, index: usize) -> FlowStats {
        self.flows.get(index).copied().unwrap_or_default()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
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

    /// A configuration with every stage and every kind of rule.
    const EVERYTHING: &str = r#"{"stat_prefix":"fg","global":{"cluster":"sync"},
        "rate_limits":[
          {"name":"tokens","key":["source_ip"],"limit":100,"window":"1m","scope":"global",
           "cost":{"from":"response_body","path":"usage.total_tokens","estimate":{"default":10,"max":10}}},
          {"name":"units","key":["source_ip"],"limit":100,"window":"1m","scope":"global","consistency":"leased",
           "cost":{"from":"request_header","header":"x-units"}},
          {"name":"reported","key":["path"],"limit":9,"window":"1m","cost":{"from":"response_header","header":"x-units"}},
          {"name":"burst","key":["path"],"limit":10,"window":"1s","algorithm":"token_bucket","burst":5,"max_delay":"1s"}],
        "load_shedding":{"max_active_requests":10,"max_loop_lag":"50ms","queue":{"max_queued":3,"max_wait":"1s"},"flow":{"key":[{"header":"x-client"}]},
          "classes":[{"name":"high","shed_at":1.0},{"name":"low","shed_at":0.5}],"default_class":"high",
          "per_key":{"key":[{"header":"x-client"}],"max_active_requests":2}},
        "cluster_selection":{"clusters":["a","outbound|80||b"]}}"#;

    #[test]
    fn every_stage_defines_its_metrics_by_name_and_kind() {
        let everything = EVERYTHING;
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
         Counter fg.load_shedding.high.shed_by_flow\n\
         Counter fg.load_shedding.high.shed_by_lag\n\
         Counter fg.load_shedding.low.dequeued\n\
         Counter fg.load_shedding.low.queue_abandoned\n\
         Counter fg.load_shedding.low.queue_timeout\n\
         Counter fg.load_shedding.low.queued\n\
         Counter fg.load_shedding.low.shadow_shed\n\
         Counter fg.load_shedding.low.shed\n\
         Counter fg.load_shedding.low.shed_by_flow\n\
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
         Gauge fg.load_shedding.high.fair_share_ppm\n\
         Gauge fg.load_shedding.high.flows\n\
         Gauge fg.load_shedding.in_flight\n\
         Gauge fg.load_shedding.low.fair_share_ppm\n\
         Gauge fg.load_shedding.low.flows\n\
         Gauge fg.load_shedding.queue_length\n\
         Gauge fg.rate_limit.burst.reserved\n\
         Gauge fg.rate_limit.reported.reserved\n\
         Gauge fg.rate_limit.tokens.reserved\n\
         Gauge fg.rate_limit.units.reserved\n\
         Histogram fg.lease.call_ms\n\
         Histogram fg.lease.wait_ms\n\
         Histogram fg.load_shedding.high.flow_wait_ms\n\
         Histogram fg.load_shedding.loop_lag_ms\n\
         Histogram fg.load_shedding.low.flow_wait_ms\n\
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

    /// The metric `name` of [`EVERYTHING`], as the module's table writes it: its rule, class or
    /// cluster a placeholder.
    fn generalized(name: &str) -> String {
        let name = name.strip_prefix("fg.").unwrap_or(name);
        let segments: Vec<&str> = name.splitn(3, '.').collect();
        let placeholder = match segments.as_slice() {
            ["rate_limit", _, _] => Some("<rule>"),
            ["load_shedding", "high" | "low", _] => Some("<class>"),
            ["cluster", _, _] => Some("<cluster>"),
            _ => None,
        };
        match (placeholder, segments.as_slice()) {
            (Some(placeholder), [stage, _, rest]) => format!("<prefix>.{stage}.{placeholder}.{rest}"),
            _ => format!("<prefix>.{name}"),
        }
    }

    #[test]
    fn the_module_table_lists_every_metric_with_the_kind_its_stage_defines() {
        let source = include_str!("stats.rs");
        let doc = source.split("\nuse ").next().unwrap();
        let listed: Vec<String> = doc
            .lines()
            .filter_map(|l| l.strip_prefix("//! | `<prefix>."))
            .map(|row| {
                let (name, rest) = row.split_once("` | ").unwrap();
                let kind = rest.split(' ').next().unwrap();
                format!("{kind} <prefix>.{name}")
            })
            .collect();
        let mut once = listed.clone();
        once.sort();
        once.dedup();
        assert_eq!(once.len(), listed.len(), "a metric listed twice");
        let mut defined: Vec<String> = defined(EVERYTHING)
            .iter()
            .map(|d| {
                let (kind, name) = d.split_once(' ').unwrap();
                format!("{} {}", kind.to_lowercase(), generalized(name))
            })
            .collect();
        defined.sort();
        defined.dedup();
        assert!(defined.len() > 60, "{defined:?}");
        let unlisted: Vec<_> = defined.iter().filter(|d| !listed.contains(d)).collect();
        let undefined: Vec<_> = listed.iter().filter(|l| !defined.contains(l)).collect();
        assert!(unlisted.is_empty() && undefined.is_empty(), "the table lacks {unlisted:?} and lists {undefined:?} beyond the definitions");
    }

    #[test]
    fn each_id_is_its_field_s_metric() {
        let config = Config::parse(EVERYTHING.as_bytes()).unwrap();
        let metrics = Defined::default();
        let ids = format!("{:?},{:?}", Stats::define(&config, &metrics), LeaseStats::define(&config, &metrics));
        let names = metrics.0.into_inner();
        let mut seen = 0;
        for member in ids.split([',', '{', '[']) {
            let Some((field, id)) = member.trim().split_once(": Some(") else { continue };
            let id: usize = id.trim_end_matches([')', ' ', '}', ']']).parse().unwrap();
            let (_, name) = names[id - 1].split_once(' ').unwrap();
            let segments = name.replace('.', "_");
            let metric = match field {
                "timed_out" => "queue_timeout",
                "abandoned" => "queue_abandoned",
                // The code says refused; the metric keeps its documented name.
                "refused" if name.contains(".rate_limit.") => "rejected",
                "shadow_refused" if name.contains(".rate_limit.") => "shadow_rejected",
                other => other,
            };
            assert!(segments.ends_with(&format!("_{metric}")), "{field}: {name}");
            seen += 1;
        }
        assert_eq!(seen, names.len(), "every metric is a field's");
    }
}
