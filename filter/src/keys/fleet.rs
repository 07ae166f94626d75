//! A key's fleet-wide identity, for rules in global scope: the same key has the same id on
//! every proxy of the fleet (unlike a proxy's own key hash, whose seed is each proxy's secret).

use crate::config::{RateLimitRule, Scope};
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

/// A request's fleet-wide keys, one per rule in global scope that applies to it (by rule
/// index): the fleet's side of its probes, which the local limiter's probes leave out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FleetKeys(Vec<(usize, FleetKey)>);

impl FleetKeys {
    /// The key of rule `rule`, if it is in global scope and applies to the request.
    pub fn of(&self, rule: usize) -> Option<FleetKey> {
        self.0.iter().find(|(r, _)| *r == rule).map(|(_, key)| *key)
    }

    /// Keeps rule `index`'s key with these `parts` (as its probe's hash read them), hashed by
    /// `hasher`, when `rule` is in global scope (a key kept before for the rule is replaced).
    pub fn keep(&mut self, hasher: &FleetHasher, index: usize, rule: &RateLimitRule, parts: &mut dyn Iterator<Item = Option<&[u8]>>) {
        if rule.scope != Scope::Global {
            return;
        }
        self.insert(index, hasher.hash(rule.name.as_str(), parts));
    }

    /// Keeps `key` as rule `rule`'s (replacing one kept before).
    pub fn insert(&mut self, rule: usize, key: FleetKey) {
        match self.0.iter_mut().find(|(r, _)| *r == rule) {
            Some(kept) => kept.1 = key,
            None => self.0.push((rule, key)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Every proxy of a fleet writes the Redis counter this id names, whatever its version: the
    /// ids are pinned, and a change here splits a fleet that upgrades proxy by proxy in two.
    #[test]
    fn fleet_ids_are_pinned_across_versions() {
        let id = |secret: Option<&str>, rule: &str, parts: &[Option<&[u8]>]| format!("{:032x}", FleetHasher::new(secret).hash(rule, parts.iter().copied()).0);
        let pinned = [
            id(None, "per-user", &[Some(b"alice")]),
            id(Some("s3cret-of-the-fleet"), "per-user", &[Some(b"alice")]),
            id(None, "per-user", &[Some(b"alice"), None]),
            id(None, "per-user", &[Some(b""), Some(b"alice")]),
            id(None, "tokens", &[]),
        ];
        assert_eq!(
            pinned,
            [
                "63c3129f4c295b1b55af29154cfc6c55",
                "a5b7831be92d7f30d6a4d947f10f4aa7",
                "733940b40f651b0b98fe3bc34d45ef14",
                "975c44794d6b95f0b921c2f248dc7a61",
                "0ed46dc32ebbb6a00b08d7504194720c",
            ]
        );
    }

    #[test]
    fn the_secret_the_rule_and_the_framing_each_change_the_id() {
        let plain = FleetHasher::new(None);
        let alice = plain.hash("r", [Some(&b"alice"[..])]);
        assert_eq!(alice, FleetHasher::new(None).hash("r", [Some(&b"alice"[..])]), "the same on every proxy");
        assert_ne!(alice, FleetHasher::new(Some("x")).hash("r", [Some(&b"alice"[..])]));
        assert_ne!(alice, plain.hash("s", [Some(&b"alice"[..])]));
        assert_ne!(plain.hash("r", [Some(&b"ab"[..]), Some(b"c")]), plain.hash("r", [Some(&b"a"[..]), Some(b"bc")]));
        assert_ne!(plain.hash("r", [None]), plain.hash("r", [Some(&b""[..])]));
    }
}
