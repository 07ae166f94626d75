//! Rate-limit keys: which request attributes make a key, and the keyed hash that places it.
//!
//! The hash is SipHash-1-3 under a secret 128-bit seed that every worker shares (drawn once per
//! proxy from `getrandom` and kept in shared data), so a client cannot choose keys that collide
//! with somebody else's. Parts are length-prefixed, so `("ab", "c")` and `("a", "bc")` differ,
//! and a missing part hashes differently from an empty one.
//!
//! Rationale: docs/design.md, section "The bounded key table".

pub mod fleet;

use crate::config::KeyPart;
use crate::primitives::hash::write_parts;
use crate::primitives::store::{update, Attempt, SharedStore, StoreError};
use siphasher::sip::SipHasher13;
use std::hash::Hasher;

/// The secret key-hash seed every worker of this proxy shares under `namespace`: drawn once
/// (`draw`, the host's `getrandom`) by whichever VM configures first, and read by all others. A
/// record of the wrong length (corrupt, or from another version) is replaced, with a
/// compare-and-swap, by a fresh seed.
pub fn shared_seed(store: &dyn SharedStore, namespace: &str, draw: impl Fn(&mut [u8; 16]) -> Result<(), String>) -> Result<[u8; 16], String> {
    let key = format!("floodgate/{namespace}/seed");
    let seed = update(store, &key, |current| {
        if let Some(seed) = current.and_then(|s| <[u8; 16]>::try_from(s.value.as_slice()).ok()) {
            return Attempt::Done(Ok(seed));
        }
        let mut seed = [0u8; 16];
        match draw(&mut seed) {
            Ok(()) => Attempt::Write(seed, Ok(seed)),
            Err(e) => Attempt::Done(Err(e)),
        }
    });
    match seed {
        Ok(seed) => seed,
        Err(StoreError::CasMismatch) => Err(format!("shared key {key} could not be created")),
        Err(err) => Err(err.to_string()),
    }
}

/// The attribute a key part reads from the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source<'a> {
    /// A request header (lower-case name; pseudo-headers like `:path` included).
    Header(&'a str),
    /// The downstream peer address (`source.address`, with its port).
    SourceAddress,
}

impl KeyPart {
    /// Where this part comes from.
    pub fn source(&self) -> Source<'_> {
        match self {
            KeyPart::Header(name) => Source::Header(name),
            KeyPart::SourceIp => Source::SourceAddress,
            KeyPart::Path => Source::Header(":path"),
            KeyPart::Method => Source::Header(":method"),
            KeyPart::Authority => Source::Header(":authority"),
        }
    }

    /// The part of the raw attribute that makes the key: the address without its port, the
    /// path without its query; other parts whole.
    pub fn normalize<'v>(&self, raw: &'v [u8]) -> &'v [u8] {
        match self {
            KeyPart::SourceIp => strip_port(raw),
            KeyPart::Path => raw.split(|b| *b == b'?').next().unwrap_or(raw),
            _ => raw,
        }
    }
}

/// `1.2.3.4:80` → `1.2.3.4`, `[::1]:80` → `::1`; anything else (a bare IPv6 address, a pipe
/// path) is returned whole.
pub fn strip_port(address: &[u8]) -> &[u8] {
    if let Some(rest) = address.strip_prefix(b"[") {
        if let Some(end) = rest.iter().position(|b| *b == b']') {
            return rest.get(..end).unwrap_or(rest);
        }
        return address;
    }
    let colons = address.iter().filter(|b| **b == b':').count();
    match (colons, address.iter().rposition(|b| *b == b':')) {
        (1, Some(at)) => address.get(..at).unwrap_or(address),
        _ => address,
    }
}

/// The keyed hash of rate-limit keys.
#[derive(Clone, Debug)]
pub struct KeyHasher {
    k0: u64,
    k1: u64,
}

impl KeyHasher {
    /// A hasher under a 128-bit secret seed.
    pub fn new(seed: [u8; 16]) -> KeyHasher {
        let mut k0 = [0u8; 8];
        let mut k1 = [0u8; 8];
        let (low, high) = seed.split_at(8);
        k0.copy_from_slice(low);
        k1.copy_from_slice(high);
        KeyHasher {
            k0: u64::from_le_bytes(k0),
            k1: u64::from_le_bytes(k1),
        }
    }

    /// Hashes the parts of a key in order (`None` for a missing part).
    pub fn hash<'a>(&self, parts: impl IntoIterator<Item = Option<&'a [u8]>>) -> u64 {
        let mut hasher = SipHasher13::new_with_keys(self.k0, self.k1);
        write_parts(&mut hasher, parts);
        hasher.finish()
    }
}

/// The keyed hash of one key (`parts` in order) from the request's attributes, as
/// [`crate::ratelimit::probes`] computes a rule's; `None` when a part is missing.
pub fn hash_key<V: AsRef<[u8]>>(parts: &[KeyPart], hasher: &KeyHasher, mut fetch: impl FnMut(Source<'_>) -> Option<V>) -> Option<u64> {
    let values: Vec<V> = parts.iter().map(|part| fetch(part.source())).collect::<Option<_>>()?;
    Some(hasher.hash(parts.iter().zip(&values).map(|(part, value)| Some(part.normalize(value.as_ref())))))
}


#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_is_drawn_once_per_proxy_and_a_bad_record_is_replaced() {
        use crate::primitives::store::MemoryStore;
        let store = MemoryStore::new();
        let draws = std::cell::Cell::new(0u8);
        let draw = |seed: &mut [u8; 16]| {
            draws.set(draws.get() + 1);
            *seed = [draws.get(); 16];
            Ok(())
        };
        assert_eq!(shared_seed(&store, "ns", draw), Ok([1; 16]), "the first VM draws it");
        assert_eq!(shared_seed(&store, "ns", draw), Ok([1; 16]), "every other VM reads it");
        assert_eq!(draws.get(), 1);
        assert_eq!(shared_seed(&store, "other", draw), Ok([2; 16]), "a namespace of its own");
        store.set("floodgate/ns/seed", b"short", None).unwrap();
        assert_eq!(shared_seed(&store, "ns", draw), Ok([3; 16]), "a record of the wrong length is replaced");
        assert_eq!(shared_seed(&store, "ns", draw), Ok([3; 16]));
        let failed = shared_seed(&MemoryStore::new(), "ns", |_| Err("getrandom: unavailable".to_owned()));
        assert_eq!(failed, Err("getrandom: unavailable".to_owned()), "no seed without the host's random source");
    }

    #[test]
    fn ports_are_stripped_from_both_address_families() {
        assert_eq!(strip_port(b"10.0.0.1:4242"), b"10.0.0.1");
        assert_eq!(strip_port(b"[2001:db8::1]:443"), b"2001:db8::1");
        assert_eq!(strip_port(b"2001:db8::1"), b"2001:db8::1");
        assert_eq!(strip_port(b"[broken"), b"[broken");
        assert_eq!(strip_port(b""), b"");
        assert_eq!(strip_port(b"/var/run/sock"), b"/var/run/sock");
    }

    #[test]
    fn paths_lose_their_query_only() {
        assert_eq!(KeyPart::Path.normalize(b"/a/b?x=1?y"), b"/a/b");
        assert_eq!(KeyPart::Path.normalize(b"?"), b"");
        assert_eq!(KeyPart::Method.normalize(b"GET?"), b"GET?");
    }

    #[test]
    fn framing_separates_parts_and_missing_from_empty() {
        let hasher = KeyHasher::new([7; 16]);
        let h = |parts: &[Option<&[u8]>]| hasher.hash(parts.iter().copied());
        assert_ne!(h(&[Some(b"ab"), Some(b"c")]), h(&[Some(b"a"), Some(b"bc")]));
        assert_ne!(h(&[None]), h(&[Some(b"")]));
        assert_eq!(h(&[Some(b"x")]), h(&[Some(b"x")]));
    }

    #[test]
    fn the_seed_changes_every_hash() {
        let a = KeyHasher::new([1; 16]).hash([Some(&b"client"[..])]);
        let b = KeyHasher::new([2; 16]).hash([Some(&b"client"[..])]);
        assert_ne!(a, b);
    }
}
