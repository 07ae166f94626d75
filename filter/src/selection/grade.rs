//! How a stream ended, from the proxy's point of view: the final status and Envoy's response
//! flags (`response.code` and `response.flags` attributes, read in `on_log`), and how long the
//! upstream took to answer.
//!
//! The shell reads the flags only when there is no status or it is 5xx (each read is a host call
//! that returns bytes): a stream whose status line went downstream below 500 counts by its
//! status, even if the upstream then failed mid-body (a reset or a stream-duration limit after
//! the headers).
//!
//! "Slow" is the **upstream's** latency, not the stream's: from the end of the request (when the
//! upstream can start working on it; the permit, when the upstream answered before the request
//! ended) to the response headers. A slow upload, a slow reader, a long download, a WebSocket or
//! a server-sent event stream says nothing about the upstream's capacity, and must not cut its
//! concurrency limit: a client could otherwise shrink a healthy cluster on purpose.
//!
//! Rationale: docs/design.md, section "Cluster selection" (grades).

use super::limit::Sample;
use crate::config::StatusMatch;

/// Envoy's legacy response-flag bits (`StreamInfo::legacyResponseFlags`).
pub mod flags {
    /// UH: no healthy upstream host.
    pub const NO_HEALTHY_UPSTREAM: u64 = 0x2;
    /// UT: upstream request timeout.
    pub const UPSTREAM_REQUEST_TIMEOUT: u64 = 0x4;
    /// LR: connection reset locally.
    pub const LOCAL_RESET: u64 = 0x8;
    /// UR: upstream remote reset.
    pub const UPSTREAM_REMOTE_RESET: u64 = 0x10;
    /// UF: upstream connection failure.
    pub const UPSTREAM_CONNECTION_FAILURE: u64 = 0x20;
    /// UC: upstream connection termination.
    pub const UPSTREAM_CONNECTION_TERMINATION: u64 = 0x40;
    /// UO: upstream overflow (circuit breaking).
    pub const UPSTREAM_OVERFLOW: u64 = 0x80;
    /// URX: upstream retry limit exceeded.
    pub const UPSTREAM_RETRY_LIMIT_EXCEEDED: u64 = 0x8000;
    /// UMSDR: upstream max stream duration reached.
    pub const UPSTREAM_MAX_STREAM_DURATION_REACHED: u64 = 0x80000;
    /// UPE: upstream protocol error.
    pub const UPSTREAM_PROTOCOL_ERROR: u64 = 0x80_0000;
    /// NC: no cluster of the chosen name.
    pub const NO_CLUSTER_FOUND: u64 = 0x100_0000;

    /// Flags that mean the upstream timed out.
    pub const TIMEOUT: u64 = UPSTREAM_REQUEST_TIMEOUT | UPSTREAM_MAX_STREAM_DURATION_REACHED;
    /// Flags that mean the upstream failed (reset, unreachable, missing). An overflow
    /// ([`UPSTREAM_OVERFLOW`]) is a failure too, and also a drop for the limit.
    pub const FAILURE: u64 = NO_HEALTHY_UPSTREAM
        | LOCAL_RESET
        | UPSTREAM_REMOTE_RESET
        | UPSTREAM_CONNECTION_FAILURE
        | UPSTREAM_CONNECTION_TERMINATION
        | UPSTREAM_RETRY_LIMIT_EXCEEDED
        | UPSTREAM_PROTOCOL_ERROR
        | NO_CLUSTER_FOUND;
}

/// What the proxy saw of a stream when it ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Ending {
    /// The final status sent downstream (`None`: no response, e.g. the client left first).
    pub status: Option<u16>,
    /// Envoy's response flags.
    pub flags: u64,
    /// The upstream's latency in milliseconds (module doc), `None` without response headers.
    pub latency_ms: Option<u64>,
}

/// A finished request's grade: how it counts for the cluster's success rate and its concurrency
/// limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Grade {
    /// Answered, not with a failure status, within the limit's timeout.
    Success,
    /// Answered successfully, but the response headers came later than the limit's timeout
    /// after the request ended: a success for the success rate, a drop for the concurrency
    /// limit.
    Slow,
    /// Upstream timeout (`504`, flag UT or UMSDR).
    Timeout,
    /// Envoy's circuit breaker refused it (flag UO: the cluster's pending or request limit was
    /// reached): a failure for the success rate and a drop for the concurrency limit, which
    /// backs off as on a timeout (the fallback cascade's and Netflix's `onDropped`: the cluster
    /// has no room for more).
    Overflow,
    /// A failure status, a reset, a connection failure, or no such cluster.
    Failure,
    /// No response (the client left first): not counted.
    Ignored,
}

impl Grade {
    /// Classifies an ending: timeouts first, then overflows, failures by flag or status, then
    /// slowness.
    pub fn classify(ending: &Ending, failure_statuses: &[StatusMatch], timeout_ms: u64) -> Grade {
        if ending.flags & flags::TIMEOUT != 0 || ending.status == Some(504) {
            return Grade::Timeout;
        }
        if ending.flags & flags::UPSTREAM_OVERFLOW != 0 {
            return Grade::Overflow;
        }
        if ending.flags & flags::FAILURE != 0 {
            return Grade::Failure;
        }
        match ending.status {
            None => Grade::Ignored,
            Some(status) if failure_statuses.iter().any(|m| m.matches(status)) => Grade::Failure,
            Some(_) if ending.latency_ms.is_some_and(|ms| ms > timeout_ms) => Grade::Slow,
            Some(_) => Grade::Success,
        }
    }

    /// Whether it enters the cluster's stats, and as a success.
    pub fn tally(self) -> Option<bool> {
        match self {
            Grade::Success | Grade::Slow => Some(true),
            Grade::Timeout | Grade::Overflow | Grade::Failure => Some(false),
            Grade::Ignored => None,
        }
    }

    /// What it tells the concurrency limit.
    pub fn sample(self) -> Sample {
        match self {
            Grade::Success => Sample::Success,
            Grade::Slow | Grade::Timeout | Grade::Overflow => Sample::Dropped,
            Grade::Failure | Grade::Ignored => Sample::Ignored,
        }
    }
}
