//! What the filter answers: its refusals (the `429` of a rate limit, the `503`s of shedding,
//! of the per-key cap and of cluster selection), the IETF `RateLimit` fields, and the health
//! and liveness answers.
//!
//! - `retry-after` (RFC 9110 §10.2.3): whole seconds, at least 1, rounded up from the exact
//!   earliest admission, so a request at `now + retry-after` is admitted and one a second
//!   earlier is not.
//! - `ratelimit-policy` / `ratelimit` (draft-ietf-httpapi-ratelimit-headers, structured fields):
//!   `"name";q=<limit>;w=<window seconds>` and `"name";r=<remaining>;t=<seconds>`. A token
//!   bucket says `q=<burst>;w=<seconds an empty bucket takes to fill>` (rounded up: a client
//!   that spends `q` per `w` is never refused), `r` the units that would go at once, `t` the
//!   seconds until the bucket is full again (docs/configuration.md, *Token bucket*).
//! - Body: RFC 9457 problem details with the `quota-exceeded` problem type of the IANA HTTP
//!   problem types registry, `violated-policies`, and the figures of each refusing rule.
//! - Every refusal (a `429`, a `503`) is written by one builder, `ProblemDetails`: whatever
//!   refuses, the body has `type`, `title`, `status`, `detail` and `retry_after`, the headers
//!   start with `content-type` and `retry-after`, and the gRPC form's words ([`Refusal`]) carry
//!   the body's `detail` and wait.
//!
//! Rationale: docs/design.md, section "Replies".

pub mod api;
pub mod grpc;

#[cfg(test)]
mod bytes;

use crate::config::RefusalFormat;
use crate::ratelimit::{Cause, Limiter, RuleTable, Standing, Verdict, Violation};
use crate::shedding::per_key::{CapRefusal, PerKeyCap};
use crate::selection::{Confinement, Exhausted, Selector};
use crate::shedding::lag::{LagMonitor, LagShed};
use crate::shedding::flows::Share;
use crate::shedding::{Classes, Shed, Shedder};
use crate::primitives::time::UnixMillis;
use crate::watchdog::{Liveness, Problem, Watchdog};
use serde_json::json;
use std::borrow::Cow;
use std::num::NonZeroU32;

/// Problem type of a shed request.
pub const TEMPORARY_REDUCED_CAPACITY: &str =
    "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity";

/// Problem type of a rate-limited request.
pub const QUOTA_EXCEEDED: &str = "https://iana.org/assignments/http-problem-types#quota-exceeded";

/// A local reply: status, headers, body.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    /// HTTP status.
    pub status: u32,
    /// Response headers.
    pub headers: Vec<(&'static str, String)>,
    /// Response body.
    pub body: String,
    /// What it refuses and for how long, for the gRPC form of a refusal ([`crate::replies::grpc`]);
    /// `None` for an answer that refuses nothing (the health endpoint's).
    pub refusal: Option<Refusal>,
}

impl Reply {
    /// The reply as an HTTP response: a refusal with a `retry-after` also carries
    /// `retry-after-ms`, the exact wait in milliseconds (the body's `retry_after_ms` for a
    /// quota), which the LLM APIs' SDKs read before `retry-after`.
    pub fn with_exact_wait(mut self) -> Reply {
        if let Some(refusal) = &self.refusal {
            if self.headers.iter().any(|(name, _)| *name == "retry-after") {
                self.headers.push(("retry-after-ms", refusal.retry_after_ms.to_string()));
            }
        }
        self
    }
}

/// What a refusal says, in the words a gRPC status carries: which kind, one line, and the wait.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// Which feature refused.
    pub kind: RefusalKind,
    /// The problem document's `detail`: one line naming the quota or the limit, and the wait.
    pub detail: String,
    /// The wait before the same request could be admitted, in milliseconds: exact for a quota,
    /// the configured `retry_after` (in whole seconds, as `retry-after`) otherwise.
    pub retry_after_ms: u64,
}

/// Which feature refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RefusalKind {
    /// A rate limit (`429`).
    RateLimited,
    /// Load shedding (`503`).
    Shed,
    /// Cluster selection found no cluster with room (`503`).
    NoCapacity,
}

/// A refusal as an RFC 9457 problem document: the one place that writes a refusal's status,
/// headers and body. Its body always has `type`, `title`, `status`, `detail` and `retry_after`
/// (the `retry-after` seconds), and the members a refusal adds; its headers are `content-type`,
/// `retry-after` and those a refusal adds, in that order; its [`Refusal`] (the gRPC form's words)
/// has the same `detail` and the wait. serde_json writes the members sorted by name.
#[derive(Clone, Debug)]
struct ProblemDetails {
    status: u32,
    kind: RefusalKind,
    problem_type: &'static str,
    title: &'static str,
    detail: String,
    retry_after_secs: u64,
    retry_after_ms: u64,
    members: serde_json::Map<String, serde_json::Value>,
    headers: Vec<(&'static str, String)>,
}

impl ProblemDetails {
    /// A `429` of a rate limit (`quota-exceeded`).
    fn too_many_requests(detail: String, retry_after_secs: u64) -> ProblemDetails {
        ProblemDetails::new(429, RefusalKind::RateLimited, QUOTA_EXCEEDED, "Too Many Requests", detail, retry_after_secs)
    }

    /// A `503` (`temporary-reduced-capacity`) of `kind`.
    fn unavailable(kind: RefusalKind, detail: String, retry_after_secs: u64) -> ProblemDetails {
        ProblemDetails::new(503, kind, TEMPORARY_REDUCED_CAPACITY, "Service Unavailable", detail, retry_after_secs)
    }

    /// A refusal with `status`, the problem `type` and `title`, and the wait of `retry-after`.
    fn new(status: u32, kind: RefusalKind, problem_type: &'static str, title: &'static str, detail: String, retry_after_secs: u64) -> ProblemDetails {
        ProblemDetails {
            status,
            kind,
            problem_type,
            title,
            detail,
            retry_after_secs,
            retry_after_ms: retry_after_secs.saturating_mul(1000),
            members: serde_json::Map::new(),
            headers: Vec::new(),
        }
    }

    /// The exact wait, in milliseconds: the refusal's, and the body's `retry_after_ms` (without
    /// it, the refusal's wait is the whole `retry_after` seconds, and the body has none).
    fn exact_wait(mut self, retry_after_ms: u64) -> ProblemDetails {
        self.retry_after_ms = retry_after_ms;
        self.member("retry_after_ms", retry_after_ms)
    }

    /// A member of the body beside the standard ones.
    fn member(mut self, name: &str, value: impl Into<serde_json::Value>) -> ProblemDetails {
        self.members.insert(name.into(), value.into());
        self
    }

    /// A header after `content-type` and `retry-after`.
    fn header(mut self, name: &'static str, value: String) -> ProblemDetails {
        self.headers.push((name, value));
        self
    }

    /// The reply: the problem document (`application/problem+json`).
    fn reply(mut self) -> Reply {
        let standard = [
            ("type", json!(self.problem_type)),
            ("title", json!(self.title)),
            ("status", json!(self.status)),
            ("detail", json!(self.detail)),
            ("retry_after", json!(self.retry_after_secs)),
        ];
        for (name, value) in standard {
            self.members.insert(name.into(), value);
        }
        let body = serde_json::Value::Object(std::mem::take(&mut self.members)).to_string();
        self.reply_as("application/problem+json", body)
    }

    /// The reply with another body of `content_type` (the same headers and refusal).
    fn reply_as(self, content_type: &'static str, body: String) -> Reply {
        let mut headers = vec![("content-type", content_type.to_owned()), ("retry-after", self.retry_after_secs.to_string())];
        headers.extend(self.headers);
        Reply {
            status: self.status,
            headers,
            body,
            refusal: Some(Refusal { kind: self.kind, detail: self.detail, retry_after_ms: self.retry_after_ms }),
        }
    }
}

/// The `ratelimit-policy` value of one rule for a key of limit `limit` (in the rule's units).
pub fn policy_field(table: &RuleTable, limit: NonZeroU32) -> String {
    if let Some(bucket) = table.bucket_of(limit) {
        return format!("\"{}\";q={};w={}", table.name, bucket.burst(), bucket.tolerance_us().div_ceil(1_000_000).max(1));
    }
    format!("\"{}\";q={limit};w={}", table.name, table.window.length_ms().div_ceil(1000))
}

/// The `ratelimit-policy` and `ratelimit` field values for one rule and a key of limit `limit`.
pub fn ratelimit_fields(table: &RuleTable, limit: NonZeroU32, remaining: u64, reset_secs: u64) -> (String, String) {
    (policy_field(table, limit), format!("\"{}\";r={remaining};t={reset_secs}", table.name))
}

/// For an admitted request: the fields of the rule with the least remaining quota.
pub fn admitted_fields(limiter: &Limiter, standings: &[Standing]) -> Option<(String, String)> {
    let fields = AdmittedFields::new(limiter);
    let tightest = fields.tightest(standings)?;
    Some((fields.policy(&tightest)?.into_owned(), tightest.ratelimit))
}

/// The `RateLimit` fields of admitted responses, prepared once per configuration: each rule's
/// `ratelimit-policy` value (it never changes) and the start of its `ratelimit` value, so a
/// request only writes two integers (the same text as [`ratelimit_fields`], without `format!`).
#[derive(Clone, Debug)]
pub struct AdmittedFields {
    /// Per rule, in configuration order: (`ratelimit-policy` value, `ratelimit` up to `r=`).
    rules: Vec<(String, String)>,
    /// Per rule: its limit and window (for a key whose limit is another: a tier, an override).
    tables: Vec<RuleTable>,
    /// Per rule: it is in shadow, and shows nothing to clients (empty: none is).
    shadow: Vec<bool>,
}

/// The fields of an admitted request's tightest rule.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tightest {
    /// Index of the rule.
    pub rule: usize,
    /// The key's limit.
    pub limit: NonZeroU32,
    /// The `ratelimit` value.
    pub ratelimit: String,
}

impl AdmittedFields {
    /// The fields of every rule of `limiter`.
    pub fn new(limiter: &Limiter) -> AdmittedFields {
        let rules = limiter
            .tables()
            .iter()
            .map(|table| (policy_field(table, table.limit), format!("\"{}\";r=", table.name)))
            .collect();
        AdmittedFields { rules, tables: limiter.tables().to_vec(), shadow: Vec::new() }
    }

    /// The same, rule `rule` left out where `shadow(rule)` (a rule in shadow contributes no
    /// field to a response).
    #[must_use]
    pub fn in_shadow(mut self, shadow: impl Fn(usize) -> bool) -> AdmittedFields {
        self.shadow = (0..self.rules.len()).map(shadow).collect();
        if !self.shadow.contains(&true) {
            self.shadow.clear();
        }
        self
    }

    /// The `ratelimit-policy` value of `tightest`'s rule: prepared once, unless the key's limit is
    /// not the rule's (a tier, an override).
    pub fn policy(&self, tightest: &Tightest) -> Option<Cow<'_, str>> {
        let table = self.tables.get(tightest.rule)?;
        if tightest.limit == table.limit {
            self.rules.get(tightest.rule).map(|(policy, _)| Cow::Borrowed(policy.as_str()))
        } else {
            Some(Cow::Owned(policy_field(table, tightest.limit)))
        }
    }

    /// For an admitted request: the rule with the least remaining quota (the first of equals)
    /// and its `ratelimit` value; rules in shadow left out (`None`: every rule that admitted it
    /// is).
    pub fn tightest(&self, standings: &[Standing]) -> Option<Tightest> {
        let shown = |s: &&Standing| !self.shadow.get(s.rule).copied().unwrap_or(false);
        let tightest = standings.iter().filter(shown).min_by_key(|s| s.remaining)?;
        let (_, prefix) = self.rules.get(tightest.rule)?;
        // Two integers of at most 20 digits and ";t=".
        let mut ratelimit = String::with_capacity(prefix.len().saturating_add(43));
        ratelimit.push_str(prefix);
        push_decimal(&mut ratelimit, tightest.remaining);
        ratelimit.push_str(";t=");
        push_decimal(&mut ratelimit, tightest.reset_ms.div_ceil(1000));
        Some(Tightest { rule: tightest.rule, limit: tightest.limit, ratelimit })
    }
}

/// Appends `value` in decimal.
fn push_decimal(out: &mut String, value: u64) {
    let mut digits = [b'0'; 20]; // u64::MAX has 20 digits
    let mut rest = value;
    let mut start = digits.len();
    for (at, digit) in digits.iter_mut().enumerate().rev() {
        *digit = b'0' | u8::try_from(rest % 10).unwrap_or(0);
        rest /= 10;
        start = at;
        if rest == 0 {
            break;
        }
    }
    for digit in digits.get(start..).unwrap_or_default() {
        out.push(char::from(*digit));
    }
}

/// Milliseconds until `retry_at` and the `retry-after` seconds for it (at least 1). A rule that
/// can never admit (cost above its limit) says one window.
fn retry_after(retry_at: Option<UnixMillis>, now: UnixMillis, fallback_ms: u64) -> (u64, u64) {
    let ms = retry_at.map_or(fallback_ms, |at| at.saturating_since(now));
    (ms, ms.div_ceil(1000).max(1))
}

/// The `429` for a rejected verdict (`None` for an admitted one).
pub fn rate_limited(limiter: &Limiter, verdict: &Verdict, now: UnixMillis) -> Option<Reply> {
    let Verdict::Refused { violations } = verdict else {
        return None;
    };
    let describe = |v: &Violation| -> Option<(&RuleTable, u64)> {
        let table = limiter.tables().get(v.standing.rule)?;
        let (ms, _) = retry_after(v.standing.retry_at, now, table.window.length_ms());
        Some((table, ms))
    };
    let binding = violations
        .iter()
        .filter_map(|v| describe(v).map(|d| (v, d)))
        .max_by_key(|(_, (_, ms))| *ms)?;
    let (violation, (table, _)) = binding;
    let (retry_after_ms, retry_after_secs) = retry_after(verdict.retry_at(), now, table.window.length_ms());
    let limit = violation.standing.limit;
    let (policy, ratelimit) = ratelimit_fields(table, limit, violation.standing.remaining, retry_after_secs);
    let estimate = round3(violation.standing.estimate);
    let bucket = table.bucket;
    let detail = match violation.cause {
        Cause::OverLimit if bucket.is_some() => format!(
            "quota \"{}\" of {limit} {} per {} (a bucket of {}) is exhausted (current level {estimate}); retry in {retry_after_secs} s",
            table.name,
            table.unit,
            window_text(table),
            bucket.map_or(0, |b| b.burst.get()),
        ),
        Cause::OverLimit => format!(
            "quota \"{}\" of {limit} {} per {} is exhausted (current estimate {estimate}); retry in {retry_after_secs} s",
            table.name,
            table.unit,
            window_text(table)
        ),
        Cause::Contention => format!(
            "quota \"{}\" could not be counted under contention; retry in {retry_after_secs} s",
            table.name
        ),
    };
    let quotas: Vec<_> = violations
        .iter()
        .filter_map(|v| {
            let (table, ms) = describe(v)?;
            Some(json!({
                "policy": table.name.as_str(),
                "limit": v.standing.limit.get(),
                "unit": table.unit,
                "window_ms": table.window.length_ms(),
                "estimate": round3(v.standing.estimate),
                "retry_after_ms": ms,
            }))
        })
        .collect();
    let names: Vec<&str> = violations
        .iter()
        .filter_map(|v| limiter.tables().get(v.standing.rule).map(|t| t.name.as_str()))
        .collect();
    let mut problem = ProblemDetails::too_many_requests(detail, retry_after_secs)
        .exact_wait(retry_after_ms)
        .member("violated-policies", names)
        .member("policy", table.name.as_str())
        .member("limit", limit.get())
        .member("unit", table.unit)
        .member("window", window_text(table))
        .member("window_ms", table.window.length_ms())
        .member("estimate", estimate)
        .member("quotas", quotas)
        .header("ratelimit-policy", policy)
        .header("ratelimit", ratelimit);
    if let Some(bucket) = bucket {
        problem = problem.member("algorithm", "token_bucket").member("burst", bucket.burst.get());
    }
    Some(match table.refusal_format {
        RefusalFormat::Problem => problem.reply(),
        format => {
            let facts = api::Facts {
                table,
                limit,
                remaining: violation.standing.remaining,
                estimate,
                retry_after_ms,
                retry_after_secs,
                contention: violation.cause == Cause::Contention,
            };
            problem.reply_as("application/json", api::body(format, &facts))
        }
    })
}

/// The `503` of a request of a leased rule that needed the store while it failed, under
/// `on_store_failure: refuse`.
pub fn quota_store_unavailable(limiter: &Limiter, rule: usize) -> Reply {
    const RETRY_AFTER_SECS: u64 = 1;
    let name = limiter.tables().get(rule).map_or("?", |t| t.name.as_str());
    let detail = format!(
        "quota \"{name}\" cannot be checked: its store does not answer (global.on_store_failure: refuse); retry in {RETRY_AFTER_SECS} s"
    );
    ProblemDetails::unavailable(RefusalKind::Shed, detail, RETRY_AFTER_SECS).member("policy", name).reply()
}

/// The `503` of a shed request.
pub fn shed(shedder: &Shedder, shed: &Shed) -> Reply {
    shed_reply(shedder, shed, None)
}

/// The `503` of a request that waited `waited_ms` for a slot (`load_shedding.queue`) and got
/// none: the shed reply, saying how long it waited.
pub fn shed_after_wait(shedder: &Shedder, shed: &Shed, waited_ms: u64) -> Reply {
    shed_reply(shedder, shed, Some(waited_ms))
}

/// The `503` of a request shed because its flow held the most of its class (the class's queue
/// was full, or its wait in a standing queue ended; `waited_ms` when it waited): the shed reply,
/// with the flow's share of the class.
pub fn shed_by_flow(shedder: &Shedder, shed: &Shed, share: &Share, waited_ms: Option<u64>) -> Reply {
    let class = shedder.classes.get(shed.class);
    let class_name = class.map_or("", |c| c.name.as_str());
    let fair_share = share.fair_share_rounded();
    let mut detail = format!(
        "class \"{class_name}\" is full and this request's flow holds the most of it ({} in flight, {} waiting; a fair share is {fair_share} of its {} slots among {} flows); retry in {} s",
        share.held, share.waiting, share.slots, share.flows.max(1), shedder.retry_after_secs
    );
    if let Some(waited) = waited_ms {
        detail = format!("waited {waited} ms for a slot; {detail}");
    }
    let mut problem = ProblemDetails::unavailable(RefusalKind::Shed, detail, shedder.retry_after_secs)
        .member("in_flight", shed.in_flight)
        .member("max_active_requests", shedder.max_active_requests)
        .member("class", class_name)
        .member("flow_in_flight", share.held)
        .member("flow_waiting", share.waiting)
        .member("flows", share.flows.max(1))
        .member("fair_share", fair_share);
    if let Some(waited) = waited_ms {
        problem = problem.member("waited_ms", waited);
    }
    problem.reply()
}

fn shed_reply(shedder: &Shedder, shed: &Shed, waited_ms: Option<u64>) -> Reply {
    let class = shedder.classes.get(shed.class);
    let class_name = class.map_or("", |c| c.name.as_str());
    let threshold = class.map_or(0, |c| c.threshold);
    let detail = if shed.contention {
        format!("the in-flight count could not be updated under contention; retry in {} s", shedder.retry_after_secs)
    } else {
        format!(
            "{} requests in flight; class \"{class_name}\" is shed from {threshold} (limit {}); retry in {} s",
            shed.in_flight, shedder.max_active_requests, shedder.retry_after_secs
        )
    };
    let detail = match waited_ms {
        Some(waited) => format!("waited {waited} ms for a slot; {detail}"),
        None => detail,
    };
    let mut problem = ProblemDetails::unavailable(RefusalKind::Shed, detail, shedder.retry_after_secs)
        .member("in_flight", shed.in_flight)
        .member("max_active_requests", shedder.max_active_requests)
        .member("class", class_name)
        .member("class_threshold", threshold);
    if let Some(waited) = waited_ms {
        problem = problem.member("waited_ms", waited);
    }
    problem.reply()
}

/// The `503` when cluster selection found no cluster with room under its concurrency limit.
pub fn no_capacity(selector: &Selector, exhausted: &Exhausted) -> Reply {
    no_capacity_within(selector, exhausted, None)
}

/// The `503` when no cluster the request may use had room: all of them, or, for a request
/// confined to a partition ([`crate::shedding::per_key`]), the partition's clusters (it lists them).
pub fn no_capacity_within(selector: &Selector, exhausted: &Exhausted, confinement: Option<&Confinement>) -> Reply {
    let listed: Vec<usize> = match confinement {
        Some(c) if c.spill_below.is_none() => c.members.clone(),
        _ => (0..selector.clusters.len()).collect(),
    };
    let clusters: Vec<serde_json::Value> = listed
        .iter()
        .filter_map(|index| {
            let cluster = selector.clusters.get(*index)?;
            Some(match exhausted.clusters.get(*index).copied().flatten() {
                Some((in_flight, limit)) => json!({"name": cluster.name.as_str(), "in_flight": in_flight, "limit": limit}),
                None => json!({"name": cluster.name.as_str(), "in_flight": null, "limit": null}),
            })
        })
        .collect();
    let which = match confinement {
        Some(c) if c.spill_below.is_none() => {
            let names: Vec<&str> =
                c.members.iter().filter_map(|i| selector.clusters.get(*i)).map(|c| c.name.as_str()).collect();
            format!("cluster of this request's partition ({})", names.join(", "))
        }
        _ => "upstream cluster".to_owned(),
    };
    let detail = if exhausted.contention {
        format!(
            "no {which} had room, or its permit count could not be updated under contention; retry in {} s",
            selector.retry_after_secs
        )
    } else {
        format!("every {which} is at its concurrency limit; retry in {} s", selector.retry_after_secs)
    };
    let mut problem = ProblemDetails::unavailable(RefusalKind::NoCapacity, detail, selector.retry_after_secs).member("clusters", clusters);
    if let Some(c) = confinement {
        let names: Vec<&str> = c.members.iter().filter_map(|i| selector.clusters.get(*i)).map(|c| c.name.as_str()).collect();
        problem = problem.member("partition", names);
    }
    problem.reply()
}

/// The `503` of a request over its key's in-flight cap (`load_shedding.per_key`), or whose key
/// could not be counted.
pub fn per_key_capped(cap: &PerKeyCap, refusal: &CapRefusal, retry_after_secs: u64) -> Reply {
    let key: Vec<String> = cap.key.iter().map(ToString::to_string).collect();
    let key = key.join(", ");
    let (detail, in_flight) = match refusal {
        CapRefusal::Full { in_flight } => (
            format!(
                "this client (per_key [{key}]) has {in_flight} requests in flight, its cap (load_shedding.per_key.max_active_requests {}); retry in {retry_after_secs} s",
                cap.max_active_requests
            ),
            Some(*in_flight),
        ),
        CapRefusal::Untracked => (
            format!(
                "this client's requests in flight (per_key [{key}]) cannot be counted: too many keys in flight at once for load_shedding.per_key.capacity, or contention; retry in {retry_after_secs} s"
            ),
            None,
        ),
    };
    ProblemDetails::unavailable(RefusalKind::Shed, detail, retry_after_secs)
        .member("cap", "load_shedding.per_key")
        .member("key", key)
        .member("in_flight", in_flight)
        .member("max_active_requests", cap.max_active_requests)
        .reply()
}

/// Whether a request method is one the health endpoint answers: `GET` and `HEAD` (exactly, as
/// HTTP methods are case-sensitive). Any other method on the health path is an ordinary request.
pub fn is_health_method(method: &[u8]) -> bool {
    method == b"GET" || method == b"HEAD"
}

/// The proxy's own load, as one worker sees it: what the health endpoint reports.
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalLoad<'a> {
    /// The in-flight shedder and the proxy-wide in-flight count (with `max_active_requests`).
    pub in_flight: Option<(&'a Shedder, u32)>,
    /// The requests waiting in the queue, proxy-wide (with `load_shedding.queue`).
    pub queued: Option<u32>,
    /// This worker's loop lag (with `max_loop_lag`).
    pub lag: Option<LagStatus>,
}

/// A worker's loop lag, for the health endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LagStatus {
    /// The lag the worker's loop has had at least over its recent probes, in milliseconds.
    pub lag_ms: u64,
    /// `max_loop_lag`, in milliseconds.
    pub max_loop_lag_ms: u64,
    /// Whether the worker sheds the default class for lag now.
    pub sheds_default_class: bool,
    /// Whether it sheds any class for lag now.
    pub shedding: bool,
}

/// One upstream cluster, as the health endpoint's dependency view shows it.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterHealth {
    /// The cluster's name.
    pub name: String,
    /// Its success rate, in [0, 1].
    pub success_rate: f64,
    /// Its concurrency limit.
    pub limit: u32,
    /// Permits held on it, proxy-wide.
    pub in_flight: u32,
}

/// The dependency view of the health endpoint (`health.dependencies`).
#[derive(Clone, Debug, PartialEq)]
pub struct DependencyView {
    /// Whether failing dependencies turn the answer red.
    pub fail: bool,
    /// The success rate below which a cluster counts as failing.
    pub min_success_rate: f64,
    /// The clusters (those whose record could be read).
    pub clusters: Vec<ClusterHealth>,
}

/// The health endpoint's answer: `200` when the proxy takes default-class work, `503` when it
/// would shed it (its in-flight count at the default class's threshold, or this worker's loop
/// lagging past the default class's share of `max_loop_lag`), and, only with
/// `dependencies: "fail"`, `503` while every cluster fails.
pub fn health(load: &LocalLoad<'_>, dependencies: Option<&DependencyView>) -> Reply {
    let mut body = serde_json::Map::new();
    let mut overloaded = false;
    if let Some((shedder, in_flight)) = load.in_flight {
        overloaded |= shedder.overloaded(in_flight);
        let threshold = shedder.classes.get(shedder.default_class).map_or(0, |c| c.threshold);
        body.insert("in_flight".into(), json!(in_flight));
        body.insert("max_active_requests".into(), json!(shedder.max_active_requests));
        body.insert("default_class_threshold".into(), json!(threshold));
    }
    if let Some(queued) = load.queued {
        body.insert("queued".into(), json!(queued));
    }
    if let Some(lag) = load.lag {
        overloaded |= lag.sheds_default_class;
        body.insert("loop_lag_ms".into(), json!(lag.lag_ms));
        body.insert("max_loop_lag_ms".into(), json!(lag.max_loop_lag_ms));
    }
    if load.in_flight.is_some() || load.lag.is_some() {
        let shedding = overloaded || load.lag.is_some_and(|l| l.shedding);
        body.insert("shedding".into(), json!(shedding));
    }
    let mut failing = false;
    if let Some(view) = dependencies {
        let clusters: Vec<serde_json::Value> = view
            .clusters
            .iter()
            .map(|c| {
                json!({"name": c.name, "success_rate": (c.success_rate * 1e4).round() / 1e4, "limit": c.limit, "in_flight": c.in_flight})
            })
            .collect();
        let all_failing = !view.clusters.is_empty() && view.clusters.iter().all(|c| c.success_rate < view.min_success_rate);
        failing = view.fail && all_failing;
        body.insert("clusters".into(), json!(clusters));
        body.insert("dependencies".into(), json!(if all_failing { "failing" } else { "ok" }));
    }
    let status = if overloaded {
        "overloaded"
    } else if failing {
        "dependencies_failing"
    } else {
        "ok"
    };
    body.insert("status".into(), json!(status));
    Reply {
        status: if overloaded || failing { 503 } else { 200 },
        headers: vec![
            ("content-type", "application/json".into()),
            ("cache-control", "no-store".into()),
        ],
        body: serde_json::Value::Object(body).to_string(),
        refusal: None,
    }
}

/// The watchdog's liveness answer: `200` while no worker fails ([`crate::watchdog`]), `503`
/// while one does; the same JSON either way: `status` (`alive` or `failing`), the reasons
/// (one line per failing worker), the thresholds, and each worker that counts.
pub fn liveness(watchdog: &Watchdog, verdict: &Liveness) -> Reply {
    let alive = verdict.alive();
    let worker_id = |vm: u64| format!("{vm:016x}");
    let reasons: Vec<String> = verdict
        .workers
        .iter()
        .filter_map(|w| {
            let id = worker_id(w.vm);
            Some(match w.problem? {
                Problem::Silent { for_ms } => {
                    format!("worker {id} has not beaten for {for_ms} ms (worker_silence {} ms) while another worker runs", watchdog.silence_ms)
                }
                Problem::Recovering { heartbeats_left } => {
                    format!("worker {id} is back from a silence and needs {heartbeats_left} more heartbeats on time")
                }
                Problem::Lagging { for_ms } => format!(
                    "worker {id}'s event loop has lagged past {} ms for {for_ms} ms (lag_for {} ms)",
                    watchdog.max_lag_ms, watchdog.lag_for_ms
                ),
                Problem::Memory { bytes } => format!(
                    "worker {id}'s linear memory is {bytes} bytes, past {} bytes",
                    watchdog.max_memory_bytes.unwrap_or(0)
                ),
            })
        })
        .collect();
    let workers: Vec<serde_json::Value> = verdict
        .workers
        .iter()
        .map(|w| {
            let state = match w.problem {
                None => "ok",
                Some(Problem::Silent { .. }) => "silent",
                Some(Problem::Recovering { .. }) => "recovering",
                Some(Problem::Lagging { .. }) => "lagging",
                Some(Problem::Memory { .. }) => "memory",
            };
            json!({
                "worker": worker_id(w.vm),
                "state": state,
                "heartbeat_age_ms": w.heartbeat_age_ms,
                "loop_lag_ms": w.lag_ms,
                "memory_bytes": w.memory_bytes,
            })
        })
        .collect();
    let body = json!({
        "status": if alive { "alive" } else { "failing" },
        "reasons": reasons,
        "workers": workers,
        "worker_silence_ms": watchdog.silence_ms,
        "max_loop_lag_ms": watchdog.max_lag_ms,
        "lag_for_ms": watchdog.lag_for_ms,
        "max_memory_bytes": watchdog.max_memory_bytes,
    });
    Reply {
        status: if alive { 200 } else { 503 },
        headers: vec![
            ("content-type", "application/json".into()),
            ("cache-control", "no-store".into()),
        ],
        body: body.to_string(),
        refusal: None,
    }
}

/// The `503` when a worker's event loop lags (see [`crate::shedding::lag`]).
pub fn shed_by_lag(classes: &Classes, monitor: &LagMonitor, shed: &LagShed, retry_after_secs: u64) -> Reply {
    let class_name = classes.name(shed.class);
    let detail = format!(
        "this proxy's event loop is {} ms late; class \"{class_name}\" is shed from {} ms (max_loop_lag {} ms); retry in {retry_after_secs} s",
        shed.lag_ms,
        shed.threshold_ms,
        monitor.max_loop_lag_ms()
    );
    ProblemDetails::unavailable(RefusalKind::Shed, detail, retry_after_secs)
        .member("loop_lag_ms", shed.lag_ms)
        .member("max_loop_lag_ms", monitor.max_loop_lag_ms())
        .member("class", class_name)
        .member("class_lag_threshold_ms", shed.threshold_ms)
        .reply()
}

/// The window's length as configured (`"1m"`).
pub fn window_text(table: &RuleTable) -> String {
    crate::config::DurationMs::from_ms(table.window.length_ms()).map_or_else(String::new, |d| d.to_string())
}

fn round3(value: f64) -> f64 {
    (value * 1000.0).round() / 1000.0
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use crate::config::Config;
    use crate::ratelimit::Probe;
    use crate::primitives::store::MemoryStore;

    fn limiter() -> Limiter {
        let config = Config::parse(
            br#"{"rate_limits":[
              {"name":"per-api-key","key":[{"header":"x-api-key"}],"limit":4,"window":"4s"},
              {"name":"per-ip","key":["source_ip"],"limit":100,"window":"1m"}]}"#,
        )
        .unwrap();
        Limiter::new(&config, "t")
    }

    #[test]
    fn the_health_endpoint_answers_get_and_head_only() {
        assert!(is_health_method(b"GET"));
        assert!(is_health_method(b"HEAD"));
        for other in [&b"POST"[..], b"PUT", b"DELETE", b"OPTIONS", b"get", b"", b"GET "] {
            assert!(!is_health_method(other), "{:?}", String::from_utf8_lossy(other));
        }
    }

    #[test]
    fn the_429_carries_every_field() {
        let limiter = limiter();
        let store = MemoryStore::new();
        let probes = [Probe::new(0, 1), Probe::new(1, 2)];
        // 300 ms into a 4 s bucket.
        let now = UnixMillis(1_700_000_000_000 + 300);
        for _ in 0..4 {
            assert!(matches!(limiter.check(&store, &mut crate::ratelimit::reserve::Reserves::disabled(), &probes, &[], now), Verdict::Admitted { .. }));
        }
        let verdict = limiter.check(&store, &mut crate::ratelimit::reserve::Reserves::disabled(), &probes, &[], now);
        let reply = rate_limited(&limiter, &verdict, now).unwrap();
        assert_eq!(reply.status, 429);
        let header = |name: &str| reply.headers.iter().find(|(n, _)| *n == name).unwrap().1.clone();
        assert_eq!(header("content-type"), "application/problem+json");
        // Earliest admission: 1 s into the next bucket, i.e. 4.7 s from now.
        assert_eq!(header("retry-after"), "5");
        assert_eq!(header("ratelimit-policy"), "\"per-api-key\";q=4;w=4");
        assert_eq!(header("ratelimit"), "\"per-api-key\";r=0;t=5");
        let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        assert_eq!(body["type"], QUOTA_EXCEEDED);
        assert_eq!(body["status"], 429);
        assert_eq!(body["violated-policies"], json!(["per-api-key"]));
        assert_eq!(body["limit"], 4);
        assert_eq!(body["window"], "4s");
        assert_eq!(body["estimate"], 4.0);
        assert_eq!(body["retry_after"], 5);
        assert_eq!(body["retry_after_ms"], 4700);
        assert_eq!(body["quotas"][0]["policy"], "per-api-key");
        assert!(body["detail"].as_str().unwrap().contains("4 requests per 4s"));
    }

    #[test]
    fn the_bulkhead_refusals_name_the_cap_and_the_partition() {
        let config = Config::parse(
            br#"{"load_shedding":{"per_key":{"key":[{"header":"x-client"}],"max_active_requests":5}},
                 "cluster_selection":{"clusters":["a","b","c","d"],"partition":{"key":[{"header":"x-client"}],"size":2}}}"#,
        )
        .unwrap();
        let cap = PerKeyCap::new(config.load_shedding.as_ref().unwrap().per_key.as_ref().unwrap(), "t");
        let reply = per_key_capped(&cap, &CapRefusal::Full { in_flight: 5 }, 1);
        assert_eq!(reply.status, 503);
        let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        assert_eq!(body["cap"], "load_shedding.per_key");
        assert_eq!(body["in_flight"], 5);
        assert_eq!(body["max_active_requests"], 5);
        assert_eq!(
            body["detail"],
            "this client (per_key [header:x-client]) has 5 requests in flight, its cap (load_shedding.per_key.max_active_requests 5); retry in 1 s"
        );
        assert_eq!(reply.refusal.unwrap().kind, RefusalKind::Shed);
        let untracked: serde_json::Value = serde_json::from_str(&per_key_capped(&cap, &CapRefusal::Untracked, 1).body).unwrap();
        assert!(untracked["detail"].as_str().unwrap().contains("load_shedding.per_key.capacity"));
        assert_eq!(untracked["in_flight"], serde_json::Value::Null);

        let selector = Selector::new(config.cluster_selection.as_ref().unwrap(), "t");
        let within = Confinement { members: vec![3, 1], others: vec![0, 2], spill_below: None };
        let exhausted = Exhausted { clusters: vec![None, Some((2, 2)), None, Some((4, 4))], contention: false };
        let body: serde_json::Value = serde_json::from_str(&no_capacity_within(&selector, &exhausted, Some(&within)).body).unwrap();
        assert_eq!(body["partition"], json!(["d", "b"]));
        assert_eq!(body["clusters"], json!([{"name": "d", "in_flight": 4, "limit": 4}, {"name": "b", "in_flight": 2, "limit": 2}]));
        assert_eq!(body["detail"], "every cluster of this request's partition (d, b) is at its concurrency limit; retry in 1 s");
        let all: serde_json::Value = serde_json::from_str(&no_capacity(&selector, &exhausted).body).unwrap();
        assert_eq!(all["clusters"].as_array().unwrap().len(), 4);
        assert!(all.get("partition").is_none());
    }

    #[test]
    fn the_503_and_the_health_answer() {
        let config = Config::parse(br#"{"load_shedding":{"max_active_requests":10,"retry_after":"2s"}}"#).unwrap();
        let shedder = Shedder::new(config.load_shedding.as_ref().unwrap(), "t").unwrap();
        let reply = shed(&shedder, &Shed { in_flight: 9, class: 1, contention: false });
        assert_eq!(reply.status, 503);
        assert!(reply.headers.contains(&("retry-after", "2".into())));
        assert!(reply.headers.contains(&("content-type", "application/problem+json".into())));
        let body: serde_json::Value = serde_json::from_str(&reply.body).unwrap();
        assert_eq!(body["type"], TEMPORARY_REDUCED_CAPACITY);
        assert_eq!(body["class"], "normal");
        assert_eq!(body["in_flight"], 9);
        assert_eq!(body["class_threshold"], 9);
        let with = |in_flight| LocalLoad { in_flight: Some((&shedder, in_flight)), queued: None, lag: None };
        assert_eq!(health(&with(8), None).status, 200);
        let busy = health(&with(9), None);
        assert_eq!(busy.status, 503);
        let body: serde_json::Value = serde_json::from_str(&busy.body).unwrap();
        assert_eq!(body, serde_json::json!({"status": "overloaded", "shedding": true, "in_flight": 9, "max_active_requests": 10, "default_class_threshold": 9}));
        assert_eq!(health(&LocalLoad::default(), None).body, r#"{"status":"ok"}"#);
        let queued = health(&LocalLoad { queued: Some(4), ..with(9) }, None);
        let body: serde_json::Value = serde_json::from_str(&queued.body).unwrap();
        assert_eq!((queued.status, &body["queued"], &body["in_flight"]), (503, &json!(4), &json!(9)));
    }

    #[test]
    fn the_liveness_answer_says_why_in_the_same_shape_alive_or_failing() {
        let config = crate::config::Config::parse(br#"{"watchdog":{"path":"/alive","max_memory_mb":1}}"#).unwrap();
        let dog = Watchdog::new(config.watchdog.as_ref().unwrap(), "t");
        let worker = |vm, problem| crate::watchdog::WorkerView { vm, heartbeat_age_ms: 300, lag_ms: 4, memory_bytes: Some(1 << 20), problem };
        let alive = liveness(&dog, &Liveness { workers: vec![worker(1, None), worker(2, None)] });
        assert_eq!(alive.status, 200);
        let body: serde_json::Value = serde_json::from_str(&alive.body).unwrap();
        assert_eq!((&body["status"], &body["reasons"]), (&json!("alive"), &json!([])));
        assert_eq!(body["workers"][1], json!({"worker": "0000000000000002", "state": "ok", "heartbeat_age_ms": 300, "loop_lag_ms": 4, "memory_bytes": 1048576}));
        let failing = liveness(&dog, &Liveness {
            workers: vec![
                worker(1, Some(Problem::Silent { for_ms: 6000 })),
                worker(2, Some(Problem::Lagging { for_ms: 31000 })),
                worker(3, Some(Problem::Recovering { heartbeats_left: 2 })),
                worker(4, Some(Problem::Memory { bytes: 2 << 20 })),
                worker(5, None),
            ],
        });
        assert_eq!(failing.status, 503);
        assert!(failing.refusal.is_none());
        let body: serde_json::Value = serde_json::from_str(&failing.body).unwrap();
        let keys = |v: &serde_json::Value| v.as_object().unwrap().keys().cloned().collect::<Vec<_>>();
        let alive_body: serde_json::Value = serde_json::from_str(&alive.body).unwrap();
        assert_eq!(keys(&body), keys(&alive_body), "one shape");
        assert_eq!(body["status"], "failing");
        let reasons: Vec<&str> = body["reasons"].as_array().unwrap().iter().filter_map(|r| r.as_str()).collect();
        assert_eq!(reasons.len(), 4, "{reasons:?}");
        assert!(reasons[0].contains("0000000000000001 has not beaten for 6000 ms (worker_silence 5000 ms)"), "{reasons:?}");
        assert!(reasons[1].contains("lagged past 2000 ms for 31000 ms (lag_for 30000 ms)"), "{reasons:?}");
        assert!(reasons[2].contains("needs 2 more heartbeats"), "{reasons:?}");
        assert!(reasons[3].contains("past 1048576 bytes"), "{reasons:?}");
        let states: Vec<&str> = body["workers"].as_array().unwrap().iter().filter_map(|w| w["state"].as_str()).collect();
        assert_eq!(states, ["silent", "lagging", "recovering", "memory", "ok"]);
    }

    #[test]
    fn the_health_answer_reports_the_loop_lag_and_the_dependencies() {
        let lag = |lag_ms, sheds_default_class, shedding| LocalLoad {
            in_flight: None,
            queued: None,
            lag: Some(LagStatus { lag_ms, max_loop_lag_ms: 50, sheds_default_class, shedding }),
        };
        let body = |r: &Reply| serde_json::from_str::<serde_json::Value>(&r.body).unwrap();
        let calm = health(&lag(3, false, false), None);
        assert_eq!(calm.status, 200);
        assert_eq!(body(&calm), serde_json::json!({"status": "ok", "shedding": false, "loop_lag_ms": 3, "max_loop_lag_ms": 50}));
        let low_only = health(&lag(30, false, true), None);
        assert_eq!((low_only.status, body(&low_only)["shedding"].clone()), (200, serde_json::json!(true)), "only a lower class is shed");
        assert_eq!(health(&lag(48, true, true), None).status, 503);
        let cluster = |name: &str, success_rate| ClusterHealth { name: name.into(), success_rate, limit: 20, in_flight: 1 };
        let view = |fail, rates: &[f64]| DependencyView {
            fail,
            min_success_rate: 0.5,
            clusters: rates.iter().enumerate().map(|(i, r)| cluster(&format!("c{i}"), *r)).collect(),
        };
        let report = health(&LocalLoad::default(), Some(&view(false, &[0.1, 0.2])));
        assert_eq!(report.status, 200, "reported, not failed");
        assert_eq!(body(&report)["dependencies"], "failing");
        assert_eq!(body(&report)["clusters"][1], serde_json::json!({"name": "c1", "success_rate": 0.2, "limit": 20, "in_flight": 1}));
        let failing = health(&LocalLoad::default(), Some(&view(true, &[0.1, 0.2])));
        assert_eq!((failing.status, body(&failing)["status"].clone()), (503, serde_json::json!("dependencies_failing")));
        assert_eq!(health(&LocalLoad::default(), Some(&view(true, &[0.1, 0.9]))).status, 200, "one cluster still serves");
        assert_eq!(health(&LocalLoad::default(), Some(&view(true, &[]))).status, 200, "no data: not failing");
    }

    #[test]
    fn admitted_fields_name_the_tightest_rule() {
        let limiter = limiter();
        let store = MemoryStore::new();
        let probes = [Probe::new(0, 1), Probe::new(1, 2)];
        let now = UnixMillis(1_700_000_000_000 + 300);
        let Verdict::Admitted { standings, .. } = limiter.check(&store, &mut crate::ratelimit::reserve::Reserves::disabled(), &probes, &[], now) else {
            panic!("admitted")
        };
        let (policy, ratelimit) = admitted_fields(&limiter, &standings).unwrap();
        assert_eq!(policy, "\"per-api-key\";q=4;w=4");
        // One counted in the current bucket: the estimate is back to zero at the end of the next.
        assert_eq!(ratelimit, "\"per-api-key\";r=3;t=8");
        let fields = AdmittedFields::new(&limiter);
        let tightest = fields.tightest(&standings).unwrap();
        assert_eq!((tightest.rule, &tightest.ratelimit), (0, &ratelimit));
        let limit = |n| NonZeroU32::new(n).unwrap();
        let per_ip = Tightest { rule: 1, limit: limit(100), ratelimit: String::new() };
        assert_eq!(fields.policy(&per_ip).as_deref(), Some("\"per-ip\";q=100;w=60"));
        let tier = Tightest { limit: limit(7), ..per_ip.clone() };
        assert_eq!(fields.policy(&tier).as_deref(), Some("\"per-ip\";q=7;w=60"), "a tier's limit");
        assert_eq!(fields.policy(&Tightest { rule: 2, ..per_ip }), None);
        assert_eq!(fields.tightest(&[]), None);
    }

    #[test]
    fn admitted_fields_are_the_text_of_ratelimit_fields() {
        let limiter = limiter();
        let fields = AdmittedFields::new(&limiter);
        let standing = |rule: usize, remaining: u64, reset_ms: u64| Standing {
            rule,
            estimate: 0.0,
            remaining,
            reset_ms,
            retry_at: None,
            limit: limiter.tables()[rule].limit,
            go_at: None,
        };
        let mut values = vec![0, 1, 9, 10, 99, 100, 999, 1000, 1001, 12_345, u64::from(u32::MAX)];
        values.extend([u64::MAX - 1, u64::MAX]);
        values.extend((0..64).map(|shift| 1u64 << shift));
        for rule in 0..2 {
            let table = &limiter.tables()[rule];
            for remaining in &values {
                for reset_ms in &values {
                    let (policy, ratelimit) = ratelimit_fields(table, table.limit, *remaining, reset_ms.div_ceil(1000));
                    let standings = [standing(rule, *remaining, *reset_ms)];
                    let tightest = fields.tightest(&standings).unwrap();
                    assert_eq!((tightest.rule, &tightest.ratelimit), (rule, &ratelimit));
                    assert_eq!(fields.policy(&tightest).as_deref(), Some(policy.as_str()));
                }
            }
        }
        // The tightest rule, the first of equals.
        let standings = [standing(1, 5, 0), standing(0, 3, 0), standing(1, 3, 0)];
        assert_eq!(fields.tightest(&standings).unwrap().rule, 0);
    }
}
