//! An exact weighted random shuffle, drawn from a [`Random`] source.
//!
//! The order is drawn position by position without replacement: each remaining cluster comes
//! next with probability `weight / (sum of remaining weights)`, so an order `(a, b, c)` has
//! probability `w_a/W · w_b/(W − w_a) · 1`. Clusters of weight zero come after every weighted one,
//! in uniform random order. With a handful of clusters this costs a few multiplications, so the
//! published algorithm's approximation (sort, then promote one) is not needed.
//!
//! Rationale: docs/design.md, section "Cluster selection".

use crate::primitives::hash::Random;

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
