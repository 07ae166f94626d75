//! Requests that wait for the body their estimate is read from (`cost.estimate.body`), as the
//! root's tick sees them: a request none of whose body has reached the filter within
//! [`BODY_WAIT_MS`] is decided without it, on its rules' `estimate.default`. Envoy holds a paused
//! request's body back from the filter unless the plugin sets `allow_on_headers_stop_iteration`;
//! without this stage such a request would wait until Envoy's stream idle timeout.
//!
//! Whether the filter gets paused requests' bodies is the plugin's setting, fixed for the
//! configuration's life: once [`MISSES_BEFORE_WITHHELD`] requests in a row got none of their
//! body in time, and no waiting request ever got any, bodies are taken to be withheld, and
//! requests are decided on their headers (on `estimate.default`) without waiting.
//!
//! Invariants: a request is listed once, when it starts to wait; the tick takes it at most once
//! (a request whose body came, or that ended, is dropped from the list unread); nothing is held
//! while it waits, so a request taken after its client went away has nothing to give back. Once
//! a waiting request got bytes of its body, bodies are never taken to be withheld.

use super::SharedStream;
use crate::primitives::time::MonoMillis;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;

/// How long a request waits for the first bytes of its body before it is decided without it.
pub const BODY_WAIT_MS: u64 = 1000;
/// Requests in a row that got none of their body in time, with none ever getting any, after
/// which bodies are taken to be withheld (one slow client alone is not enough).
pub const MISSES_BEFORE_WITHHELD: u32 = 2;

/// The requests that wait for their body, in the order they started to.
#[derive(Debug, Default)]
pub struct BodyWaitStage {
    waiting: RefCell<VecDeque<(MonoMillis, u32, SharedStream)>>,
    /// The warning that bodies do not reach the filter was logged (once per configuration).
    warned: Cell<bool>,
    /// A waiting request got bytes of its body: the plugin's setting lets them through.
    arrived: Cell<bool>,
    /// Requests in a row decided without any of their body.
    misses: Cell<u32>,
}

impl BodyWaitStage {
    /// The stage, when some rule reads its estimate in request bodies.
    pub fn new(reads_request_bodies: bool) -> Option<BodyWaitStage> {
        reads_request_bodies.then(BodyWaitStage::default)
    }

    /// Bytes of a waiting request's body reached the filter.
    pub fn body_arrived(&self) {
        self.arrived.set(true);
        self.misses.set(0);
    }

    /// Whether bodies are taken to be withheld from the filter: requests then do not wait.
    pub fn withheld(&self) -> bool {
        !self.arrived.get() && self.misses.get() >= MISSES_BEFORE_WITHHELD
    }

    /// A request (its stream `context`) starts to wait for its body at `now`.
    pub fn park(&self, now: MonoMillis, context: u32, stream: SharedStream) {
        self.waiting.borrow_mut().push_back((now, context, stream));
    }

    /// The requests that waited [`BODY_WAIT_MS`] by `now` and got none of their body: to decide
    /// without it ([`super::Waiting::Body`]). Those whose body came or that ended go.
    pub fn take_due(&self, now: MonoMillis) -> Vec<(u32, SharedStream)> {
        let mut waiting = self.waiting.borrow_mut();
        let mut due = Vec::new();
        while let Some((since, _, stream)) = waiting.front() {
            let still = stream.borrow().body_never_came();
            if still && now.saturating_since(*since) < BODY_WAIT_MS {
                break;
            }
            if let Some((_, context, stream)) = waiting.pop_front().filter(|_| still) {
                due.push((context, stream));
            }
        }
        if !due.is_empty() {
            let missed = u32::try_from(due.len()).unwrap_or(u32::MAX);
            self.misses.set(self.misses.get().saturating_add(missed));
            if self.withheld() && !self.warned.replace(true) {
                log::warn!(
                    "floodgate: no byte of {} requests' bodies reached the filter within {BODY_WAIT_MS} ms while their estimates waited for them: requests are decided on their headers from now on, reserving estimate.default. Set allow_on_headers_stop_iteration: true on the Wasm filter (docs/llm.md)",
                    self.misses.get()
                );
            }
        }
        due
    }

    /// Requests listed (for tests).
    pub fn len(&self) -> usize {
        self.waiting.borrow().len()
    }

    /// Whether none is listed.
    pub fn is_empty(&self) -> bool {
        self.waiting.borrow().is_empty()
    }
}
