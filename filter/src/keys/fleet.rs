//! A key's fleet-wide identity, for rules in global scope: the same key has the same id on
//! every proxy of the fleet (unlike a proxy's own key hash, whose seed is each proxy's secret).

use crate::primitives::hash::write_parts;
use siphasher::sip128::{Hasher128, SipHasher13};
use std::hash::Hasher;

/// A key's fleet-wide id: a 128-bit SipHash-1-3 of the rule name and the key's parts, under
/// the fleet's `key_secret` (the same on every proxy, unlike each proxy's own key seed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FleetKey(pub u128);

/// The keys of fleet-wide key hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FleetHasher {
    k0: u64,
    k1: u64,
}

impl FleetHasher {
    /// The hasher of a fleet with `secret` (or of every fleet without one).
    pub fn new(secret: Option<&str>) -> FleetHasher {
        let derive = |salt: u64| {
            let mut h = SipHasher13::new_with_keys(salt, !salt);
            h.write(secret.unwrap_or("").as_bytes());
            h.finish()
        };
        FleetHasher {
            k0: derive(0x666c_6f6f_6467_6174),
            k1: derive(0x6669_656c_645f_6b65),
        }
    }

    /// The fleet-wide id of a key of rule `rule` (its name) with these parts (`None`: missing),
    /// framed as [`crate::keys::KeyHasher::hash`] frames them.
    pub fn hash<'a>(&self, rule: &str, parts: impl IntoIterator<Item = Option<&'a [u8]>>) -> FleetKey {
        let mut h = SipHasher13::new_with_keys(self.k0, self.k1);
        write_parts(&mut h, [Some(rule.as_bytes())]);
        write_parts(&mut h, parts);
        FleetKey(h.finish128().as_u128())
    }
}
