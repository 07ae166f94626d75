//! Request headers read once: which header names a configuration reads, whether a stream fetches
//! them one by one or the whole request header map in one host call, and the parser of that map as
//! the host serializes it (`proxy_get_header_map_pairs`: a little-endian `u32` count; per pair a
//! `u32` name length and a `u32` value length; then the names and values in order, each followed by
//! a NUL byte; an empty map may come as no bytes at all).
//!
//! A host call that returns bytes costs about 10 800 instructions under V8, the whole map about 16
//! 300 for ~8 headers (docs/benchmarks.md, 1b), so the map is read when two or more of the headers
//! read are usually present (the shedder's priority header usually is not, and does not count;
//! `source_ip` is a property, never in the map).
//!
//! Invariant: both ways give the same value: the first entry of a repeated name, which is what
//! Envoy's single read returns. A map that does not parse is [`MalformedMap`], and the caller reads
//! each header on its own instead.
//!
//! Rationale: docs/design.md, section "A request's path".

use crate::config::Config;
use crate::keys::Source;
use crate::primitives::record::{DecodeError, Reader, Writer};

/// The request header names a configuration reads, and how a stream fetches them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderPlan {
    /// Distinct lower-case names, in the order the request meets them.
    names: Vec<String>,
    /// Fetch the whole map once (at least two usually-present names) rather than each name.
    whole_map: bool,
}

impl HeaderPlan {
    /// The plan for `config`: the health endpoint's and the watchdog's `:path`, the shedder's priority header,
    /// every header a rate-limit key reads, and those the rules' conditions, tiers and costs
    /// read.
    pub fn new(config: &Config) -> HeaderPlan {
        // (name, usually present)
        let mut wanted: Vec<(String, bool)> = Vec::new();
        let mut want = |name: &str, usually_present: bool| {
            let name = name.to_ascii_lowercase();
            match wanted.iter_mut().find(|(n, _)| *n == name) {
                Some((_, present)) => *present |= usually_present,
                None => wanted.push((name, usually_present)),
            }
        };
        if config.health.is_some() || config.watchdog.is_some() {
            want(":path", true);
        }
        if let Some(shedding) = &config.load_shedding {
            want(&shedding.priority_header, false);
        }
        let per_key = config.load_shedding.as_ref().and_then(|s| s.per_key.as_ref()).map(|p| &p.key);
        let partition = config.cluster_selection.as_ref().and_then(|s| s.partition.as_ref()).map(|p| &p.key);
        let keys = config.rate_limits.iter().map(|rule| &rule.key).chain(per_key).chain(partition);
        for key in keys {
            for part in key {
                if let Source::Header(name) = part.source() {
                    want(name, true);
                }
            }
        }
        if config.cluster_selection.is_some() {
            // Whether a request with a cluster permit is gRPC (crate::replies::grpc).
            want("content-type", false);
        }
        // The rules' conditions, tier headers and request cost headers.
        for (name, usually_present) in crate::ratelimit::rules::Rules::request_headers(config) {
            want(&name, usually_present);
        }
        let present = wanted.iter().filter(|(_, present)| *present).count();
        HeaderPlan {
            whole_map: present >= 2,
            names: wanted.into_iter().map(|(name, _)| name).collect(),
        }
    }

    /// The names, lower-case, distinct.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// True when a stream should fetch the whole request header map once.
    pub fn whole_map(&self) -> bool {
        self.whole_map
    }
}

/// A serialized header map that does not follow the format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MalformedMap;

impl From<DecodeError> for MalformedMap {
    fn from(_: DecodeError) -> MalformedMap {
        MalformedMap
    }
}

/// What a [`HeaderView`] knows of one header name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup<'m> {
    /// The value of the name's first entry.
    Present(&'m [u8]),
    /// The request has no such header.
    Absent,
    /// The name is not one of the plan's: the view cannot tell.
    NotLookedUp,
}

/// The values of a plan's names in one request's serialized header map.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderView<'p, 'm> {
    names: &'p [String],
    values: Values<'m>,
}

/// Plans with up to this many names keep a request's values without an allocation.
const INLINE_VALUES: usize = 4;

/// The value of each of a plan's names (`None`: absent), in the plan's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Values<'m> {
    /// The first `len` of `values`.
    Inline {
        /// The values, then unused slots.
        values: [Option<&'m [u8]>; INLINE_VALUES],
        /// How many are the plan's.
        len: usize,
    },
    /// More names than fit inline.
    Heap(Vec<Option<&'m [u8]>>),
}

impl<'m> Values<'m> {
    /// `len` values, all absent.
    fn absent(len: usize) -> Values<'m> {
        if len <= INLINE_VALUES {
            Values::Inline { values: [None; INLINE_VALUES], len }
        } else {
            Values::Heap(vec![None; len])
        }
    }
}

impl<'m> std::ops::Deref for Values<'m> {
    type Target = [Option<&'m [u8]>];

    fn deref(&self) -> &Self::Target {
        match self {
            Values::Inline { values, len } => values.get(..*len).unwrap_or_default(),
            Values::Heap(values) => values,
        }
    }
}

impl std::ops::DerefMut for Values<'_> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        match self {
            Values::Inline { values, len } => values.get_mut(..*len).unwrap_or_default(),
            Values::Heap(values) => values,
        }
    }
}

impl<'p, 'm> HeaderView<'p, 'm> {
    /// Looks the plan's names up in `map` (the first entry of each).
    pub fn parse(plan: &'p HeaderPlan, map: &'m [u8]) -> Result<HeaderView<'p, 'm>, MalformedMap> {
        let names = plan.names();
        Ok(HeaderView {
            names,
            values: first_values(map, names)?,
        })
    }

    /// The value of `name` (any case).
    pub fn get(&self, name: &str) -> Lookup<'m> {
        match self.names.iter().position(|n| n.eq_ignore_ascii_case(name)) {
            Some(index) => match self.values.get(index) {
                Some(Some(value)) => Lookup::Present(value),
                Some(None) => Lookup::Absent,
                None => Lookup::NotLookedUp,
            },
            None => Lookup::NotLookedUp,
        }
    }
}

/// For each of `names` (lower-case), the value of its first entry in the serialized `map`.
/// The whole map is checked, so a malformed one is refused whatever names it is asked for.
pub fn first_values<'m>(map: &'m [u8], names: &[String]) -> Result<Values<'m>, MalformedMap> {
    let mut values = Values::absent(names.len());
    if map.is_empty() {
        return Ok(values);
    }
    let mut map = Reader::new(map);
    let count = usize::try_from(map.u32()?).map_err(|_| MalformedMap)?;
    let mut lengths = Reader::new(map.bytes(count.checked_mul(8).ok_or(MalformedMap)?)?);
    let mut data = map;
    for _ in 0..count {
        let (name_len, value_len) = (lengths.u32()?, lengths.u32()?);
        let name = field(&mut data, name_len)?;
        let value = field(&mut data, value_len)?;
        for (slot, wanted) in values.iter_mut().zip(names) {
            if slot.is_none() && name == wanted.as_bytes() {
                *slot = Some(value);
            }
        }
    }
    data.end()?;
    Ok(values)
}

/// One name or value: `len` bytes then a NUL.
fn field<'m>(data: &mut Reader<'m>, len: u32) -> Result<&'m [u8], MalformedMap> {
    let bytes = data.bytes(usize::try_from(len).map_err(|_| MalformedMap)?)?;
    match data.array()? {
        [0] => Ok(bytes),
        _ => Err(MalformedMap),
    }
}

/// Serializes pairs the way the host does (for tests and fuzzing).
pub fn serialize(pairs: &[(&[u8], &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    let len = |bytes: &[u8]| u32::try_from(bytes.len()).unwrap_or(u32::MAX);
    out.put_u32(u32::try_from(pairs.len()).unwrap_or(u32::MAX));
    for (name, value) in pairs {
        out.put_u32(len(name));
        out.put_u32(len(value));
    }
    for (name, value) in pairs {
        for bytes in [name, value] {
            out.put(bytes);
            out.put(&[0]);
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The values of `names` in `map`, as a list.
    fn first<'m>(map: &'m [u8], names: &[String]) -> Result<Vec<Option<&'m [u8]>>, MalformedMap> {
        first_values(map, names).map(|values| values.to_vec())
    }

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|n| (*n).to_owned()).collect()
    }

    fn plan(json: &str) -> HeaderPlan {
        HeaderPlan::new(&Config::parse(json.as_bytes()).unwrap())
    }

    const REQUEST: &[(&[u8], &[u8])] = &[
        (b":authority", b"example.com"),
        (b":path", b"/a?b=1"),
        (b":method", b"GET"),
        (b"x-api-key", b"first"),
        (b"user-agent", b"curl"),
        (b"x-api-key", b"second"),
        (b"x-empty", b""),
    ];

    #[test]
    fn the_first_entry_of_each_name_absent_as_none() {
        let map = serialize(REQUEST);
        let wanted = names(&[":path", "x-api-key", "x-floodgate-priority", "x-empty", ":method"]);
        let values = first(&map, &wanted).unwrap();
        assert_eq!(
            values,
            vec![Some(&b"/a?b=1"[..]), Some(&b"first"[..]), None, Some(&b""[..]), Some(&b"GET"[..])]
        );
    }

    #[test]
    fn empty_maps_have_no_headers() {
        let wanted = names(&[":path"]);
        assert_eq!(first(&[], &wanted), Ok(vec![None]));
        assert_eq!(first(&serialize(&[]), &wanted), Ok(vec![None]));
        assert_eq!(first(&serialize(REQUEST), &[]), Ok(vec![]));
    }

    #[test]
    fn malformed_maps_are_refused() {
        let good = serialize(REQUEST);
        let wanted = names(&["x-api-key"]);
        // Every truncation, and one byte too many.
        for len in 1..good.len() {
            assert_eq!(first(&good[..len], &wanted), Err(MalformedMap), "truncated to {len}");
        }
        let mut longer = good.clone();
        longer.push(0);
        assert_eq!(first(&longer, &wanted), Err(MalformedMap));
        // A missing NUL after a name.
        let mut no_nul = good.clone();
        let at = 4 + 8 * REQUEST.len() + b":authority".len();
        assert_eq!(no_nul[at], 0);
        no_nul[at] = b'x';
        assert_eq!(first(&no_nul, &wanted), Err(MalformedMap));
        // Lengths and counts far past the end.
        let mut huge_len = good.clone();
        huge_len[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(first(&huge_len, &wanted), Err(MalformedMap));
        let mut huge_count = good;
        huge_count[..4].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(first(&huge_count, &wanted), Err(MalformedMap));
        assert_eq!(first(&[1, 0, 0], &wanted), Err(MalformedMap));
    }

    #[test]
    fn the_view_answers_in_any_case_and_says_what_it_did_not_look_up() {
        let plan = plan(
            r#"{"health":{"path":"/h"},"load_shedding":{"max_active_requests":5,"priority_header":"X-Prio"},
                "rate_limits":[{"name":"a","key":[{"header":"x-api-key"}],"limit":1,"window":"1s"}]}"#,
        );
        assert_eq!(plan.names(), names(&[":path", "x-prio", "x-api-key"]).as_slice());
        let map = serialize(REQUEST);
        let view = HeaderView::parse(&plan, &map).unwrap();
        assert_eq!(view.get(":path"), Lookup::Present(b"/a?b=1"));
        assert_eq!(view.get("X-Api-Key"), Lookup::Present(b"first"));
        assert_eq!(view.get("X-Prio"), Lookup::Absent);
        assert_eq!(view.get("user-agent"), Lookup::NotLookedUp);
        assert_eq!(HeaderView::parse(&plan, &map[..9]), Err(MalformedMap));
    }

    #[test]
    fn the_whole_map_only_for_two_usually_present_names() {
        // One rule on one header: one read.
        let one = plan(r#"{"rate_limits":[{"name":"a","key":[{"header":"x-api-key"}],"limit":1,"window":"1s"}]}"#);
        assert_eq!(one.names(), names(&["x-api-key"]).as_slice());
        assert!(!one.whole_map());
        // source_ip is a property; the same header twice is one name.
        let same = plan(
            r#"{"rate_limits":[{"name":"a","key":[{"header":"X-Api-Key"},"source_ip"],"limit":1,"window":"1s"},
                               {"name":"b","key":[{"header":"x-api-key"}],"limit":1,"window":"1s"}]}"#,
        );
        assert_eq!(same.names(), names(&["x-api-key"]).as_slice());
        assert!(!same.whole_map());
        // A key header and the (usually absent) priority header: still one read each.
        let shed = plan(
            r#"{"load_shedding":{"max_active_requests":5},
                "rate_limits":[{"name":"a","key":[{"header":"x-api-key"}],"limit":1,"window":"1s"}]}"#,
        );
        assert_eq!(shed.names(), names(&["x-floodgate-priority", "x-api-key"]).as_slice());
        assert!(!shed.whole_map());
        // Health and a key header: the map.
        let both = plan(
            r#"{"health":{"path":"/h"},"load_shedding":{"max_active_requests":5},
                "rate_limits":[{"name":"a","key":[{"header":"x-api-key"}],"limit":1,"window":"1s"}]}"#,
        );
        assert_eq!(both.names(), names(&[":path", "x-floodgate-priority", "x-api-key"]).as_slice());
        assert!(both.whole_map());
        // Key parts read pseudo-headers; `path` and {"header": ":path"} are one name.
        let parts = plan(
            r#"{"rate_limits":[{"name":"a","key":["path","method","authority",{"header":":path"}],"limit":1,"window":"1s"}]}"#,
        );
        assert_eq!(parts.names(), names(&[":path", ":method", ":authority"]).as_slice());
        assert!(parts.whole_map());
        // A priority header also used as a key is usually present.
        let keyed = plan(
            r#"{"health":{"path":"/h"},"load_shedding":{"max_active_requests":5,"priority_header":"x-tier"},
                "rate_limits":[{"name":"a","key":[{"header":"x-tier"}],"limit":1,"window":"1s"}]}"#,
        );
        assert!(keyed.whole_map());
        // Cluster selection reads content-type (is the request gRPC?), usually absent.
        let selection = plan(r#"{"health":{"path":"/h"},"cluster_selection":{"clusters":["a"]}}"#);
        assert_eq!(selection.names(), names(&[":path", "content-type"]).as_slice());
        assert!(!selection.whole_map());
        // The bulkhead's keys are read too.
        let bulkhead = plan(
            r#"{"load_shedding":{"per_key":{"key":[{"header":"X-Client"}],"max_active_requests":2}},
                "cluster_selection":{"clusters":["a","b"],"partition":{"key":[{"header":"x-tenant"}],"size":1}}}"#,
        );
        assert_eq!(bulkhead.names(), names(&["x-floodgate-priority", "x-client", "x-tenant", "content-type"]).as_slice());
        assert!(bulkhead.whole_map());
        assert!(!plan("{}").whole_map());
        assert!(plan("{}").names().is_empty());
    }

    proptest! {
        /// Whatever the host sends, the parser answers without panicking.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = first(&bytes, &names(&["a", ""]));
        }

        /// Serialized maps parse back to the first value of each name, and every truncation
        /// of them is refused.
        #[test]
        fn serialized_maps_read_back(
            pairs in proptest::collection::vec(("[a-c]{0,2}", proptest::collection::vec(any::<u8>(), 0..4)), 0..6),
        ) {
            let borrowed: Vec<(&[u8], &[u8])> = pairs.iter().map(|(n, v)| (n.as_bytes(), v.as_slice())).collect();
            let map = serialize(&borrowed);
            let wanted = names(&["a", "b", "", "zz"]);
            let expected: Vec<Option<&[u8]>> = wanted
                .iter()
                .map(|w| borrowed.iter().find(|(n, _)| *n == w.as_bytes()).map(|(_, v)| *v))
                .collect();
            prop_assert_eq!(first(&map, &wanted), Ok(expected));
            for len in 1..map.len() {
                prop_assert_eq!(first(&map[..len], &wanted), Err(MalformedMap));
            }
        }
    }
}
