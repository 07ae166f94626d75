//! The token bucket, as the generic cell rate algorithm (GCRA: ITU-T I.371's virtual scheduling,
//! as the governor crate formulates it): one instant per key, its *theoretical arrival time*
//! (TAT), instead of a level and a refill timestamp.
//!
//! A key refilled at `limit` units per `window` earns one unit every emission interval
//! `T = window / limit` (in microseconds, rounded up: never faster than configured). A bucket
//! of `burst` units lets the TAT run at most `τ = burst × T` ahead of now. A request of `cost`
//! units at `now`:
//!
//! ```text
//! after = max(TAT, now) + cost × T
//! after − now ≤ τ                  → goes now; TAT := after
//! after − now ≤ τ + max_delay      → takes its turn now (TAT := after) and goes at after − τ
//! otherwise                        → refused; the same request goes at after − τ − max_delay
//! ```
//!
//! The bucket's level is `(TAT − now) / T` units (0 when the TAT is past): a full bucket of
//! tokens is a level of 0. A request that waits takes its turn when it arrives, so the requests
//! that go are never more than `burst` at once and `limit` per `window` after that, however
//! many wait; each waiting request goes `T × cost` after the one before it. A request of more
//! than `burst` units never goes.
//!
//! Everything is integer arithmetic on microseconds: the decision and the `Retry-After` drawn
//! from it cannot disagree by rounding.

use super::window::Window;
use crate::primitives::time::UnixMillis;
use std::num::{NonZeroU32, NonZeroU64};

/// Microseconds in a millisecond.
const US_PER_MS: u64 = 1000;

/// An instant in microseconds since the Unix epoch.
pub fn micros(now: UnixMillis) -> u64 {
    now.0.saturating_mul(US_PER_MS)
}

/// The first millisecond at or after `us`.
fn millis_ceil(us: u64) -> UnixMillis {
    UnixMillis(us.div_ceil(US_PER_MS))
}

/// One key's bucket: its emission interval, size and the longest wait for a turn.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// `T`: microseconds per unit.
    interval_us: NonZeroU64,
    /// Units the bucket holds.
    burst: NonZeroU32,
    /// The longest wait for a turn, µs (0: refused at once).
    max_delay_us: u64,
}

/// What the bucket does with a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Turn {
    /// It goes at `at` (now, or its turn within `max_delay`); the key's TAT becomes `tat`.
    Go {
        /// The new TAT, µs.
        tat: u64,
        /// When it goes.
        at: UnixMillis,
    },
    /// Refused: the same request would go at `retry_at` if nothing else arrived (`None`:
    /// never, it costs more than the bucket holds).
    Refuse {
        /// When it would go.
        retry_at: Option<UnixMillis>,
    },
}

impl Bucket {
    /// The bucket of a key of `limit` units per `window`, of `burst` units, waiting at most
    /// `max_delay_ms`.
    pub fn new(window: Window, limit: NonZeroU32, burst: NonZeroU32, max_delay_ms: u64) -> Bucket {
        let window_us = window.length_ms().saturating_mul(US_PER_MS);
        let interval = window_us.div_ceil(u64::from(limit.get()));
        Bucket {
            interval_us: NonZeroU64::new(interval).unwrap_or(NonZeroU64::MIN),
            burst,
            max_delay_us: max_delay_ms.saturating_mul(US_PER_MS),
        }
    }

    /// `T`, µs.
    pub fn interval_us(&self) -> u64 {
        self.interval_us.get()
    }

    /// The bucket's size in units.
    pub fn burst(&self) -> NonZeroU32 {
        self.burst
    }

    /// `τ = burst × T`: how far the TAT may run ahead of now for a request to go at once,
    /// µs; also the time an empty bucket takes to fill.
    pub fn tolerance_us(&self) -> u64 {
        u64::from(self.burst.get()).saturating_mul(self.interval_us.get())
    }

    /// `units × T`, µs.
    pub fn span_us(&self, units: u32) -> u64 {
        u64::from(units).saturating_mul(self.interval_us.get())
    }

    /// A request of `cost` units, admitted when the bucket has room for `needs` (its cost, and
    /// at least one unit), with the key's TAT `tat` (µs; 0 for a key never seen) at `now`.
    pub fn decide(&self, tat: u64, now: UnixMillis, cost: u32, needs: u32) -> Turn {
        let now_us = micros(now);
        let base = tat.max(now_us);
        let checked = base.saturating_add(self.span_us(needs)).saturating_sub(now_us);
        let over = checked.saturating_sub(self.tolerance_us());
        if needs > self.burst.get() {
            return Turn::Refuse { retry_at: None };
        }
        if over > self.max_delay_us {
            let at = now_us.saturating_add(over).saturating_sub(self.max_delay_us);
            return Turn::Refuse { retry_at: Some(millis_ceil(at)) };
        }
        let after = base.saturating_add(self.span_us(cost));
        // The request goes when the bucket has room for what it took (a request whose cost
        // comes later goes when one unit would).
        let wait = after.saturating_sub(now_us).saturating_sub(self.tolerance_us()).min(over);
        Turn::Go { tat: after, at: millis_ceil(now_us.saturating_add(wait)) }
    }

    /// The TAT after charging `units` more without a decision (a cost known after admission).
    pub fn charged(&self, tat: u64, now: UnixMillis, units: u32) -> u64 {
        tat.max(micros(now)).saturating_add(self.span_us(units))
    }

    /// The key's level at `now`: units in the bucket's debt (0 when it is full of tokens).
    pub fn level(&self, tat: u64, now: UnixMillis) -> f64 {
        #[allow(clippy::cast_precision_loss)]
        let level = tat.saturating_sub(micros(now)) as f64 / self.interval_us.get() as f64;
        level
    }

    /// The level rounded up to whole units (the frequency a bounded table compares keys by).
    pub fn units(&self, tat: u64, now: UnixMillis) -> u32 {
        u32::try_from(tat.saturating_sub(micros(now)).div_ceil(self.interval_us.get())).unwrap_or(u32::MAX)
    }

    /// Requests of one unit that would go at once now (the `r` of `RateLimit`).
    pub fn remaining(&self, tat: u64, now: UnixMillis) -> u64 {
        let room = self.tolerance_us().saturating_sub(tat.saturating_sub(micros(now)));
        room.checked_div(self.interval_us.get()).unwrap_or(0)
    }

    /// Milliseconds until the bucket is full again if nothing else arrives (the `t` of
    /// `RateLimit` on an admitted response).
    pub fn ms_until_full(&self, tat: u64, now: UnixMillis) -> u64 {
        tat.saturating_sub(micros(now)).div_ceil(US_PER_MS)
    }

    /// The earliest instant at or after `now` at which a request of `needs` units would go
    /// (at once or after a wait within `max_delay`) if nothing else arrived.
    pub fn earliest_admission(&self, tat: u64, now: UnixMillis, needs: u32) -> Option<UnixMillis> {
        match self.decide(tat, now, needs, needs) {
            Turn::Go { .. } => Some(now),
            Turn::Refuse { retry_at } => retry_at,
        }
    }

    /// The longest time the TAT can run ahead of now through decisions (`τ + max_delay`), µs.
    pub fn horizon_us(&self) -> u64 {
        self.tolerance_us().saturating_add(self.max_delay_us)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing, clippy::panic)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bucket(limit: u32, window_ms: u64, burst: u32, max_delay_ms: u64) -> Bucket {
        Bucket::new(
            Window::new(NonZeroU64::new(window_ms).unwrap()),
            NonZeroU32::new(limit).unwrap(),
            NonZeroU32::new(burst).unwrap(),
            max_delay_ms,
        )
    }

    /// Runs requests of one unit at the given instants; returns each one's turn.
    fn run(b: &Bucket, at: &[u64]) -> Vec<Turn> {
        let mut tat = 0;
        at.iter()
            .map(|&ms| {
                let turn = b.decide(tat, UnixMillis(ms), 1, 1);
                if let Turn::Go { tat: next, .. } = turn {
                    tat = next;
                }
                turn
            })
            .collect()
    }

    fn goes_now(turn: &Turn, now: u64) -> bool {
        matches!(turn, Turn::Go { at, .. } if at.0 == now)
    }

    #[test]
    fn a_full_bucket_lets_its_burst_through_then_the_rate() {
        // 10 per second, burst 5: 40 requests at once admit 5.
        let b = bucket(10, 1000, 5, 0);
        let now = 1_000_000;
        let turns = run(&b, &[now; 40]);
        assert_eq!(turns.iter().filter(|t| goes_now(t, now)).count(), 5);
        // The sixth request at once would go 100 ms later: that is its retry_at.
        assert_eq!(turns[5], Turn::Refuse { retry_at: Some(UnixMillis(now + 100)) });
        // One unit every 100 ms after that.
        let mut tat = micros(UnixMillis(now + 500));
        for step in 1..=20u64 {
            let at = UnixMillis(now + step * 100);
            let Turn::Go { tat: next, .. } = b.decide(tat, at, 1, 1) else { panic!("refused at {step}") };
            assert_eq!(b.decide(next, at, 1, 1), Turn::Refuse { retry_at: Some(UnixMillis(at.0 + 100)) });
            tat = next;
        }
    }

    #[test]
    fn retry_at_is_exact_to_the_millisecond() {
        let b = bucket(3, 1000, 2, 0);
        let now = UnixMillis(5_000);
        let mut tat = 0;
        for _ in 0..2 {
            let Turn::Go { tat: next, .. } = b.decide(tat, now, 1, 1) else { panic!() };
            tat = next;
        }
        let Turn::Refuse { retry_at: Some(at) } = b.decide(tat, now, 1, 1) else { panic!() };
        // T = 333 334 µs: the third unit is earned 333.334 ms later, i.e. at the 334th ms.
        assert_eq!(at, UnixMillis(5_334));
        assert!(matches!(b.decide(tat, UnixMillis(at.0 - 1), 1, 1), Turn::Refuse { .. }));
        assert!(matches!(b.decide(tat, at, 1, 1), Turn::Go { .. }));
    }

    #[test]
    fn waiting_requests_take_their_turns_at_the_rate() {
        // 10 per second, burst 5, waits up to 3 s: 30 requests at once all go, 5 now and one
        // every 100 ms after.
        let b = bucket(10, 1000, 5, 3000);
        let now = 2_000_000;
        let turns = run(&b, &[now; 30]);
        for (i, turn) in turns.iter().enumerate() {
            let expected = now + (i as u64).saturating_sub(4) * 100;
            assert!(matches!(turn, Turn::Go { at, .. } if at.0 == expected), "{i}: {turn:?}");
        }
        // Half a second of patience: 5 go now, 5 wait, the rest are refused with the instant
        // they would be let in to wait.
        let b = bucket(10, 1000, 5, 500);
        let turns = run(&b, &[now; 30]);
        assert_eq!(turns.iter().filter(|t| matches!(t, Turn::Go { .. })).count(), 10);
        assert_eq!(turns[10], Turn::Refuse { retry_at: Some(UnixMillis(now + 100)) });
        assert_eq!(turns[29], Turn::Refuse { retry_at: Some(UnixMillis(now + 100)) });
    }

    #[test]
    fn costs_take_their_units_and_a_cost_above_the_burst_never_goes() {
        let b = bucket(10, 1000, 5, 0);
        let now = UnixMillis(10_000);
        let Turn::Go { tat, .. } = b.decide(0, now, 3, 3) else { panic!() };
        assert_eq!(b.remaining(tat, now), 2);
        assert_eq!(b.decide(tat, now, 3, 3), Turn::Refuse { retry_at: Some(UnixMillis(10_100)) });
        assert_eq!(b.decide(0, now, 6, 6), Turn::Refuse { retry_at: None });
        // A cost charged later: admission needs one unit, the TAT moves by the charge.
        let Turn::Go { tat: zero, .. } = b.decide(0, now, 0, 1) else { panic!() };
        assert_eq!(zero, micros(now));
        assert_eq!(b.charged(zero, now, 4), micros(now) + 400_000);
        assert_eq!(b.ms_until_full(micros(now) + 400_000, now), 400);
    }

    proptest! {
        /// Whatever the arrivals, in any interval the requests that go (at their turn) are at
        /// most `burst` plus the rate times its length, and a refused request would go at its
        /// retry_at and not a millisecond earlier.
        #[test]
        fn never_more_than_the_burst_and_the_rate(
            limit in 1u32..20,
            window in 100u64..3000,
            burst in 1u32..10,
            delay in prop_oneof![Just(0u64), 1u64..2000],
            gaps in proptest::collection::vec(0u64..200, 1..200),
        ) {
            let b = bucket(limit, window, burst, delay);
            let mut now = 1_000_000u64;
            let mut tat = 0;
            let mut went = Vec::new();
            for gap in gaps {
                now += gap;
                match b.decide(tat, UnixMillis(now), 1, 1) {
                    Turn::Go { tat: next, at } => {
                        prop_assert!(at.0 >= now && at.0 - now <= delay);
                        tat = next;
                        went.push(at.0);
                    }
                    Turn::Refuse { retry_at } => {
                        let at = retry_at.unwrap();
                        prop_assert!(at.0 > now);
                        let on_time = matches!(b.decide(tat, at, 1, 1), Turn::Go { .. });
                        let early = matches!(b.decide(tat, UnixMillis(at.0 - 1), 1, 1), Turn::Refuse { .. });
                        prop_assert!(on_time && early, "retry_at {:?} is not tight", at);
                    }
                }
            }
            went.sort_unstable();
            for (i, &start) in went.iter().enumerate() {
                for (j, &end) in went.iter().enumerate().skip(i) {
                    let count = (j - i + 1) as u64;
                    // Units earned over [start, end] (turns are rounded up to the millisecond).
                    let earned = (end - start + 1) * u64::from(limit) / window;
                    prop_assert!(count <= u64::from(burst) + earned,
                        "{} went in [{}, {}] with burst {} and {} earned", count, start, end, burst, earned);
                }
            }
        }
    }
}
