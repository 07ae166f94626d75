//! The sliding-window counter: buckets one window long, aligned to multiples of the window since
//! the Unix epoch; a key keeps the previous and the current bucket's counters, and at `now`, with
//! `elapsed` the time since the current bucket began and `w` the window,
//!
//! ```text
//! estimate = previous × (1 − elapsed / w) + current
//! ```
//!
//! A request of `cost` is admitted when `estimate + cost ≤ limit`.
//!
//! Invariant: the comparison is exact in integers,
//!
//! ```text
//! previous × (w − elapsed) + (current + cost) × w ≤ limit × w
//! ```
//!
//! so the decision and the `Retry-After` computed from it never disagree by rounding.
//!
//! Rationale: docs/design.md, section "Sliding window counter" (Cloudflare's sliding-window
//! counter; pingora-limits' `PROPORTIONAL_RATE_ESTIMATE_CALC_FN`).

use crate::primitives::time::UnixMillis;
use std::num::{NonZeroU32, NonZeroU64};

/// The two counters of one key, as of the bucket `bucket_index` (ms since epoch / window).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Requests counted in the bucket before `bucket_index`.
    pub previous: u32,
    /// Requests counted in bucket `bucket_index`.
    pub current: u32,
}

impl Counts {
    /// The counters as seen from bucket `to`, given they were last written in bucket `from`:
    /// one step shifts current into previous, two or more steps clear both. A bucket from the
    /// future (the wall clock stepped back) is read as it is, so nothing is forgotten.
    pub fn rolled(self, from: u64, to: u64) -> Counts {
        match to.checked_sub(from) {
            None | Some(0) => self,
            Some(1) => Counts {
                previous: self.current,
                current: 0,
            },
            Some(_) => Counts::default(),
        }
    }

    /// Componentwise maximum.
    pub fn max(self, other: Counts) -> Counts {
        Counts {
            previous: self.previous.max(other.previous),
            current: self.current.max(other.current),
        }
    }

    /// Adds `cost` to the current bucket, saturating (which only ever makes a limit stricter).
    pub fn plus(self, cost: u32) -> Counts {
        Counts {
            previous: self.previous,
            current: self.current.saturating_add(cost),
        }
    }

    /// True when both counters are zero.
    pub fn is_zero(self) -> bool {
        self.previous == 0 && self.current == 0
    }

    /// Componentwise sum, saturating.
    pub fn sum(self, other: Counts) -> Counts {
        Counts {
            previous: self.previous.saturating_add(other.previous),
            current: self.current.saturating_add(other.current),
        }
    }
}

/// A window length and the arithmetic of the sliding estimate over it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    length_ms: NonZeroU64,
}

/// Where `now` falls: which bucket, and how far into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Phase {
    /// The bucket `now` is in (ms since epoch / window).
    pub bucket_index: u64,
    /// Milliseconds since that bucket began, `0 ≤ elapsed_ms < window`.
    pub elapsed_ms: u64,
}

impl Window {
    /// A window `length_ms` long.
    pub fn new(length_ms: NonZeroU64) -> Window {
        Window { length_ms }
    }

    /// The window length in milliseconds.
    pub fn length_ms(self) -> u64 {
        self.length_ms.get()
    }

    /// The bucket `now` falls in and the time since it began.
    pub fn phase(self, now: UnixMillis) -> Phase {
        Phase {
            bucket_index: now.0 / self.length_ms,
            elapsed_ms: now.0 % self.length_ms,
        }
    }

    /// `estimate × window` in integers: `previous × (w − elapsed) + current × w`.
    pub fn scaled_estimate(self, counts: Counts, elapsed_ms: u64) -> u128 {
        let w = u128::from(self.length_ms.get());
        let remaining = w.saturating_sub(u128::from(elapsed_ms));
        u128::from(counts.previous)
            .saturating_mul(remaining)
            .saturating_add(u128::from(counts.current).saturating_mul(w))
    }

    /// The estimate as a number, for responses and logs.
    pub fn estimate(self, counts: Counts, elapsed_ms: u64) -> f64 {
        // Precision loss is irrelevant here: the decision uses `scaled_estimate`.
        #[allow(clippy::cast_precision_loss)]
        let value = self.scaled_estimate(counts, elapsed_ms) as f64 / self.length_ms.get() as f64;
        value
    }

    /// Whether a request of `cost` is admitted with `counts` (as of `now`'s bucket).
    pub fn admits(self, counts: Counts, elapsed_ms: u64, cost: u32, limit: NonZeroU32) -> bool {
        let w = u128::from(self.length_ms.get());
        let with_cost = self.scaled_estimate(counts.plus(cost), elapsed_ms);
        with_cost <= u128::from(limit.get()).saturating_mul(w)
    }

    /// Whether `counts` (a request already counted in them) are within the limit.
    pub fn fits(self, counts: Counts, elapsed_ms: u64, limit: NonZeroU32) -> bool {
        let w = u128::from(self.length_ms.get());
        self.scaled_estimate(counts, elapsed_ms) <= u128::from(limit.get()).saturating_mul(w)
    }

    /// How many more requests of cost 1 would be admitted now (the `r` of `RateLimit`).
    pub fn remaining(self, counts: Counts, elapsed_ms: u64, limit: NonZeroU32) -> u64 {
        let w = u128::from(self.length_ms.get());
        let room = u128::from(limit.get())
            .saturating_mul(w)
            .saturating_sub(self.scaled_estimate(counts, elapsed_ms));
        u64::try_from(room.checked_div(w).unwrap_or(0)).unwrap_or(u64::MAX)
    }

    /// The earliest instant at or after `now` at which a request of `cost` would be admitted
    /// if nothing else arrived, given `counts` as of `now`'s bucket; `None` when it never would
    /// (`cost > limit`).
    ///
    /// Within a bucket the estimate only falls as time passes, and at a bucket boundary it is
    /// continuous (previous × 0 + current becomes current × 1 + 0), so the answer is the first
    /// millisecond where the integer inequality of [`Window::admits`] holds: solved in closed
    /// form, first in the current bucket, then the next, then the one after (empty).
    pub fn earliest_admission(
        self,
        counts: Counts,
        now: UnixMillis,
        cost: u32,
        limit: NonZeroU32,
    ) -> Option<UnixMillis> {
        if cost > limit.get() {
            return None;
        }
        let phase = self.phase(now);
        if self.admits(counts, phase.elapsed_ms, cost, limit) {
            return Some(now);
        }
        let w = self.length_ms.get();
        let bucket_start = now.0.saturating_sub(phase.elapsed_ms);
        // Room left for the decaying previous bucket: (limit − cost − current) × w.
        let first_admitted_elapsed = |previous: u32, current: u32| -> Option<u64> {
            let headroom = u64::from(limit.get())
                .checked_sub(u64::from(cost))?
                .checked_sub(u64::from(current))?;
            let room = u128::from(headroom).saturating_mul(u128::from(w));
            if previous == 0 {
                return Some(0);
            }
            // previous × (w − e) ≤ room  ⇔  e ≥ w − ⌊room / previous⌋
            let span = room.checked_div(u128::from(previous))?;
            let elapsed = u128::from(w).saturating_sub(span);
            u64::try_from(elapsed).ok().filter(|e| *e < w)
        };
        if let Some(elapsed) = first_admitted_elapsed(counts.previous, counts.current) {
            if elapsed > phase.elapsed_ms {
                return Some(UnixMillis(bucket_start.saturating_add(elapsed)));
            }
        }
        let next_start = bucket_start.saturating_add(w);
        if let Some(elapsed) = first_admitted_elapsed(counts.current, 0) {
            return Some(UnixMillis(next_start.saturating_add(elapsed)));
        }
        Some(UnixMillis(next_start.saturating_add(w)))
    }

    /// Milliseconds until the estimate is back to zero if nothing else arrives (the `t` of
    /// `RateLimit` on an admitted response).
    pub fn ms_until_reset(self, counts: Counts, now: UnixMillis) -> u64 {
        let phase = self.phase(now);
        let to_next = self.length_ms.get().saturating_sub(phase.elapsed_ms);
        if counts.current > 0 {
            to_next.saturating_add(self.length_ms.get())
        } else if counts.previous > 0 {
            to_next
        } else {
            0
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn window(ms: u64) -> Window {
        Window::new(NonZeroU64::new(ms).unwrap())
    }
    fn limit(n: u32) -> NonZeroU32 {
        NonZeroU32::new(n).unwrap()
    }

    #[test]
    fn estimate_weights_the_previous_bucket_by_its_overlap() {
        let w = window(60_000);
        let counts = Counts { previous: 84, current: 36 };
        // Cloudflare's example: 15 s into the minute, 84 × 0.75 + 36 = 99.
        assert_eq!(w.estimate(counts, 15_000), 99.0);
        assert!(w.admits(counts, 15_000, 1, limit(100)));
        assert!(!w.admits(counts, 15_000, 2, limit(100)));
        assert_eq!(w.remaining(counts, 15_000, limit(100)), 1);
    }

    #[test]
    fn buckets_roll_over_one_step_at_a_time() {
        let counts = Counts { previous: 3, current: 7 };
        assert_eq!(counts.rolled(5, 5), counts);
        assert_eq!(counts.rolled(5, 6), Counts { previous: 7, current: 0 });
        assert_eq!(counts.rolled(5, 7), Counts::default());
        assert_eq!(counts.rolled(6, 5), counts, "a clock step back forgets nothing");
    }

    #[test]
    fn phase_is_aligned_to_the_epoch() {
        let w = window(4000);
        assert_eq!(w.phase(UnixMillis(8_001)), Phase { bucket_index: 2, elapsed_ms: 1 });
        assert_eq!(w.phase(UnixMillis(7_999)), Phase { bucket_index: 1, elapsed_ms: 3_999 });
    }

    #[test]
    fn earliest_admission_in_the_next_bucket() {
        // 4 s window, limit 4, four requests 300 ms into bucket 10: the next request fits once
        // 4 × (1 − e/4000) ≤ 3, i.e. 1000 ms into bucket 11.
        let w = window(4000);
        let counts = Counts { previous: 0, current: 4 };
        let now = UnixMillis(40_300);
        assert_eq!(w.earliest_admission(counts, now, 1, limit(4)), Some(UnixMillis(45_000)));
        assert_eq!(w.ms_until_reset(counts, now), 7_700);
    }

    #[test]
    fn earliest_admission_within_the_current_bucket() {
        let w = window(10_000);
        let counts = Counts { previous: 10, current: 5 };
        // 10 × (1 − e/10000) + 5 + 1 ≤ 10  ⇔  e ≥ 6000.
        let now = UnixMillis(1_002_000);
        assert_eq!(w.earliest_admission(counts, now, 1, limit(10)), Some(UnixMillis(1_006_000)));
    }

    #[test]
    fn cost_above_the_limit_is_never_admitted() {
        assert_eq!(window(1000).earliest_admission(Counts::default(), UnixMillis(0), 3, limit(2)), None);
    }

    /// The reference: step millisecond by millisecond with the plain `admits` check.
    fn brute_force_earliest(w: Window, counts: Counts, now: UnixMillis, limit: NonZeroU32) -> UnixMillis {
        let start = w.phase(now).bucket_index;
        let mut t = now;
        loop {
            let phase = w.phase(t);
            let rolled = counts.rolled(start, phase.bucket_index);
            if w.admits(rolled, phase.elapsed_ms, 1, limit) {
                return t;
            }
            t = t.plus_ms(1);
        }
    }

    proptest! {
        #[test]
        fn earliest_admission_matches_brute_force(
            length in 1u64..3000,
            limit_value in 1u32..50,
            previous in 0u32..80,
            current in 0u32..80,
            now in 0u64..1_000_000,
        ) {
            let w = window(length);
            let counts = Counts { previous, current };
            let now = UnixMillis(now);
            let lim = limit(limit_value);
            let fast = w.earliest_admission(counts, now, 1, lim).unwrap();
            prop_assert_eq!(fast, brute_force_earliest(w, counts, now, lim));
        }

        #[test]
        fn estimate_matches_the_real_valued_formula(
            length in 1u64..100_000,
            previous in 0u32..100_000,
            current in 0u32..100_000,
            elapsed_fraction in 0.0f64..1.0,
        ) {
            let w = window(length);
            let elapsed = ((length as f64) * elapsed_fraction) as u64 % length;
            let reference = previous as f64 * (1.0 - elapsed as f64 / length as f64) + current as f64;
            let ours = w.estimate(Counts { previous, current }, elapsed);
            prop_assert!((ours - reference).abs() <= 1e-6 * reference.max(1.0));
        }
    }
}
