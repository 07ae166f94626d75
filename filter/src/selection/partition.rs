//! Virtual partitions of the clusters, the bulkhead of cluster selection
//! (`cluster_selection.partition`): one client's heavy or poisonous requests must not degrade
//! the service for everyone, so each key is confined to a stable pseudo-random subset of `k` of
//! the `n` clusters, and cluster selection (the weighted shuffle, the permits, the cascade) runs
//! within it. The subset is the first `k` of a Fisher–Yates shuffle of the clusters driven by
//! the key's hash, so every one of the `C(n, k)` subsets is equally likely: two keys share their
//! whole partition with probability `1 / C(n, k)` (8 clusters in partitions of 2: 1 in 28), and
//! a poison key's damage reaches the keys that share all of its partition, the others keeping a
//! healthy cluster of theirs. The hash is keyed by the configuration itself (the key's parts,
//! `k` and the cluster names), not by a per-proxy secret, so a key has the same partition on
//! every worker and every proxy of a fleet, across restarts, as long as the configuration is the
//! same.
//!
//! Rationale: docs/design.md, section "Cluster selection" (partitions).

use crate::config::{ClusterSelection, KeyPart};
use crate::keys::{hash_key, KeyHasher, Source};
use crate::primitives::hash::{deal, fnv1a, FNV1A_BASIS};
use crate::selection::Confinement;

/// Confines each key to a stable subset of the clusters.
#[derive(Clone, Debug)]
pub struct Partitioner {
    key: Vec<KeyPart>,
    hasher: KeyHasher,
    size: usize,
    clusters: usize,
    /// `spill_below` with `spill`, `None` with `refuse`.
    spill_below: Option<f64>,
}

impl Partitioner {
    /// The partitioner of `config`, if it has a `partition`.
    pub fn new(config: &ClusterSelection) -> Option<Partitioner> {
        let partition = config.partition.as_ref()?;
        let size = usize::try_from(partition.size.get().get()).unwrap_or(usize::MAX).min(config.clusters.len());
        let identity = format!(
            "{:?}|{size}|{}",
            partition.key,
            config.clusters.iter().map(|c| c.as_str()).collect::<Vec<_>>().join(",")
        );
        let low = fnv1a(identity.as_bytes(), FNV1A_BASIS);
        let high = fnv1a(identity.as_bytes(), low);
        let mut seed = [0u8; 16];
        seed[..8].copy_from_slice(&low.to_le_bytes());
        seed[8..].copy_from_slice(&high.to_le_bytes());
        Some(Partitioner {
            key: partition.key.clone(),
            hasher: KeyHasher::new(seed),
            size,
            clusters: config.clusters.len(),
            spill_below: partition.spill_below(),
        })
    }

    /// The key parts it reads.
    pub fn key(&self) -> &[KeyPart] {
        &self.key
    }

    /// The stable hash of a request's key (`None` when a part is missing: the request is not
    /// confined, it may use every cluster).
    pub fn key_hash<V: AsRef<[u8]>>(&self, fetch: impl FnMut(Source<'_>) -> Option<V>) -> Option<u64> {
        hash_key(&self.key, &self.hasher, fetch)
    }

    /// The partition of the key of hash `key_hash`: its members, the other clusters, and
    /// whether it may spill.
    pub fn confine(&self, key_hash: u64) -> Confinement {
        let mut members = self.members(key_hash);
        let others = members.split_off(self.size.min(members.len()));
        Confinement { members, others, spill_below: self.spill_below }
    }

    /// Every cluster (indexes), the key of hash `key_hash`'s members first.
    fn members(&self, key_hash: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.clusters).collect();
        deal(key_hash, &mut order, self.size);
        order
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::collections::HashMap;

    fn partitioner(clusters: usize, size: usize) -> Partitioner {
        let names: Vec<String> = (0..clusters).map(|i| format!("\"c{i}\"")).collect();
        let config = Config::parse(
            format!(r#"{{"cluster_selection":{{"clusters":[{}],"partition":{{"key":[{{"header":"x-k"}}],"size":{size}}}}}}}"#, names.join(","))
                .as_bytes(),
        )
        .unwrap();
        Partitioner::new(config.cluster_selection.as_ref().unwrap()).unwrap()
    }

    #[test]
    fn partitions_are_stable_distinct_members_and_uniform_over_the_subsets() {
        let p = partitioner(8, 2);
        let again = partitioner(8, 2);
        let mut counts: HashMap<Vec<usize>, u64> = HashMap::new();
        let keys = 28 * 400;
        for i in 0..keys {
            let key = p.key_hash(|_| Some(format!("key-{i}"))).unwrap();
            let confinement = p.confine(key);
            let members = confinement.members.clone();
            assert_eq!(confinement.spill_below, None, "refuse by default");
            let mut everything: Vec<usize> = members.iter().chain(&confinement.others).copied().collect();
            everything.sort_unstable();
            assert_eq!(everything, (0..8).collect::<Vec<_>>(), "members and others make the set");
            assert_eq!(members.len(), 2);
            assert_ne!(members[0], members[1]);
            assert!(members.iter().all(|m| *m < 8));
            assert_eq!(again.confine(again.key_hash(|_| Some(format!("key-{i}"))).unwrap()).members, members, "stable");
            let mut subset = members.clone();
            subset.sort_unstable();
            *counts.entry(subset).or_default() += 1;
        }
        assert_eq!(counts.len(), 28, "every one of C(8, 2) subsets is used");
        // χ² over 28 subsets (27 degrees of freedom): below 55 holds with p > 0.999.
        let expected = keys as f64 / 28.0;
        let chi2: f64 = counts.values().map(|c| (*c as f64 - expected).powi(2) / expected).sum();
        assert!(chi2 < 55.0, "χ² = {chi2}");
        assert_eq!(partitioner(8, 8).confine(7).members.len(), 8, "the whole set");
        assert!(p.key_hash(|_| None::<Vec<u8>>).is_none(), "no key: not confined");
    }

    #[test]
    fn another_configuration_gives_other_partitions() {
        let (a, b) = (partitioner(8, 2), partitioner(9, 2));
        let differ = (0..100).filter(|i| {
            let key = |p: &Partitioner| p.confine(p.key_hash(|_| Some(format!("k{i}"))).unwrap()).members;
            key(&a) != key(&b)
        });
        assert!(differ.count() > 50);
    }
}
