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
/// count as zero. The draw is done in `order` itself: its tail holds the indices not yet drawn,
/// in their original order.
pub fn weighted_shuffle<R: Random + ?Sized>(weights: &[f64], rng: &mut R, order: &mut Vec<usize>) {
    let weight = |index: usize| weights.get(index).copied().filter(|w| *w > 0.0 && w.is_finite()).unwrap_or(0.0);
    order.clear();
    order.extend(0..weights.len());
    for next in 0..order.len() {
        let Some(remaining) = order.get_mut(next..) else { break };
        let total: f64 = remaining.iter().map(|&index| weight(index)).sum();
        let position = if total > 0.0 {
            let target = rng.next_unit() * total;
            let mut sum = 0.0;
            let mut chosen = None;
            for (position, &index) in remaining.iter().enumerate() {
                let weight = weight(index);
                sum += weight;
                if weight > 0.0 {
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
        // The drawn index comes next; the others keep their order.
        if let Some(drawn) = remaining.get_mut(..=position) {
            drawn.rotate_right(1);
        }
    }
}

/// A uniform index below `len` (> 0), from the unit draw.
fn uniform_below<R: Random + ?Sized>(rng: &mut R, len: usize) -> usize {
    #[allow(clippy::cast_precision_loss, clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let index = (rng.next_unit() * len as f64) as usize;
    index.min(len.saturating_sub(1))
}
