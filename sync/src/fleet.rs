//! The fleet size a sync answer gives (`floodgate-proxies`): the distinct proxies that sent a
//! batch in the last [`FLEET_SECONDS`] seconds, counted in Redis (a HyperLogLog per second,
//! [`Store::fleet_size`]), with the callers of one [`COUNT_PERIOD`] merged into one round trip.
//!
//! Each proxy calls in at least once a second, so a fleet of `N` proxies would cost Redis `N`
//! round trips a second for its size alone. Here a call adds its proxy to the ids waiting to be
//! counted and is answered with the last count while that count is younger than
//! [`COUNT_PERIOD`]; the first call after it (or with no count yet) sends every waiting id in one
//! `PFADD` and reads the new count. Redis sees at most one round trip per period and instance,
//! whatever the fleet's size.
//!
//! Invariants: a proxy that called in is in a count read at most [`COUNT_PERIOD`] after the
//! next call this instance serves (so within about a second plus a period, in a live fleet); the
//! waiting ids are soft state, at most [`MAX_WAITING`] of them, and lost with the process
//! (the proxy's next call adds it again); at most one count is in flight per instance.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::layout::{Layout, FLEET_SECONDS};
use crate::store::{Store, StoreError};

/// How long a count answers calls before the next call reads a new one.
pub const COUNT_PERIOD: Duration = Duration::from_millis(200);
/// The most proxy ids waiting for the next count (further ones wait for a later call).
pub const MAX_WAITING: usize = 65_536;

#[derive(Default)]
struct State {
    /// Proxies that called in since the last count was sent.
    waiting: HashSet<String>,
    /// The last count and when it was read.
    last: Option<(u64, Instant)>,
    /// Whether a count is in flight.
    counting: bool,
}

/// The fleet size of one instance's callers (module doc).
#[derive(Default)]
pub struct FleetSize {
    state: Mutex<State>,
}

impl FleetSize {
    /// `proxy` called in: the fleet size to answer with (`None`: none known yet, or Redis did
    /// not answer; the answer goes without it).
    pub async fn called(&self, store: &Store, layout: &Layout, proxy: &str) -> Option<u64> {
        let ids = {
            let mut state = self
                .state
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if state.waiting.len() < MAX_WAITING {
                state.waiting.insert(proxy.to_owned());
            }
            let fresh = state
                .last
                .is_some_and(|(_, at)| at.elapsed() < COUNT_PERIOD);
            if fresh || (state.counting && state.last.is_some()) {
                return state.last.map(|(count, _)| count);
            }
            if state.counting {
                // The first count is on its way; this caller is in the next one.
                return None;
            }
            state.counting = true;
            std::mem::take(&mut state.waiting)
        };
        let counted = count(store, layout, ids).await;
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        state.counting = false;
        match counted {
            Ok(count) => {
                state.last = Some((count, Instant::now()));
                Some(count)
            }
            Err(err) => {
                tracing::debug!("fleet size not read: {err}");
                state.last.map(|(count, _)| count)
            }
        }
    }
}

/// Adds `ids` to this second's HyperLogLog and counts the last [`FLEET_SECONDS`] seconds.
async fn count(store: &Store, layout: &Layout, ids: HashSet<String>) -> Result<u64, StoreError> {
    let second = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    let keys: Vec<String> = (0..FLEET_SECONDS)
        .map(|ago| layout.fleet_key(second.saturating_sub(ago)))
        .collect();
    let ids: Vec<String> = ids.into_iter().collect();
    store.fleet_size(&keys, &ids).await
}
