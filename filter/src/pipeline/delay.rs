//! The `delay` stage: requests a token bucket with `max_delay` let in to wait for their turn
//! ([`crate::ratelimit::bucket`]). Such a request took its turn of the bucket when it came;
//! it is parked here with the instant it goes, and the root's tick ([`TICK_MS`], only when a
//! rule has `max_delay`) resumes the streams whose turn came, in the order of their turns, each
//! from its own context ([`super::Waiting::Turn`]), as the leased stage's answers resume the
//! streams waiting for the store. A stream that ends while it waits gives its turns back
//! ([`super::Stream::end`]); the tick skips it.
//!
//! Nothing here calls the host.

use super::SharedStream;
use crate::config::Config;
use crate::primitives::time::{MonoMillis, UnixMillis};
use crate::ratelimit::Probe;
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;

/// The tick period while a rule can delay requests, ms: a request goes at most this late after
/// its turn (plus the event loop's own lateness).
pub const TICK_MS: u64 = 10;

/// A request waiting for its turn (kept in its stream's state).
#[derive(Clone, Debug, Default)]
pub struct Delayed {
    /// When it goes, on the wall clock (the buckets' time).
    pub go_at: UnixMillis,
    /// When it goes, on the monotonic clock (the tick's time).
    pub until: MonoMillis,
    /// When it started to wait, on the monotonic clock.
    pub since: MonoMillis,
    /// The rule whose turn it waits for (the latest of the enforced buckets').
    pub rule: usize,
    /// The turns it took of token buckets, given back if its client goes away first.
    pub turns: Vec<Probe>,
    /// Whether the request headers ended the request.
    pub end_of_stream: bool,
    /// Request body seen while waiting: bytes, and whether it ended.
    pub body: (usize, bool),
}

/// The streams waiting for their turn, by the instant it comes.
#[derive(Default)]
pub struct DelayStage {
    parked: RefCell<BTreeMap<(MonoMillis, u64), (u32, SharedStream)>>,
    arrivals: Cell<u64>,
}

impl DelayStage {
    /// The stage of `config`, if a rule may delay requests.
    pub fn new(config: &Config) -> Option<DelayStage> {
        config.rate_limits.iter().any(|r| r.max_delay.is_some()).then(DelayStage::default)
    }

    /// Parks stream `context` until `until`.
    pub fn park(&self, until: MonoMillis, context: u32, shared: SharedStream) {
        let arrival = self.arrivals.get();
        self.arrivals.set(arrival.wrapping_add(1));
        self.parked.borrow_mut().insert((until, arrival), (context, shared));
    }

    /// The streams whose turn came by `now`, in the order of their turns (first come first
    /// among equals), taken off the stage.
    pub fn take_due(&self, now: MonoMillis) -> Vec<(u32, SharedStream)> {
        let mut parked = self.parked.borrow_mut();
        let later = parked.split_off(&(now.plus_ms(1), 0));
        std::mem::replace(&mut *parked, later).into_values().collect()
    }

    /// Streams parked.
    pub fn len(&self) -> usize {
        self.parked.borrow().len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.parked.borrow().is_empty()
    }
}
