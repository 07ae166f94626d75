//! A request's probes: the rules that apply to it and its key's hash for each, read from its
//! attributes.

use super::Probe;
use crate::config::{Config, KeyPart, MissingKey, RateLimitRule};
use crate::keys::{KeyHasher, Source};

/// The rules that apply to a request and its key hash for each, from the request's attributes.
/// `fetch` is asked once per distinct attribute (host reads are not free) and may return the
/// bytes owned or borrowed; a rule whose key part is missing is skipped (its index is pushed to
/// `skipped`) unless it shares one counter for all such requests (`missing_key: "shared"`: one
/// counter per rule, whichever parts are missing and whatever the present ones hold).
pub fn probes<V: AsRef<[u8]>>(
    config: &Config,
    hasher: &KeyHasher,
    fetch: impl FnMut(Source<'_>) -> Option<V>,
    skipped: &mut Vec<usize>,
) -> Vec<Probe> {
    probes_where(config, hasher, fetch, skipped, |_| true, |_, _, _| {})
}

/// The parts of a probe's key as its hash read them (`None`: missing, or every part of a
/// shared counter's key).
pub type KeyParts<'p, 'v> = &'p mut dyn Iterator<Item = Option<&'v [u8]>>;

/// [`probes`] of the rules that `applies` (by index) says apply to the request: the others are
/// passed over before any of their key parts is read. `parts` is handed each probe's rule
/// (index and definition) and its key's parts, for another hash of the same key (a rule in
/// global scope's fleet-wide id: the same parts, the same framing).
pub fn probes_where<V: AsRef<[u8]>>(
    config: &Config,
    hasher: &KeyHasher,
    mut fetch: impl FnMut(Source<'_>) -> Option<V>,
    skipped: &mut Vec<usize>,
    mut applies: impl FnMut(usize) -> bool,
    mut parts_of: impl FnMut(usize, &RateLimitRule, KeyParts<'_, '_>),
) -> Vec<Probe> {
    // The attributes read so far: the first (most keys have one part) without an allocation.
    let mut first: Option<(Source<'_>, Option<V>)> = None;
    let mut more: Vec<(Source<'_>, Option<V>)> = Vec::new();
    let mut probes = Vec::with_capacity(config.rate_limits.len());
    for (rule_index, rule) in config.rate_limits.iter().enumerate() {
        if !applies(rule_index) {
            continue;
        }
        for part in &rule.key {
            let source = part.source();
            if !first.iter().chain(&more).any(|(s, _)| *s == source) {
                let value = Some((source, fetch(source)));
                match first {
                    None => first = value,
                    Some(_) => more.extend(value),
                }
            }
        }
        let value_of = |part: &KeyPart| -> Option<&[u8]> {
            let source = part.source();
            let raw = first.iter().chain(&more).find(|(s, _)| *s == source)?.1.as_ref()?.as_ref();
            Some(part.normalize(raw))
        };
        let complete = rule.key.iter().all(|part| value_of(part).is_some());
        if !complete && rule.missing_key == MissingKey::Skip {
            skipped.push(rule_index);
            continue;
        }
        // One counter for every request lacking any part, whatever the other parts hold.
        let parts = || rule.key.iter().map(|part| if complete { value_of(part) } else { None });
        probes.push(Probe::new(rule_index, hasher.hash(parts())));
        parts_of(rule_index, rule, &mut parts());
    }
    probes
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    #[allow(clippy::unwrap_used, clippy::indexing_slicing)]
    fn probes_read_each_attribute_once_and_skip_or_share_missing_keys() {
        let config = Config::parse(
            br#"{"rate_limits":[
              {"name":"a","key":[{"header":"x-key"},"source_ip"],"limit":1,"window":"1s"},
              {"name":"b","key":["source_ip"],"limit":1,"window":"1s"},
              {"name":"c","key":[{"header":"x-key"}],"limit":1,"window":"1s","missing_key":"shared"}]}"#,
        )
        .unwrap();
        let hasher = KeyHasher::new([3; 16]);
        let mut asked = Vec::new();
        let mut skipped = Vec::new();
        let probes = probes(&config, &hasher, |source| {
            asked.push(format!("{source:?}"));
            match source {
                Source::SourceAddress => Some(b"10.1.2.3:5555".to_vec()),
                Source::Header(_) => None,
            }
        }, &mut skipped);
        assert_eq!(asked.len(), 2, "{asked:?}");
        assert_eq!(skipped, vec![0]);
        assert_eq!(probes.iter().map(|p| p.rule).collect::<Vec<_>>(), vec![1, 2]);
        assert_eq!(probes[0].key_hash, hasher.hash([Some(&b"10.1.2.3"[..])]), "port stripped");
        assert_eq!(probes[1].key_hash, hasher.hash([None]));
    }

    #[test]
    #[allow(clippy::unwrap_used)]
    fn the_parts_of_a_global_rules_key_give_its_fleet_wide_id_beside_the_probe() {
        use crate::keys::fleet::{FleetHasher, FleetKeys};
        let config = Config::parse(
            br#"{"rate_limits":[
              {"name":"local","key":[{"header":"x-key"}],"limit":1,"window":"1s"},
              {"name":"fleet","key":[{"header":"x-key"},"source_ip"],"limit":1,"window":"1s","scope":"global"},
              {"name":"shared","key":[{"header":"x-none"}],"limit":1,"window":"1s","scope":"global","missing_key":"shared"}],
              "global":{"cluster":"floodgate-sync"}}"#,
        )
        .unwrap();
        let (hasher, fleet) = (KeyHasher::new([7; 16]), FleetHasher::new(Some("secret")));
        let mut keys = FleetKeys::default();
        let mut skipped = Vec::new();
        let fetch = |source: Source<'_>| match source {
            Source::Header("x-key") => Some(&b"k"[..]),
            Source::Header(_) => None,
            Source::SourceAddress => Some(&b"10.0.0.1:80"[..]),
        };
        let found = probes_where(&config, &hasher, fetch, &mut skipped, |_| true, |index, rule, parts| keys.keep(&fleet, index, rule, parts));
        assert_eq!(found.len(), 3);
        assert_eq!(keys.of(0), None, "a rule in proxy scope has none");
        assert_eq!(keys.of(1), Some(fleet.hash("fleet", [Some(&b"k"[..]), Some(&b"10.0.0.1"[..])])), "the parts its probe hashed");
        assert_eq!(keys.of(2), Some(fleet.hash("shared", [None])), "a shared counter's key: every part missing");
        // Read again (a request decided again), a rule's key is replaced, not added.
        let first = keys.clone();
        let again = probes_where(&config, &hasher, fetch, &mut skipped, |rule| rule == 1, |index, rule, parts| keys.keep(&fleet, index, rule, parts));
        assert_eq!(again.len(), 1);
        assert_eq!(keys, first);
    }

    #[test]
    #[allow(clippy::unwrap_used)]
    fn a_shared_missing_key_is_one_counter_whatever_parts_are_present() {
        let config = Config::parse(
            br#"{"rate_limits":[{"name":"a","key":[{"header":"x-key"},"source_ip"],"limit":1,
                 "window":"1s","missing_key":"shared"}]}"#,
        )
        .unwrap();
        let hasher = KeyHasher::new([5; 16]);
        let hash_of = |key: Option<&'static [u8]>, address: Option<&'static [u8]>| {
            let mut skipped = Vec::new();
            let found = probes(&config, &hasher, |source| match source {
                Source::Header(_) => key,
                Source::SourceAddress => address,
            }, &mut skipped);
            assert!(skipped.is_empty());
            found.iter().map(|p| p.key_hash).collect::<Vec<_>>()
        };
        let shared = hash_of(None, Some(b"10.0.0.1:1"));
        assert_eq!(shared.len(), 1);
        // No header, from another address, or with the header but no address: the same counter.
        assert_eq!(hash_of(None, Some(b"10.0.0.2:2")), shared);
        assert_eq!(hash_of(Some(b"k"), None), shared);
        assert_eq!(hash_of(None, None), shared);
        // A complete key has its own counter.
        assert_ne!(hash_of(Some(b"k"), Some(b"10.0.0.1:1")), shared);
    }
}
