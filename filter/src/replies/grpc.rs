//! gRPC requests: the gRPC form of the filter's refusals, and the grade of a gRPC call for
//! cluster selection. A request is gRPC when its `content-type` is `application/grpc` or starts
//! with `application/grpc+` (Envoy's own rule; `application/grpc-web…` is not).
//!
//! Refusals ([`reply`]) carry their own gRPC status ([`crate::config::Grpc`]: `RESOURCE_EXHAUSTED`
//! for a quota, `UNAVAILABLE` when shed or when no cluster has room), the problem's one-line
//! `detail` as the message, and as metadata gRFC A6's `grpc-retry-pushback-ms` and the HTTP reply's
//! `retry-after`, `ratelimit-policy` and `ratelimit`: left to itself, Envoy would make a `429`
//! `UNAVAILABLE`, which gRPC clients retry by default, straight into their limit.
//!
//! Grades ([`effective_status`], [`grade`]): a call counts by its `grpc-status` (the trailers,
//! or a trailers-only response's headers; without one, the status its client would see), after the
//! HTTP classification of [`crate::selection::grade`]; `DEADLINE_EXCEEDED` is a timeout, a status
//! in `failure_grpc_statuses` a failure, and a call whose client left first (flags DR / DC) is not
//! counted.
//!
//! Rationale: docs/design.md, section "Replies".

use crate::config::{Grpc, GrpcStatus};
use crate::replies::{RefusalKind, Reply};
use crate::selection::grade::Grade;

/// The trailer (here: header of the trailers-only response) of gRFC A6 that tells a client
/// how long to wait before it retries, in milliseconds.
pub const PUSHBACK: &str = "grpc-retry-pushback-ms";

/// The gRPC content type.
const CONTENT_TYPE: &[u8] = b"application/grpc";

/// Envoy's response flags that say the downstream left first: DC (downstream connection
/// termination, `0x4000`) and DR (downstream remote reset, `0x1000_0000`, e.g. a client's
/// RST_STREAM when it cancels a call or its deadline expires).
pub const CLIENT_LEFT: u64 = 0x4000 | 0x1000_0000;

/// Whether a request with this `content-type` is gRPC (Envoy's rule, see the module doc).
pub fn is_grpc(content_type: Option<&[u8]>) -> bool {
    match content_type.and_then(|value| value.strip_prefix(CONTENT_TYPE)) {
        Some(rest) => rest.is_empty() || rest.starts_with(b"+"),
        None => false,
    }
}

/// The gRPC form of a refusal: a trailers-only response.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GrpcReply {
    /// `grpc-status`.
    pub status: GrpcStatus,
    /// `grpc-message`: one line (Envoy percent-encodes it).
    pub message: String,
    /// Metadata (extra headers of the trailers-only response), `grpc-retry-pushback-ms` first.
    pub metadata: Vec<(&'static str, String)>,
}

/// The gRPC form of `reply` under `config`; `None` for a reply that refuses nothing.
pub fn reply(reply: &Reply, config: &Grpc) -> Option<GrpcReply> {
    let refusal = reply.refusal.as_ref()?;
    let status = match refusal.kind {
        RefusalKind::RateLimited => config.rate_limited_status,
        RefusalKind::Shed => config.shed_status,
        RefusalKind::NoCapacity => config.no_capacity_status,
    };
    let mut metadata = Vec::with_capacity(reply.headers.len());
    metadata.push((PUSHBACK, refusal.retry_after_ms.to_string()));
    // The body is not sent: its content type means nothing in a trailers-only response.
    metadata.extend(reply.headers.iter().filter(|(name, _)| *name != "content-type").cloned());
    Some(GrpcReply {
        status,
        message: one_line(&refusal.detail),
        metadata,
    })
}

/// `text` with every control character (a line break, say) replaced by a space.
fn one_line(text: &str) -> String {
    text.chars().map(|c| if c.is_control() { ' ' } else { c }).collect()
}

/// The status a `grpc-status` value says. A value that is not a code from 0 to 16 is
/// `UNKNOWN`, as gRPC clients read it.
pub fn parse_status(value: &[u8]) -> GrpcStatus {
    std::str::from_utf8(value)
        .ok()
        .filter(|text| !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|text| text.parse::<u32>().ok())
        .and_then(GrpcStatus::new)
        .unwrap_or(GrpcStatus::UNKNOWN)
}

/// The status a gRPC client derives from the HTTP status of a response without `grpc-status`
/// (gRPC's `doc/http-grpc-status-mapping.md`).
pub fn from_http(status: u16) -> GrpcStatus {
    match status {
        400 => GrpcStatus::INTERNAL,
        401 => GrpcStatus::UNAUTHENTICATED,
        403 => GrpcStatus::PERMISSION_DENIED,
        404 => GrpcStatus::UNIMPLEMENTED,
        429 | 502 | 503 | 504 => GrpcStatus::UNAVAILABLE,
        _ => GrpcStatus::UNKNOWN,
    }
}

/// The status a gRPC call ended with, as its client saw it: `grpc_status` when the response
/// carried one; otherwise derived from the HTTP status; `None` when there was no response or
/// the client left first (`flags`, [`CLIENT_LEFT`]).
pub fn effective_status(grpc_status: Option<GrpcStatus>, http_status: Option<u16>, flags: u64) -> Option<GrpcStatus> {
    if grpc_status.is_some() {
        return grpc_status;
    }
    match http_status {
        None => None,
        Some(200) if flags & CLIENT_LEFT != 0 => None,
        Some(200) => Some(GrpcStatus::UNKNOWN),
        Some(status) => Some(from_http(status)),
    }
}

/// Whether classifying a gRPC call needs Envoy's response flags (a host call): when it ended
/// without a gRPC status (did the client leave? was the upstream reset?), or with a failure or
/// `DEADLINE_EXCEEDED` (a timeout of Envoy's, flag UT, is a timeout whatever the status says).
/// The shell reads them anyway when there is no HTTP status or it is a 5xx.
pub fn needs_flags(grpc_status: Option<GrpcStatus>, failures: &[GrpcStatus]) -> bool {
    match grpc_status {
        None => true,
        Some(status) => status == GrpcStatus::DEADLINE_EXCEEDED || failures.contains(&status),
    }
}

/// The grade of a gRPC call for cluster selection: its HTTP grade when that is a timeout or
/// a failure; otherwise by its [`effective_status`]: none (`None`) is not counted,
/// `DEADLINE_EXCEEDED` is a timeout, a status in `failures` a failure, any other status the
/// HTTP grade (a success, or a slow one).
pub fn grade(http: Grade, status: Option<GrpcStatus>, failures: &[GrpcStatus]) -> Grade {
    match (http, status) {
        (Grade::Timeout | Grade::Overflow | Grade::Failure, _) => http,
        (_, None) => Grade::Ignored,
        (_, Some(GrpcStatus::DEADLINE_EXCEEDED)) => Grade::Timeout,
        (_, Some(status)) if failures.contains(&status) => Grade::Failure,
        (_, Some(_)) => http,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::config::{default_failure_grpc_statuses, Config};
    use crate::ratelimit::reserve::Reserves;
    use crate::ratelimit::{Limiter, Probe, Verdict};
    use crate::replies::{self, Refusal};
    use crate::shedding::{Shed, Shedder};
    use crate::primitives::store::MemoryStore;
    use crate::primitives::time::UnixMillis;

    #[test]
    fn grpc_is_envoys_content_type_rule() {
        for (value, grpc) in [
            (&b"application/grpc"[..], true),
            (b"application/grpc+proto", true),
            (b"application/grpc+json", true),
            (b"application/grpc+", true),
            (b"application/grpc-web", false),
            (b"application/grpc-web+proto", false),
            (b"application/grpc-web-text", false),
            (b"application/grpc;charset=utf-8", false),
            (b"application/grpcx", false),
            (b"Application/grpc", false),
            (b"application/json", false),
            (b"", false),
        ] {
            assert_eq!(is_grpc(Some(value)), grpc, "{}", String::from_utf8_lossy(value));
        }
        assert!(!is_grpc(None));
    }

    fn quota_reply() -> Reply {
        let config = Config::parse(
            br#"{"rate_limits":[{"name":"per-api-key","key":[{"header":"x-api-key"}],"limit":2,"window":"10s"}]}"#,
        )
        .unwrap();
        let limiter = Limiter::new(&config, "t");
        let store = MemoryStore::new();
        let probes = [Probe::new(0, 7)];
        // 2.5 s into a 10 s bucket: the third request waits for the next bucket's room.
        let now = UnixMillis(1_700_000_000_000 + 2_500);
        let mut verdict = limiter.check(&store, &mut Reserves::disabled(), &probes, &[], now);
        while matches!(verdict, Verdict::Admitted { .. }) {
            verdict = limiter.check(&store, &mut Reserves::disabled(), &probes, &[], now);
        }
        replies::rate_limited(&limiter, &verdict, now).unwrap()
    }

    #[test]
    fn a_quota_refusal_is_resource_exhausted_with_pushback_and_the_ratelimit_fields() {
        let http = quota_reply();
        let grpc = reply(&http, &Grpc::default()).unwrap();
        assert_eq!(grpc.status, GrpcStatus::RESOURCE_EXHAUSTED);
        let refusal = http.refusal.as_ref().unwrap();
        assert_eq!(refusal.kind, RefusalKind::RateLimited);
        assert_eq!(grpc.message, "quota \"per-api-key\" of 2 requests per 10s is exhausted (current estimate 2); retry in 13 s");
        assert!(!grpc.message.contains('\n'));
        let names: Vec<&str> = grpc.metadata.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, [PUSHBACK, "retry-after", "ratelimit-policy", "ratelimit"]);
        let value = |name: &str| grpc.metadata.iter().find(|(n, _)| *n == name).unwrap().1.clone();
        // The exact wait (the rest of this bucket, then half of the next, when the previous
        // bucket's 2 weigh 1), where retry-after rounds it up to whole seconds.
        assert_eq!(refusal.retry_after_ms, 12_500);
        assert_eq!(value(PUSHBACK), "12500");
        assert_eq!(value("retry-after"), "13");
        let header = |name: &str| http.headers.iter().find(|(n, _)| *n == name).unwrap().1.clone();
        for name in ["retry-after", "ratelimit-policy", "ratelimit"] {
            assert_eq!(value(name), header(name));
        }
        // The body's detail is the message.
        let body: serde_json::Value = serde_json::from_str(&http.body).unwrap();
        assert_eq!(body["detail"], grpc.message.as_str());
        assert_eq!(body["retry_after_ms"], refusal.retry_after_ms);
    }

    #[test]
    fn the_status_of_each_refusal_is_configurable() {
        let http = quota_reply();
        let config = Config::parse(br#"{"grpc":{"rate_limited_status":"UNAVAILABLE","shed_status":"RESOURCE_EXHAUSTED","no_capacity_status":10}}"#).unwrap();
        assert_eq!(reply(&http, &config.grpc).unwrap().status, GrpcStatus::UNAVAILABLE);

        let shedding = Config::parse(br#"{"load_shedding":{"max_active_requests":4,"retry_after":"2500ms"}}"#).unwrap();
        let shedder = Shedder::new(shedding.load_shedding.as_ref().unwrap(), "t").unwrap();
        let shed = replies::shed(&shedder, &Shed { in_flight: 4, class: 1, contention: false });
        let default = reply(&shed, &Grpc::default()).unwrap();
        assert_eq!(default.status, GrpcStatus::UNAVAILABLE);
        assert_eq!(default.message, "4 requests in flight; class \"normal\" is shed from 3 (limit 4); retry in 3 s");
        // retry-after is whole seconds, and the pushback says the same.
        assert_eq!(default.metadata, vec![(PUSHBACK, "3000".to_owned()), ("retry-after", "3".to_owned())]);
        assert_eq!(reply(&shed, &config.grpc).unwrap().status, GrpcStatus::RESOURCE_EXHAUSTED);

        let selection = Config::parse(br#"{"cluster_selection":{"clusters":["a","b"]}}"#).unwrap();
        let selector = crate::selection::Selector::new(selection.cluster_selection.as_ref().unwrap(), "t");
        let exhausted = crate::selection::Exhausted { clusters: vec![Some((20, 20)), None], contention: false };
        let none = replies::no_capacity(&selector, &exhausted);
        let default = reply(&none, &Grpc::default()).unwrap();
        assert_eq!(default.status, GrpcStatus::UNAVAILABLE);
        assert_eq!(default.message, "every upstream cluster is at its concurrency limit; retry in 1 s");
        assert_eq!(default.metadata, vec![(PUSHBACK, "1000".to_owned()), ("retry-after", "1".to_owned())]);
        assert_eq!(reply(&none, &config.grpc).unwrap().status.code(), 10);

        // The health endpoint's answer refuses nothing.
        assert_eq!(reply(&replies::health(&replies::LocalLoad::default(), None), &Grpc::default()), None);
    }

    #[test]
    fn messages_are_one_line() {
        let mut http = quota_reply();
        if let Some(refusal) = http.refusal.as_mut() {
            *refusal = Refusal { detail: "a\nb\r\tc".into(), ..refusal.clone() };
        }
        assert_eq!(reply(&http, &Grpc::default()).unwrap().message, "a b  c");
    }

    #[test]
    fn grpc_status_values() {
        assert_eq!(parse_status(b"0"), GrpcStatus::OK);
        assert_eq!(parse_status(b"14"), GrpcStatus::UNAVAILABLE);
        assert_eq!(parse_status(b"16"), GrpcStatus::UNAUTHENTICATED);
        for odd in [&b"17"[..], b"-1", b"", b" 0", b"+0", b"abc", b"99999999999999999999", b"\xff"] {
            assert_eq!(parse_status(odd), GrpcStatus::UNKNOWN, "{odd:?}");
        }
        assert_eq!(from_http(404), GrpcStatus::UNIMPLEMENTED);
        assert_eq!(from_http(429), GrpcStatus::UNAVAILABLE);
        assert_eq!(from_http(503), GrpcStatus::UNAVAILABLE);
        assert_eq!(from_http(500), GrpcStatus::UNKNOWN);
        assert_eq!(from_http(401), GrpcStatus::UNAUTHENTICATED);
    }

    #[test]
    fn the_effective_status_is_what_the_client_saw() {
        let dr = 0x1000_0000;
        let dc = 0x4000;
        let ur = 0x10;
        assert_eq!(effective_status(Some(GrpcStatus::INTERNAL), Some(200), 0), Some(GrpcStatus::INTERNAL));
        assert_eq!(effective_status(Some(GrpcStatus::OK), Some(200), dr), Some(GrpcStatus::OK));
        assert_eq!(effective_status(None, None, 0), None);
        assert_eq!(effective_status(None, None, dr), None);
        // Headers, then no status: cut short by the client, or by something else.
        assert_eq!(effective_status(None, Some(200), dr), None);
        assert_eq!(effective_status(None, Some(200), dc), None);
        assert_eq!(effective_status(None, Some(200), ur), Some(GrpcStatus::UNKNOWN));
        assert_eq!(effective_status(None, Some(200), 0), Some(GrpcStatus::UNKNOWN));
        assert_eq!(effective_status(None, Some(404), 0), Some(GrpcStatus::UNIMPLEMENTED));
        assert_eq!(effective_status(None, Some(503), dr), Some(GrpcStatus::UNAVAILABLE));
    }

    #[test]
    fn grades_of_grpc_calls() {
        let failures = default_failure_grpc_statuses();
        let of = |http, status| grade(http, status, &failures);
        // The HTTP classification's timeouts and failures stand.
        assert_eq!(of(Grade::Timeout, Some(GrpcStatus::OK)), Grade::Timeout);
        assert_eq!(of(Grade::Failure, Some(GrpcStatus::OK)), Grade::Failure);
        assert_eq!(of(Grade::Failure, None), Grade::Failure);
        // HTTP 200: the gRPC status decides.
        assert_eq!(of(Grade::Success, Some(GrpcStatus::OK)), Grade::Success);
        assert_eq!(of(Grade::Slow, Some(GrpcStatus::OK)), Grade::Slow);
        for failing in [GrpcStatus::UNAVAILABLE, GrpcStatus::INTERNAL, GrpcStatus::UNKNOWN, GrpcStatus::DATA_LOSS] {
            assert_eq!(of(Grade::Success, Some(failing)), Grade::Failure, "{failing}");
            assert_eq!(of(Grade::Slow, Some(failing)), Grade::Failure, "{failing}");
        }
        assert_eq!(of(Grade::Success, Some(GrpcStatus::DEADLINE_EXCEEDED)), Grade::Timeout);
        for fine in [GrpcStatus::CANCELLED, GrpcStatus::RESOURCE_EXHAUSTED, GrpcStatus::UNIMPLEMENTED, GrpcStatus::PERMISSION_DENIED] {
            assert_eq!(of(Grade::Success, Some(fine)), Grade::Success, "{fine}");
        }
        assert_eq!(of(Grade::Success, None), Grade::Ignored);
        assert_eq!(of(Grade::Ignored, None), Grade::Ignored);
        // Configured failures replace the default.
        let custom = [GrpcStatus::RESOURCE_EXHAUSTED];
        assert_eq!(grade(Grade::Success, Some(GrpcStatus::RESOURCE_EXHAUSTED), &custom), Grade::Failure);
        assert_eq!(grade(Grade::Success, Some(GrpcStatus::UNAVAILABLE), &custom), Grade::Success);
        assert_eq!(grade(Grade::Success, Some(GrpcStatus::DEADLINE_EXCEEDED), &[]), Grade::Timeout);
    }

    proptest::proptest! {
        /// Whatever a client or an upstream sends, reading it never panics, and a status read
        /// is one of the 17.
        #[test]
        fn arbitrary_header_values(value in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..24)) {
            let _ = is_grpc(Some(&value));
            proptest::prop_assert!(parse_status(&value).code() <= 16);
        }
    }

    #[test]
    fn flags_only_when_they_can_change_the_grade() {
        let failures = default_failure_grpc_statuses();
        assert!(!needs_flags(Some(GrpcStatus::OK), &failures));
        assert!(!needs_flags(GrpcStatus::new(5), &failures));
        assert!(needs_flags(None, &failures));
        assert!(needs_flags(Some(GrpcStatus::UNAVAILABLE), &failures));
        assert!(needs_flags(Some(GrpcStatus::DEADLINE_EXCEEDED), &[]));
    }
}
