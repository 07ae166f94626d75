//! The bulkhead's configuration: virtual partitions of the clusters per key
//! (`cluster_selection.partition`) and a cap on each key's requests in flight
//! (`load_shedding.per_key`). Rationale: docs/design.md, sections "The per-key cap (bulkhead)"
//! and "Cluster selection".

use super::values::{Fraction, Positive};
use super::{ConfigError, KeyPart, Mode};
use serde::Deserialize;

/// The most keys in flight a per-key cap tracks.
pub const MAX_PER_KEY_CAPACITY: u32 = 1 << 20;

/// `cluster_selection.partition`: each key is confined to a stable pseudo-random subset of the
/// clusters (shuffle sharding).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Partition {
    /// The parts of the request that make the key, as a rate limit's `key`.
    pub key: Vec<KeyPart>,
    /// Clusters in each key's partition (at most the number of clusters).
    pub size: Positive,
    /// What a request does when every cluster of its partition is full or failing.
    #[serde(default)]
    pub when_unavailable: WhenUnavailable,
    /// With `spill`: a member whose success rate is below this is failing; a request whose
    /// members all are tries the other clusters first (default 0.5).
    #[serde(default)]
    pub spill_below: Option<Fraction>,
    /// `shadow`: a request whose partition has no room goes to any cluster with room, and is
    /// counted as a would-be refusal.
    #[serde(default)]
    pub mode: Mode,
}

/// What a request does when its partition is unavailable: every member full, or failing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WhenUnavailable {
    /// Stay confined: members only, in the order their weights say, failing or not; `503`
    /// when every member is at its concurrency limit. The bulkhead's point: a poison key
    /// never reaches more than its partition.
    #[default]
    Refuse,
    /// Availability first: when every member is full, go on to the other clusters; when every
    /// member is failing (`spill_below`), try the others first. A poison key then reaches
    /// other clusters too.
    Spill,
}

/// The default of `spill_below`.
pub const DEFAULT_SPILL_BELOW: f64 = 0.5;

impl Partition {
    /// With `spill`: the success rate below which a member is failing.
    pub fn spill_below(&self) -> Option<f64> {
        match self.when_unavailable {
            WhenUnavailable::Refuse => None,
            WhenUnavailable::Spill => Some(self.spill_below.map_or(DEFAULT_SPILL_BELOW, Fraction::get)),
        }
    }
}

/// `load_shedding.per_key`: no key holds more than this many requests in flight, proxy-wide.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PerKey {
    /// The parts of the request that make the key, as a rate limit's `key`.
    pub key: Vec<KeyPart>,
    /// Requests of one key in flight at most.
    pub max_active_requests: Positive,
    /// (key, worker) pairs in flight the cap tracks at once (memory: `capacity / 8` records of
    /// 228 bytes).
    #[serde(default = "default_per_key_capacity")]
    pub capacity: Positive,
    /// `shadow`: the cap only counts the requests it would refuse.
    #[serde(default)]
    pub mode: Mode,
}

fn key_text(key: &[KeyPart]) -> String {
    key.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")
}

impl Partition {
    /// One line for the start-up log: `partitions of 2 of 8 clusters by [header x-k] (1 in 28
    /// keys share one), refuse`.
    pub fn summary(&self, clusters: usize) -> String {
        let size = self.size.get().get();
        let shared = subsets(u64::try_from(clusters).unwrap_or(u64::MAX), u64::from(size));
        let when = match self.spill_below() {
            None => "refuse when unavailable".to_owned(),
            Some(below) => format!("spill when full or below {below}"),
        };
        format!("partitions of {size} of {clusters} clusters by [{}] ({shared} possible: a key shares its whole partition with 1 key in {shared}), {when}", key_text(&self.key))
    }
}

/// `C(n, k)`, the number of `k`-subsets of `n` clusters (saturating).
pub fn subsets(n: u64, k: u64) -> u64 {
    let k = k.min(n.saturating_sub(k));
    // C(n, i + 1) = C(n, i) · (n − i) / (i + 1), exact at every step; u128 holds the product
    // for every n up to MAX_CLUSTERS.
    let c = (0..k).fold(1u128, |c, i| {
        c.saturating_mul(u128::from(n.saturating_sub(i))).checked_div(u128::from(i.saturating_add(1))).unwrap_or(c)
    });
    u64::try_from(c).unwrap_or(u64::MAX)
}

impl PerKey {
    /// One line for the start-up log.
    pub fn summary(&self) -> String {
        format!("{} in flight per key [{}] ({} tracked)", self.max_active_requests.get(), key_text(&self.key), self.capacity.get())
    }
}

fn default_per_key_capacity() -> Positive {
    Positive::new(4096).unwrap_or(Positive::ONE)
}

fn error(path: &str, problem: impl Into<String>) -> ConfigError {
    ConfigError { path: path.to_owned(), problem: problem.into() }
}

/// Checks a partition against `clusters`, the number of clusters.
pub fn validate_partition(partition: &Partition, clusters: usize) -> Result<(), ConfigError> {
    if partition.key.is_empty() {
        return Err(error("cluster_selection.partition.key", "must list at least one key part"));
    }
    if partition.spill_below.is_some() && partition.when_unavailable == WhenUnavailable::Refuse {
        return Err(error(
            "cluster_selection.partition.spill_below",
            "applies only with \"when_unavailable\": \"spill\"",
        ));
    }
    let size = usize::try_from(partition.size.get().get()).unwrap_or(usize::MAX);
    if size > clusters {
        return Err(error(
            "cluster_selection.partition.size",
            format!("must be at most the number of clusters ({clusters}), got {size}"),
        ));
    }
    Ok(())
}

/// Checks a per-key cap.
pub fn validate_per_key(per_key: &PerKey) -> Result<(), ConfigError> {
    if per_key.key.is_empty() {
        return Err(error("load_shedding.per_key.key", "must list at least one key part"));
    }
    if per_key.capacity.get().get() > MAX_PER_KEY_CAPACITY {
        return Err(error(
            "load_shedding.per_key.capacity",
            format!("must be at most {MAX_PER_KEY_CAPACITY}, got {}", per_key.capacity.get()),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::subsets;

    #[test]
    fn subsets_count_the_partitions() {
        assert_eq!(subsets(8, 2), 28);
        assert_eq!(subsets(10, 2), 45, "C(10, 2)");
        assert_eq!(subsets(8, 8), 1);
        assert_eq!(subsets(64, 32), 1_832_624_140_942_590_534);
        assert_eq!(subsets(3, 0), 1);
    }
}
