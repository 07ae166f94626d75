//! What the rest of a fleet adds to a key's counts in this proxy (a rule in global scope,
//! [`crate::global`]): the other proxies' counts as last synced, and what they likely admitted
//! since, in proportion to what this proxy admitted since its own part was last confirmed.
//!
//! ```text
//! fleet(local) = local + synced + round((local.current − confirmed)⁺ × per_local)
//! ```
//!
//! `per_local` is the other proxies' units per unit of this proxy over the recent syncs of the
//! key ([`crate::global::view`]): with this proxy's share `s` of the key's traffic, `(1 − s)/s`.
//! A request is admitted when `fleet(local + cost)` fits the limit, so near the limit each proxy
//! takes about its share `s` of the room left at its last sync and no more, whatever the others
//! do meanwhile: the shares add up to one, and so do the parts of the room the fleet takes.
//! A proxy scope rule's remote is [`Remote::NONE`]: `fleet(local) = local`.

use super::window::Counts;

/// Fixed-point scale of [`Remote::per_local_q16`].
const ONE_Q16: u64 = 1 << 16;

/// What the other proxies add to a key's local counts, as seen from the current bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Remote {
    /// The other proxies' counts as last synced (and any projection that does not depend on
    /// this proxy's counts).
    pub synced: Counts,
    /// This proxy's part of the current bucket the store has confirmed.
    pub confirmed: u32,
    /// The other proxies' units per unit this proxy admits past `confirmed`, × 2¹⁶.
    pub per_local_q16: u32,
}

impl Remote {
    /// Nothing: a rule in proxy scope, or a key no sync told anything of.
    pub const NONE: Remote = Remote { synced: Counts { previous: 0, current: 0 }, confirmed: 0, per_local_q16: 0 };

    /// Whether it adds nothing to any counts.
    pub fn is_none(&self) -> bool {
        self.synced.is_zero() && self.per_local_q16 == 0
    }

    /// The fleet's counts given this proxy's `local` counts (module doc).
    pub fn fleet(&self, local: Counts) -> Counts {
        let unconfirmed = u64::from(local.current.saturating_sub(self.confirmed));
        let projected = unconfirmed
            .saturating_mul(u64::from(self.per_local_q16))
            .saturating_add(ONE_Q16 / 2)
            .checked_div(ONE_Q16)
            .unwrap_or(0);
        local.sum(self.synced).plus(u32::try_from(projected).unwrap_or(u32::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_others_grow_with_what_this_proxy_admits_past_its_confirmed_part() {
        let remote = Remote { synced: Counts { previous: 10, current: 40 }, confirmed: 20, per_local_q16: 2 << 16 };
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
}
