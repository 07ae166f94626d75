//! What the rest of a fleet adds to a key's counts in this proxy, for a rule in batched global
//! scope ([`crate::fleet::batched`]): the other proxies' counts as last synced, what the store had
//! not seen of them at that sync, and what they likely admitted since, in proportion to what this
//! proxy admitted since its own part was last confirmed:
//!
//! ```text
//! fleet(local) = local + synced + unseen + round((local.current − confirmed)⁺ × per_local)
//! ```
//!
//! `per_local` is `(1 − s)/s` for this proxy's share `s` of the key's traffic
//! ([`crate::fleet::batched::view`]), so near the limit each proxy takes about its share of the
//! room.
//!
//! Invariant: the projections count until `projected_until` and no longer, so the estimate at a
//! later time is known now and [`Remote::earliest_admission`] answers on it. A proxy-scope rule's
//! remote is [`Remote::NONE`]: `fleet(local) = local`.
//!
//! Rationale: docs/design.md, section "Batched consistency".

use super::window::{Counts, Window};
use crate::primitives::time::UnixMillis;
use std::num::NonZeroU32;

/// Fixed-point scale of [`Remote::per_local_q16`].
const ONE_Q16: u64 = 1 << 16;

/// What the other proxies add to a key's local counts, as seen from the current bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Remote {
    /// The other proxies' counts as last synced.
    pub synced: Counts,
    /// This proxy's part of the current bucket the store has confirmed.
    pub confirmed: u32,
    /// What they had admitted before the last sync that the store had not seen yet, added to
    /// the current bucket (a projection).
    pub unseen: u32,
    /// The other proxies' units per unit this proxy admits past `confirmed`, × 2¹⁶ (a
    /// projection).
    pub per_local_q16: u32,
    /// The last millisecond the projections count.
    pub projected_until: UnixMillis,
}

impl Remote {
    /// Nothing: a rule in proxy scope, or a key no sync told anything of.
    pub const NONE: Remote =
        Remote { synced: Counts { previous: 0, current: 0 }, confirmed: 0, unseen: 0, per_local_q16: 0, projected_until: UnixMillis(0) };

    /// Whether it adds nothing to any counts.
    pub fn is_none(&self) -> bool {
        self.synced.is_zero() && !self.projects()
    }

    /// Whether it adds anything to the synced counts.
    fn projects(&self) -> bool {
        self.unseen > 0 || self.per_local_q16 > 0
    }

    /// The fleet's counts given this proxy's `local` counts (module doc).
    pub fn fleet(&self, local: Counts) -> Counts {
        let unconfirmed = u64::from(local.current.saturating_sub(self.confirmed));
        let projected = unconfirmed
            .saturating_mul(u64::from(self.per_local_q16))
            .saturating_add(ONE_Q16 / 2)
            .checked_div(ONE_Q16)
            .unwrap_or(0);
        local.sum(self.synced).plus(self.unseen).plus(u32::try_from(projected).unwrap_or(u32::MAX))
    }

    /// As seen from bucket `to`, read in bucket `from`: the synced counts and this proxy's
    /// confirmed part roll as counts do; the projections stay in the current bucket.
    fn rolled(self, from: u64, to: u64) -> Remote {
        Remote {
            synced: self.synced.rolled(from, to),
            confirmed: Counts { previous: 0, current: self.confirmed }.rolled(from, to).current,
            ..self
        }
    }

    /// The earliest instant at or after `now` at which a request of `cost` is admitted with this
    /// proxy's `local` counts (as of `now`'s bucket), if nothing else arrives: until
    /// `projected_until`, `fleet(local + cost)` must fit (in the current bucket, the next, and
    /// the one after, which stands for every later one: the same counts); after it, the synced
    /// counts alone. `None` when it never would (`cost > limit`).
    pub fn earliest_admission(&self, window: Window, local: Counts, now: UnixMillis, cost: u32, limit: NonZeroU32) -> Option<UnixMillis> {
        let bucket = window.phase(now).bucket_index;
        if self.projects() {
            let settles = self.projected_until.plus_ms(1);
            let w = window.length_ms();
            for ahead in 0..=2u64 {
                let at = bucket.saturating_add(ahead);
                let start = if ahead == 0 { now } else { UnixMillis(at.saturating_mul(w)) };
                if start >= settles {
                    break;
                }
                // Two buckets ahead and later the counts no longer change: at its start, or not
                // before the projections stop.
                let end = if ahead == 2 { start.plus_ms(1) } else { UnixMillis(at.saturating_add(1).saturating_mul(w)) }.min(settles);
                let counts = self.rolled(bucket, at).fleet(local.rolled(bucket, at).plus(cost));
                if let Some(admitted) = window.earliest_admission(counts, start, 0, limit).filter(|t| *t < end) {
                    return Some(admitted);
                }
            }
            let from = settles.max(now);
            let to = window.phase(from).bucket_index;
            let settled = Remote { unseen: 0, per_local_q16: 0, ..self.rolled(bucket, to) };
            return window.earliest_admission(settled.fleet(local.rolled(bucket, to)), from, cost, limit);
        }
        window.earliest_admission(self.fleet(local), now, cost, limit)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use std::num::NonZeroU64;

    #[test]
    fn the_others_grow_with_what_this_proxy_admits_past_its_confirmed_part() {
        let remote = Remote { synced: Counts { previous: 10, current: 40 }, confirmed: 20, per_local_q16: 2 << 16, ..Remote::NONE };
        // Nothing past the confirmed part: the synced counts alone.
        assert_eq!(remote.fleet(Counts { previous: 5, current: 20 }), Counts { previous: 15, current: 60 });
        // 3 units past it: the others likely admitted 6 meanwhile.
        assert_eq!(remote.fleet(Counts { previous: 5, current: 23 }), Counts { previous: 15, current: 69 });
        assert_eq!(Remote::NONE.fleet(Counts { previous: 1, current: 2 }), Counts { previous: 1, current: 2 });
        assert!(Remote::NONE.is_none() && !remote.is_none());
        // Saturates instead of wrapping.
        let huge = Remote { per_local_q16: u32::MAX, ..remote };
        assert_eq!(huge.fleet(Counts { previous: 0, current: u32::MAX }).current, u32::MAX);
    }

    #[test]
    fn a_refusal_on_projections_is_told_when_they_stop_counting() {
        let window = Window::new(NonZeroU64::new(3_600_000).unwrap());
        let limit = NonZeroU32::new(100).unwrap();
        let now = UnixMillis(1_700_000_100_000);
        // 81 units synced, 19 of room; 64 of the others' units per unit of this proxy, 8 unseen.
        let remote = Remote {
            synced: Counts { previous: 0, current: 80 },
            confirmed: 1,
            unseen: 8,
            per_local_q16: 64 << 16,
            projected_until: now.plus_ms(250),
        };
        let local = Counts { previous: 0, current: 1 };
        assert!(!window.fits(remote.fleet(local.plus(19)), window.phase(now).elapsed_ms, limit));
        // The counts as synced hold 19 more: admitted the millisecond the projections stop.
        assert_eq!(remote.earliest_admission(window, local, now, 19, limit), Some(now.plus_ms(251)));
        assert_eq!(remote.earliest_admission(window, local, now, 10, limit), Some(now.plus_ms(251)));
        // Where the projections leave room for the request, now.
        let room = Remote { per_local_q16: 1 << 15, ..remote };
        assert_eq!(room.earliest_admission(window, local, now, 6, limit), Some(now));
        // Never, for a cost above the limit.
        assert_eq!(remote.earliest_admission(window, local, now, 101, limit), None);
    }
}
