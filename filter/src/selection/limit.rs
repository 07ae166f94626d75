//! The per-cluster concurrency limit: AIMD, after Netflix concurrency-limits' `AIMDLimit`.
//!
//! ```text
//! dropped (timeout, or slower than `timeout`):  limit ← ⌊limit × backoff_ratio⌋
//! success, with in_flight × 2 ≥ limit:          limit ← limit + 1
//! then                                          limit ← clamp(limit, min_limit, max_limit)
//! ```
//!
//! `in_flight` is the cluster's count when the request took its permit (itself included): a limit
//! only grows while at least half of it is in use, so an idle cluster's limit does not drift up.
//! Other failures and ignored requests leave the limit alone (Netflix's `onIgnore`): they say
//! nothing about the cluster's capacity.
//!
//! Rationale: docs/design.md, section "Cluster selection" (concurrency limit).

use crate::config::ConcurrencyLimit;

/// What a finished request tells the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sample {
    /// Answered in time.
    Success,
    /// Timed out, or answered slower than the limit's timeout.
    Dropped,
    /// Says nothing about capacity (another error, or the client left).
    Ignored,
}

/// The AIMD parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Aimd {
    /// The limit of a cluster with no history.
    pub initial: u32,
    /// Lower bound.
    pub min: u32,
    /// Upper bound.
    pub max: u32,
    /// Multiplier on a drop, in (0, 1).
    pub backoff_ratio: f64,
    /// A success slower than this is a drop, in milliseconds.
    pub timeout_ms: u64,
}

impl Aimd {
    /// The parameters of `config`.
    pub fn new(config: &ConcurrencyLimit) -> Aimd {
        Aimd {
            initial: config.initial_limit.get().get(),
            min: config.min_limit.get().get(),
            max: config.max_limit.get().get(),
            backoff_ratio: config.backoff_ratio,
            timeout_ms: config.timeout.get().get(),
        }
    }

    /// A stored limit brought within the configured bounds (they may have changed).
    pub fn clamp(&self, limit: u32) -> u32 {
        limit.clamp(self.min, self.max)
    }

    /// The limit after one sample.
    pub fn update(&self, limit: u32, in_flight: u32, sample: Sample) -> u32 {
        let next = match sample {
            Sample::Dropped => {
                let scaled = (f64::from(limit) * self.backoff_ratio).floor();
                // In [0, limit]: the ratio is in (0, 1).
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let scaled = scaled.clamp(0.0, f64::from(limit)) as u32;
                scaled
            }
            Sample::Success if in_flight.saturating_mul(2) >= limit => limit.saturating_add(1),
            Sample::Success | Sample::Ignored => limit,
        };
        self.clamp(next)
    }
}
