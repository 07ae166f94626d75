//! The filter's hashes and its random source, each written once: FNV-1a (stable digests of a
//! configuration, in shared-data key names and records), SplitMix64's finalizer (spreads a
//! hash's bits) and the generator built on it, shuffle sharding's [`deal`] of a stable hand
//! from a hash, the multiply-rotate mix of [`MixMap`], and how a key's parts are framed for the
//! keyed SipHash of [`crate::keys`].
//!
//! Their outputs name and place records in shared data and on the fleet's store, so they are
//! fixed: the same input gives the same bits in every build.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// FNV-1a's 64-bit offset basis: the seed of a digest that has none of its own.
pub const FNV1A_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const FNV1A_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a, 64-bit, of `bytes` from `seed` ([`FNV1A_BASIS`], or a previous digest to draw
/// another): a stable, non-secret digest.
pub fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    bytes.iter().fold(seed, |hash, byte| (hash ^ u64::from(*byte)).wrapping_mul(FNV1A_PRIME))
}

/// The golden-ratio increment of SplitMix64 (2⁶⁴ / φ, odd).
pub const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's finalizer: every output bit depends on every input bit.
pub fn mix64(mut h: u64) -> u64 {
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// A source of uniform random bits (injected, so tests are deterministic).
pub trait Random {
    /// 64 uniform random bits.
    fn next_u64(&mut self) -> u64;

    /// A uniform number in [0, 1).
    fn next_unit(&mut self) -> f64 {
        // The top 53 bits make an exact double in [0, 1).
        #[allow(clippy::cast_precision_loss)]
        let unit = (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        unit
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast, and statistically sound for sampling; each
/// VM seeds its own from `getrandom`.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator from a seed.
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }
}

impl Random for SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN_GAMMA);
        mix64(self.0)
    }
}

/// Shuffle sharding's deal: moves to the front of `items` a hand of `size` of them (all of them if
/// fewer), the first `size` steps of a Fisher–Yates shuffle driven by a [`SplitMix64`] seeded
/// with `seed` (a key's hash). Every one of the `C(n, size)` hands is equally likely, and a seed
/// always deals the same hand in the same order; the items not dealt follow, in no set order.
pub fn deal<T>(seed: u64, items: &mut [T], size: usize) {
    let mut rng = SplitMix64::new(seed);
    let len = items.len();
    for i in 0..size.min(len) {
        let remaining = u64::try_from(len.saturating_sub(i)).unwrap_or(1).max(1);
        // Uniform in [i, n): rejection-free multiply-shift is uniform enough for n ≤ 2¹⁶
        // (bias below 2⁻⁴⁸).
        let offset = usize::try_from(u128::from(rng.next_u64()).saturating_mul(u128::from(remaining)) >> 64).unwrap_or(0);
        items.swap(i, i.saturating_add(offset));
    }
}

/// A hash map over values that are already keyed hashes (a key's fingerprint, a rule's id):
/// [`MixHasher`] mixes them instead of hashing them again with SipHash, which the standard
/// map's default would do on every lookup of the request path.
pub type MixMap<K, V> = HashMap<K, V, BuildHasherDefault<MixHasher>>;

/// The hasher of [`MixMap`]: a multiply-rotate mix of the key's words. Not collision-resistant
/// by itself: only for keys a client cannot choose (they went through a keyed hash first).
#[derive(Clone, Copy, Debug, Default)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.write_u64(u64::from(*byte));
        }
    }
    fn write_u64(&mut self, value: u64) {
        self.0 = (self.0.rotate_left(23) ^ value).wrapping_mul(GOLDEN_GAMMA);
    }
    fn write_usize(&mut self, value: usize) {
        self.write_u64(value as u64);
    }
}

/// Length written for a missing part (a real part is never that long).
const MISSING: u64 = u64::MAX;

/// Feeds a key's parts to `hasher`, each framed by its length (`None`, a missing part, by a
/// length no part has): `("ab", "c")` and `("a", "bc")` differ, and a missing part differs from
/// an empty one.
pub fn write_parts<'a, H: Hasher>(hasher: &mut H, parts: impl IntoIterator<Item = Option<&'a [u8]>>) {
    for part in parts {
        match part {
            Some(bytes) => {
                hasher.write_u64(bytes.len() as u64);
                hasher.write(bytes);
            }
            None => hasher.write_u64(MISSING),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_is_the_reference_function() {
        // The FNV reference test vectors (64-bit FNV-1a).
        assert_eq!(fnv1a(b"", FNV1A_BASIS), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a", FNV1A_BASIS), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar", FNV1A_BASIS), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a(b"bar", fnv1a(b"foo", FNV1A_BASIS)), fnv1a(b"foobar", FNV1A_BASIS));
    }

    #[test]
    fn a_deal_is_a_stable_hand_of_distinct_items() {
        let mut deck: Vec<u32> = (0..10).collect();
        deal(42, &mut deck, 3);
        let mut again: Vec<u32> = (0..10).collect();
        deal(42, &mut again, 3);
        assert_eq!(deck, again, "a seed deals one hand");
        let mut sorted = deck.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..10).collect::<Vec<_>>(), "a permutation");
        let mut short = vec![1, 2];
        deal(7, &mut short, 5);
        assert!(short == [1, 2] || short == [2, 1], "a hand larger than the deck is the deck");
        deal(7, &mut Vec::<u8>::new(), 1);
    }

    #[test]
    fn splitmix64_is_the_reference_generator() {
        // The first outputs of the reference SplitMix64 seeded with 0.
        let mut rng = SplitMix64::new(0);
        assert_eq!(rng.next_u64(), 0xe220_a839_7b1d_cdaf);
        assert_eq!(rng.next_u64(), 0x6e78_9e6a_a1b9_65f4);
        assert_eq!(rng.next_u64(), 0x06c4_5d18_8009_454f);
    }
}
