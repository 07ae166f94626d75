//! An exact weighted random shuffle, and the small random source it draws from.
//!
//! The order is drawn position by position without replacement: each remaining cluster comes
//! next with probability `weight / (sum of remaining weights)`, so an order `(a, b, c)` has
//! probability `w_a/W · w_b/(W − w_a) · 1`. Clusters of weight zero come after every weighted one,
//! in uniform random order. With a handful of clusters this costs a few multiplications, so the
//! seed's approximation (sort, then promote one) is not needed.

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
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Fills `order` with the indices of `weights` in weighted random order. Negative or NaN weights
/// count as zero.
pub fn weighted_shuffle<R: Random + ?Sized>(weights: &[f64], rng: &mut R, order: &mut Vec<usize>) {
    order.clear();
    let mut remaining: Vec<(usize, f64)> = weights
        .iter()
        .enumerate()
        .map(|(index, w)| (index, if *w > 0.0 && w.is_finite() { *w } else { 0.0 }))
        .collect();
    while !remaining.is_empty() {
        let total: f64 = remaining.iter().map(|(_, w)| w).sum();
        let position = if total > 0.0 {
            let target = rng.next_unit() * total;
            let mut sum = 0.0;
            let mut chosen = None;
            for (position, (_, weight)) in remaining.iter().enumerate() {
                sum += weight;
                if *weight > 0.0 {
                    chosen = Some(position);
                    if target < sum {
                        break;
                    }
                }
            }
            // Rounding can leave `target` at the very top: the last weighted entry takes it.
            chosen.unwrap_or(0)
        } else {
            uniform_below(rng, remaining.len())
        };
        let (index, _) = remaining.remove(position.min(remaining.len().saturating_sub(1)));
        order.push(index);
    }
}

/// A uniform index below `len` (> 0), from the unit draw.
fn uniform_below<R: Random + ?Sized>(rng: &mut R, len: usize) -> usize {
    #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let index = (rng.next_unit() * len as f64) as usize;
    index.min(len.saturating_sub(1))
}
