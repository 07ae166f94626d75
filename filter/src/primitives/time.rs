//! Time as the core sees it, passed in by the host shell (read once per callback), never read here.
//! Two clocks, each named for what it is:
//!
//! - [`UnixMillis`]: wall-clock milliseconds since the Unix epoch. Rate-limit windows are aligned
//!   to it, and the fleet's proxies agree on it.
//! - [`MonoMillis`]: the host's monotonic clock (Envoy's `monotonicTime()`, WASI
//!   `CLOCK_MONOTONIC`), one for every worker of the process, which never steps: in-flight
//!   heartbeats, cluster-selection buckets and latencies, so a wall-clock step neither makes a
//!   worker's entries look dead nor a response look slow.
//!
//! Invariant: every difference saturates (the contract of governor's `Reference`), so a corrupt
//! record or a test clock cannot make it wrap.
//!
//! Rationale: docs/design.md, section "Shared data and compare-and-swap".

/// A newtype of milliseconds on one clock, with the saturating arithmetic every user needs.
macro_rules! millis {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub u64);

        impl $name {
            /// Milliseconds from `earlier` to `self`, zero if `earlier` is later.
            pub fn saturating_since(self, earlier: $name) -> u64 {
                self.0.saturating_sub(earlier.0)
            }

            /// `self` moved `ms` milliseconds later, saturating.
            pub fn plus_ms(self, ms: u64) -> $name {
                $name(self.0.saturating_add(ms))
            }
        }
    };
}

millis! {
    /// Milliseconds since the Unix epoch, as the proxy's wall clock reported them.
    UnixMillis
}

millis! {
    /// Milliseconds of the host's monotonic clock: an arbitrary origin (typically the machine's
    /// boot), the same for every worker of the process, never stepping backwards or forwards.
    MonoMillis
}

/// One reading of both clocks, taken once per callback.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Now {
    /// The wall clock.
    pub wall: UnixMillis,
    /// The monotonic clock.
    pub mono: MonoMillis,
}

/// How long a [`WallEstimate`] trusts its offset before the shell reads the wall clock again.
pub const WALL_REFRESH_MS: u64 = 1_000;

/// The wall clock derived from the monotonic one: `wall ≈ mono + offset`, the offset measured
/// at most [`WALL_REFRESH_MS`] ago. A callback then reads one clock, not two; the estimate is
/// off by the clocks' drift over a second (NTP slews at most 0.5 ms per second), or, for at
/// most a second after the wall clock stepped, by the step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WallEstimate {
    /// `(mono, wall)` read together, when last refreshed.
    anchor: Option<(MonoMillis, UnixMillis)>,
}

impl WallEstimate {
    /// Both clocks at `mono`: the wall clock is estimated from the anchor while it is fresh,
    /// else read with `read_wall` (which becomes the new anchor).
    pub fn at(&mut self, mono: MonoMillis, read_wall: impl FnOnce() -> UnixMillis) -> Now {
        match self.anchor {
            Some((at, wall)) if at <= mono && mono.saturating_since(at) < WALL_REFRESH_MS => Now {
                wall: wall.plus_ms(mono.saturating_since(at)),
                mono,
            },
            _ => {
                let wall = read_wall();
                self.anchor = Some((mono, wall));
                Now { wall, mono }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wall_clock_is_read_once_a_second_and_follows_a_step_within_it() {
        let mut estimate = WallEstimate::default();
        let mut reads = 0;
        let wall_at = |mono: MonoMillis, step: u64| {
            move || UnixMillis(1_700_000_000_000 + step + mono.0)
        };
        let first = estimate.at(MonoMillis(5_000), || {
            reads += 1;
            wall_at(MonoMillis(5_000), 0)()
        });
        assert_eq!(first, Now { wall: UnixMillis(1_700_000_005_000), mono: MonoMillis(5_000) });
        // 999 ms later: derived, not read (the wall clock stepped 20 s meanwhile).
        let later = estimate.at(MonoMillis(5_999), || {
            reads += 1;
            wall_at(MonoMillis(5_999), 20_000)()
        });
        assert_eq!(later.wall, UnixMillis(1_700_000_005_999));
        assert_eq!(reads, 1);
        // A second after the anchor: read again, the step shows.
        let next = estimate.at(MonoMillis(6_000), || {
            reads += 1;
            wall_at(MonoMillis(6_000), 20_000)()
        });
        assert_eq!(next.wall, UnixMillis(1_700_000_026_000));
        assert_eq!(reads, 2);
        // A monotonic reading before the anchor (another VM's, in a test) reads the wall clock.
        let _ = estimate.at(MonoMillis(10), || {
            reads += 1;
            UnixMillis(1)
        });
        assert_eq!(reads, 3);
    }
}
