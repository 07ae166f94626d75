//! The service's metrics, declared in one place and rendered as Prometheus text
//! (`GET /metrics`, text format 0.0.4). Plain atomics: no registry, no labels beyond the ones
//! listed in [`ErrorKind`].

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Why a request was refused or failed; one `floodgate_sync_errors_total` series each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// 400: the body is not a valid batch.
    BadRequest,
    /// 401: no bearer token, while tokens are configured.
    Unauthorized,
    /// 403: a bearer token that is none of the configured ones.
    Forbidden,
    /// 404: no such path.
    NotFound,
    /// 405: the path exists, the method does not.
    MethodNotAllowed,
    /// 413: the body is larger than `--max-body-bytes`.
    PayloadTooLarge,
    /// 415: the content type is not JSON.
    UnsupportedMediaType,
    /// 503: Redis did not answer within `--redis-timeout`.
    StoreTimeout,
    /// 503: Redis answered with an error, or could not be reached.
    StoreError,
}

impl ErrorKind {
    const ALL: [ErrorKind; 9] = [
        ErrorKind::BadRequest,
        ErrorKind::Unauthorized,
        ErrorKind::Forbidden,
        ErrorKind::NotFound,
        ErrorKind::MethodNotAllowed,
        ErrorKind::PayloadTooLarge,
        ErrorKind::UnsupportedMediaType,
        ErrorKind::StoreTimeout,
        ErrorKind::StoreError,
    ];

    /// The HTTP status this kind answers with.
    pub fn status(self) -> u16 {
        match self {
            ErrorKind::BadRequest => 400,
            ErrorKind::Unauthorized => 401,
            ErrorKind::Forbidden => 403,
            ErrorKind::NotFound => 404,
            ErrorKind::MethodNotAllowed => 405,
            ErrorKind::PayloadTooLarge => 413,
            ErrorKind::UnsupportedMediaType => 415,
            ErrorKind::StoreTimeout | ErrorKind::StoreError => 503,
        }
    }

    /// The `kind` label.
    pub fn label(self) -> &'static str {
        match self {
            ErrorKind::BadRequest => "bad_request",
            ErrorKind::Unauthorized => "unauthorized",
            ErrorKind::Forbidden => "forbidden",
            ErrorKind::NotFound => "not_found",
            ErrorKind::MethodNotAllowed => "method_not_allowed",
            ErrorKind::PayloadTooLarge => "payload_too_large",
            ErrorKind::UnsupportedMediaType => "unsupported_media_type",
            ErrorKind::StoreTimeout => "store_timeout",
            ErrorKind::StoreError => "store_error",
        }
    }

    fn slot(self) -> usize {
        match self {
            ErrorKind::BadRequest => 0,
            ErrorKind::NotFound => 1,
            ErrorKind::MethodNotAllowed => 2,
            ErrorKind::PayloadTooLarge => 3,
            ErrorKind::UnsupportedMediaType => 4,
            ErrorKind::StoreTimeout => 5,
            ErrorKind::StoreError => 6,
            ErrorKind::Unauthorized => 7,
            ErrorKind::Forbidden => 8,
        }
    }
}

/// Upper bounds of the `/v1/sync` latency histogram, in seconds.
const LATENCY_BOUNDS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

/// Every metric of the service.
#[derive(Debug, Default)]
pub struct Metrics {
    batches_received: AtomicU64,
    counters_received: AtomicU64,
    batches_applied: AtomicU64,
    batches_deduplicated: AtomicU64,
    parts_applied: AtomicU64,
    parts_deduplicated: AtomicU64,
    redis_round_trips: AtomicU64,
    batch_calls: AtomicU64,
    leases_received: AtomicU64,
    lease_units_granted: AtomicU64,
    lease_units_reclaimed: AtomicU64,
    proxies: AtomicU64,
    errors: [AtomicU64; 9],
    sync_latency: Histogram,
    lease_latency: Histogram,
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

/// A latency histogram over [`LATENCY_BOUNDS`].
#[derive(Debug, Default)]
struct Histogram {
    buckets: [AtomicU64; 12],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    fn record(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        for (bound, bucket) in LATENCY_BOUNDS.iter().zip(&self.buckets) {
            if seconds <= *bound {
                add(bucket, 1);
            }
        }
        add(&self.count, 1);
        add(
            &self.sum_us,
            u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX),
        );
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        for (bound, bucket) in LATENCY_BOUNDS.iter().zip(&self.buckets) {
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {}", get(bucket));
        }
        let count = get(&self.count);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum_us = get(&self.sum_us);
        let _ = writeln!(
            out,
            "{name}_sum {}.{:06}",
            sum_us.checked_div(1_000_000).unwrap_or(0),
            sum_us.checked_rem(1_000_000).unwrap_or(0)
        );
        let _ = writeln!(out, "{name}_count {count}");
    }
}

impl Metrics {
    /// A valid batch of `counters` entries arrived.
    pub fn batch_received(&self, counters: usize) {
        add(&self.batches_received, 1);
        add(
            &self.counters_received,
            u64::try_from(counters).unwrap_or(u64::MAX),
        );
    }

    /// A batch was answered: `applied` shard parts were applied now, `deduplicated` were already.
    pub fn batch_done(&self, applied: usize, deduplicated: usize) {
        if applied > 0 {
            add(&self.batches_applied, 1);
        }
        if deduplicated > 0 {
            add(&self.batches_deduplicated, 1);
        }
        add(
            &self.parts_applied,
            u64::try_from(applied).unwrap_or(u64::MAX),
        );
        add(
            &self.parts_deduplicated,
            u64::try_from(deduplicated).unwrap_or(u64::MAX),
        );
    }

    /// The fleet size a sync answer gave (the distinct proxies of the last seconds).
    pub fn set_proxies(&self, proxies: u64) {
        self.proxies.store(proxies, Ordering::Relaxed);
    }

    /// One script call applied the shard parts of one or more batches (merged: `store`).
    pub fn batch_call(&self) {
        add(&self.batch_calls, 1);
    }

    /// One command was sent to Redis (and its answer awaited).
    pub fn redis_round_trip(&self) {
        add(&self.redis_round_trips, 1);
    }

    /// A request was refused or failed.
    pub fn error(&self, kind: ErrorKind) {
        if let Some(counter) = self.errors.get(kind.slot()) {
            add(counter, 1);
        }
    }

    /// A `/v1/sync` request took `elapsed`, whatever its outcome.
    pub fn sync_latency(&self, elapsed: Duration) {
        self.sync_latency.record(elapsed);
    }

    /// A `/v1/lease` request took `elapsed`, whatever its outcome.
    pub fn lease_latency(&self, elapsed: Duration) {
        self.lease_latency.record(elapsed);
    }

    /// A valid lease request of `entries` keys was answered, granting `units` in all and
    /// taking back `reclaimed` units of stopped holders.
    pub fn leases_granted(&self, entries: usize, units: u64, reclaimed: u64) {
        add(
            &self.leases_received,
            u64::try_from(entries).unwrap_or(u64::MAX),
        );
        add(&self.lease_units_granted, units);
        add(&self.lease_units_reclaimed, reclaimed);
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        let mut out = String::with_capacity(4096);
        let mut counter = |name: &str, help: &str, value: u64| {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} counter");
            let _ = writeln!(out, "{name} {value}");
        };
        counter(
            "floodgate_sync_batches_received_total",
            "Valid batches received on /v1/sync.",
            get(&self.batches_received),
        );
        counter(
            "floodgate_sync_counters_received_total",
            "Counter entries in the valid batches received.",
            get(&self.counters_received),
        );
        counter(
            "floodgate_sync_batches_applied_total",
            "Batches answered 200 of which at least one shard part was applied by that request.",
            get(&self.batches_applied),
        );
        counter(
            "floodgate_sync_batches_deduplicated_total",
            "Batches answered 200 of which at least one shard part had been applied before (a retry, or an older seq): only read.",
            get(&self.batches_deduplicated),
        );
        counter(
            "floodgate_sync_leases_received_total",
            "Key entries in the valid lease requests answered 200 (POST /v1/lease).",
            get(&self.leases_received),
        );
        counter(
            "floodgate_sync_lease_units_granted_total",
            "Units of quota granted by POST /v1/lease.",
            get(&self.lease_units_granted),
        );
        counter(
            "floodgate_sync_lease_units_reclaimed_total",
            "Units held by stopped holders (a proxy that died) taken back once their bucket's grace passed.",
            get(&self.lease_units_reclaimed),
        );
        counter(
            "floodgate_sync_batch_calls_total",
            "Script calls that applied batches' shard parts: each took every part waiting for its shard (floodgate_sync_shard_parts_total over this: the parts merged per call).",
            get(&self.batch_calls),
        );
        counter(
            "floodgate_sync_redis_round_trips_total",
            "Commands sent to Redis (EVALSHA, EVAL after NOSCRIPT, each with its WAIT in one round trip under --replica-acks, PING of /readyz, the fleet size's pipeline).",
            get(&self.redis_round_trips),
        );
        let _ = writeln!(
            out,
            "# HELP floodgate_sync_proxies Distinct proxies that sent a batch in the last 3 seconds, as the last sync answer gave it."
        );
        let _ = writeln!(out, "# TYPE floodgate_sync_proxies gauge");
        let _ = writeln!(out, "floodgate_sync_proxies {}", get(&self.proxies));
        let _ = writeln!(
            out,
            "# HELP floodgate_sync_shard_parts_total Shard parts of batches answered 200, by whether this request applied them."
        );
        let _ = writeln!(out, "# TYPE floodgate_sync_shard_parts_total counter");
        let _ = writeln!(
            out,
            "floodgate_sync_shard_parts_total{{result=\"applied\"}} {}",
            get(&self.parts_applied)
        );
        let _ = writeln!(
            out,
            "floodgate_sync_shard_parts_total{{result=\"deduplicated\"}} {}",
            get(&self.parts_deduplicated)
        );
        let _ = writeln!(
            out,
            "# HELP floodgate_sync_errors_total Requests refused or failed, by HTTP status and kind."
        );
        let _ = writeln!(out, "# TYPE floodgate_sync_errors_total counter");
        for kind in ErrorKind::ALL {
            let value = self.errors.get(kind.slot()).map(get).unwrap_or(0);
            let _ = writeln!(
                out,
                "floodgate_sync_errors_total{{status=\"{}\",kind=\"{}\"}} {value}",
                kind.status(),
                kind.label()
            );
        }
        self.sync_latency.render(
            &mut out,
            "floodgate_sync_request_duration_seconds",
            "Time to answer POST /v1/sync, from its headers to its answer, whatever the outcome.",
        );
        self.lease_latency.render(
            &mut out,
            "floodgate_sync_lease_duration_seconds",
            "Time to answer POST /v1/lease, from its headers to its answer, whatever the outcome.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]

    use super::*;

    #[test]
    fn renders_counters_errors_and_a_cumulative_histogram() {
        let metrics = Metrics::default();
        metrics.batch_received(3);
        metrics.batch_done(2, 1);
        metrics.redis_round_trip();
        metrics.error(ErrorKind::PayloadTooLarge);
        metrics.error(ErrorKind::Forbidden);
        metrics.sync_latency(Duration::from_micros(700));
        metrics.sync_latency(Duration::from_secs(3));
        let text = metrics.render();
        for line in [
            "floodgate_sync_batches_received_total 1",
            "floodgate_sync_counters_received_total 3",
            "floodgate_sync_batches_applied_total 1",
            "floodgate_sync_batches_deduplicated_total 1",
            "floodgate_sync_shard_parts_total{result=\"applied\"} 2",
            "floodgate_sync_shard_parts_total{result=\"deduplicated\"} 1",
            "floodgate_sync_redis_round_trips_total 1",
            "floodgate_sync_errors_total{status=\"413\",kind=\"payload_too_large\"} 1",
            "floodgate_sync_errors_total{status=\"503\",kind=\"store_timeout\"} 0",
            "floodgate_sync_errors_total{status=\"401\",kind=\"unauthorized\"} 0",
            "floodgate_sync_errors_total{status=\"403\",kind=\"forbidden\"} 1",
            "floodgate_sync_request_duration_seconds_bucket{le=\"0.0005\"} 0",
            "floodgate_sync_request_duration_seconds_bucket{le=\"0.001\"} 1",
            "floodgate_sync_request_duration_seconds_bucket{le=\"2.5\"} 1",
            "floodgate_sync_request_duration_seconds_bucket{le=\"+Inf\"} 2",
            "floodgate_sync_request_duration_seconds_sum 3.000700",
            "floodgate_sync_request_duration_seconds_count 2",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
    }
}
