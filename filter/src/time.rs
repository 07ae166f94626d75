//! Time as the core sees it: wall-clock milliseconds since the Unix epoch, passed in by the
//! host shell (read once per callback), never read here.
//!
//! The host clock is wall time and can step backwards, so every difference saturates
//! (governor's `Reference` contract).

/// Milliseconds since the Unix epoch, as the proxy's wall clock reported them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct UnixMillis(pub u64);

impl UnixMillis {
    /// Milliseconds from `earlier` to `self`, zero if `earlier` is later.
    pub fn saturating_since(self, earlier: UnixMillis) -> u64 {
        self.0.saturating_sub(earlier.0)
    }

    /// `self` moved `ms` milliseconds later, saturating.
    pub fn plus_ms(self, ms: u64) -> UnixMillis {
        UnixMillis(self.0.saturating_add(ms))
    }
}
