//! `POST /v1/lease` (version 1): units of a key's quota granted to a proxy ahead of use, for the
//! rules in leased consistency (see `sync/README.md`, "Leases").
//!
//! A proxy asks for `want` units of (`key`, `window_ms`, `bucket`) under `limit`; the script
//! `lease.lua` grants what the sliding window has room for (at most a quarter of the room, and
//! at least one unit while there is any), counts the grant in the bucket's counter, and answers
//! with the counters after it. Units the proxy did not use come back in a later call
//! (`returned`, `returned_previous`), before the grant; units it admitted while the store was
//! down come as `consumed`, counted whatever the room. The counters are the batched rules'
//! counters ([`crate::layout`]): one key's counters share a shard, so one slot.
//!
//! A call is not retried by the proxy: a grant whose answer is lost stays counted (the fleet
//! then admits less, never more), so no dedup key is needed.
//!
//! A caller that names itself (`holder`, one per proxy) is tracked: its units outstanding in a
//! bucket (granted, less given back, less reported `used`) sit in the bucket's holders hash
//! (`<counter>:h`, same slot). Once a bucket has ended and `grace_ms` passed, what a holder still
//! has outstanding there is a stopped holder's (a proxy that died): it comes off the counter,
//! so a dead proxy's leases stop weighing at the end of the bucket they were granted in.
//!
//! Rationale: docs/design.md, section "Leased consistency".

use serde::de::Deserializer;
use serde::{Deserialize, Serialize};

use crate::layout::{expire_at_ms, Layout};
use crate::protocol::{
    bucket, delta as units, parse_json, ranged, version, window_ms, CounterKey, ProxyId,
};
#[cfg(doc)]
use crate::protocol::{MAX_BUCKET, MAX_DELTA, MAX_WINDOW_MS, VERSION};
#[cfg(test)]
use crate::protocol::VERSION;

/// One key's lease request.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a lease object")]
pub struct LeaseEntry {
    /// The counter's key.
    pub key: CounterKey,
    /// The window length in milliseconds, 1..=[`MAX_WINDOW_MS`].
    #[serde(deserialize_with = "window_ms")]
    pub window_ms: u64,
    /// The window bucket (ms since the epoch / `window_ms`), at most [`MAX_BUCKET`].
    #[serde(deserialize_with = "bucket")]
    pub bucket: u64,
    /// Milliseconds since the bucket began, below `window_ms` (the previous bucket's weight).
    pub elapsed_ms: u64,
    /// The key's limit per window, 1..=2³² − 1.
    #[serde(deserialize_with = "limit")]
    pub limit: u64,
    /// Units asked for, 0..=[`MAX_DELTA`] (0: only give back and read).
    #[serde(deserialize_with = "units")]
    pub want: u64,
    /// Units of `bucket` the proxy admitted without a grant (the store was down), counted
    /// first whatever the room, 0..=[`MAX_DELTA`].
    #[serde(default, deserialize_with = "units")]
    pub consumed: u64,
    /// Unused units of `bucket` given back before the grant, 0..=[`MAX_DELTA`].
    #[serde(default, deserialize_with = "units")]
    pub returned: u64,
    /// Unused units of `bucket − 1` given back before the grant, 0..=[`MAX_DELTA`].
    #[serde(default, deserialize_with = "units")]
    pub returned_previous: u64,
    /// Who asks: one id per proxy (16 lowercase hex characters). Without it, the caller's
    /// units are not tracked (its give-backs come off the counter unchecked).
    #[serde(default)]
    pub holder: Option<ProxyId>,
    /// Units of `bucket`'s grants the holder admitted since its last call, 0..=[`MAX_DELTA`].
    #[serde(default, deserialize_with = "units")]
    pub used: u64,
    /// Units of `bucket − 1`'s grants the holder admitted since its last call.
    #[serde(default, deserialize_with = "units")]
    pub used_previous: u64,
    /// How long into `bucket` the holders of `bucket − 1` have to settle it before what they
    /// still hold there is taken back; below `window_ms`; 0: never (default:
    /// [`default_grace_ms`]).
    #[serde(default)]
    pub grace_ms: Option<u64>,
    /// Units of the grant the holder's waiting requests take at once, 0..=[`MAX_DELTA`]:
    /// counted as used, not outstanding (nothing to report for them).
    #[serde(default, deserialize_with = "units")]
    pub at_once: u64,
    /// Units of `bucket` counted as used (reported `used`, or taken `at_once`) that were not
    /// used after all, 0..=[`MAX_DELTA`]: taken off the counter (never below 0), not off the
    /// holder's outstanding units.
    #[serde(default, deserialize_with = "units")]
    pub refunded: u64,
    /// The same for `bucket − 1`.
    #[serde(default, deserialize_with = "units")]
    pub refunded_previous: u64,
    /// Grant `want` whole or nothing (no quarter of the room): the ask of a batched rule's
    /// request, whose units are taken at once (default: false).
    #[serde(default)]
    pub exact: bool,
    /// Units of the key that `limit` leaves out (the proxy admitted them, the store had not
    /// confirmed them) and that travel in the proxy's batch on its way (absent: none). Only with
    /// `exact`.
    #[serde(default)]
    pub carried: Option<Carried>,
}

/// Units of an ask's key in a batch on its way (`ask.lua`): when the shard's dedup shows that
/// batch applied, the counter holds them, and the ask's `limit` takes them back.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a carried object")]
pub struct Carried {
    /// The batch's source (its `proxy`).
    pub proxy: ProxyId,
    /// The batch's `seq`.
    pub seq: u64,
    /// The key's units in it, 0..=[`MAX_DELTA`] (0: nothing to take back).
    #[serde(deserialize_with = "units")]
    pub units: u64,
    /// The longest window of the batch's counters, 1..=[`MAX_WINDOW_MS`].
    #[serde(deserialize_with = "window_ms")]
    pub longest_window_ms: u64,
}

/// The default `grace_ms`, for windows of a second and more.
pub const DEFAULT_GRACE_MS: u64 = 250;

/// `grace_ms` when the caller sends none: a quarter window, at most [`DEFAULT_GRACE_MS`]; 0
/// (never take units back) for windows under 400 ms, too short to settle in.
pub fn default_grace_ms(window_ms: u64) -> u64 {
    if window_ms < 400 {
        0
    } else {
        (window_ms / 4).min(DEFAULT_GRACE_MS)
    }
}

/// `POST /v1/lease`'s body.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a lease request object")]
pub struct LeaseRequest {
    /// Always [`VERSION`].
    #[serde(deserialize_with = "version")]
    pub version: u64,
    /// The keys, in the order the answer gives their grants.
    pub leases: Vec<LeaseEntry>,
}

/// What one key got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grant {
    /// Units granted (0 when the window has no room, or none was asked for).
    pub granted: u64,
    /// The bucket's counter after the call: units granted in it fleet-wide, less those given
    /// back.
    pub current: u64,
    /// The previous bucket's counter after the call (0 for bucket 0).
    pub previous: u64,
    /// Units of stopped holders the call took back from the previous bucket (not sent: for
    /// the metrics).
    #[serde(skip)]
    pub reclaimed: u64,
}

/// `POST /v1/lease`'s answer: one [`Grant`] per request entry, in request order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseResponse {
    /// Always [`VERSION`].
    pub version: u64,
    /// One per entry, in request order.
    pub leases: Vec<Grant>,
}

/// One entry laid out for the script (see `lease.lua`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedLease {
    /// The shard of its key (one slot in a cluster).
    pub shard: u32,
    /// The bucket's counter key.
    pub current_key: String,
    /// The previous bucket's counter key; `None` for bucket 0.
    pub previous_key: Option<String>,
    /// The script's numeric ARGV (1 to 12).
    pub args: [u64; 12],
    /// The holder (ARGV 13; empty: not tracked), then `at_once` (ARGV 14).
    pub holder: String,
    /// Units of the grant taken at once (ARGV 14).
    pub at_once: u64,
    /// `refunded` and `refunded_previous` (ARGV 15 and 16).
    pub refunded: [u64; 2],
    /// `exact` (ARGV 17).
    pub exact: bool,
    /// Units in a batch on its way, for `ask.lua`.
    pub carried: Option<PlannedCarried>,
}

/// [`Carried`] laid out for `ask.lua`: the dedup hashes where the batch's seq would be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlannedCarried {
    /// The batch's source's field in the dedup hashes for a whole batch: the proxy.
    pub seen_field: String,
    /// Its field for a batch laid out in shard parts, when that is another
    /// ([`Layout::seen_field`]: `<proxy>:<s>` on a single node).
    pub part_field: Option<String>,
    /// The batch's seq.
    pub seq: u64,
    /// The key's units in it.
    pub units: u64,
    /// The hashes ([`Layout::seen_keys_of`]).
    pub seen_keys: Vec<String>,
}

impl PlannedLease {
    /// Whether it is the ask of a batched rule's request: `exact`, its units taken at once,
    /// nothing given back, reported or refunded (so no holder's units change). Such asks merge
    /// into one script call per shard (`ask.lua`); it grants what `lease.lua` would.
    pub fn is_ask(&self) -> bool {
        let [_, _, _, want, returned, returned_previous, _, consumed, used, used_previous, ..] = self.args;
        self.exact && self.at_once == want && [returned, returned_previous, consumed, used, used_previous] == [0; 5] && self.refunded == [0, 0]
    }

    /// The script's KEYS: the counters and their holders hashes.
    pub fn keys(&self) -> Vec<String> {
        let mut keys = vec![self.current_key.clone(), holders_key(&self.current_key)];
        if let Some(previous) = &self.previous_key {
            keys.push(previous.clone());
            keys.push(holders_key(previous));
        }
        keys
    }

    /// The script's ARGV.
    pub fn argv(&self) -> Vec<String> {
        let mut argv: Vec<String> = self.args.iter().map(u64::to_string).collect();
        argv.push(self.holder.clone());
        argv.push(self.at_once.to_string());
        argv.extend(self.refunded.iter().map(u64::to_string));
        argv.push(if self.exact { "1" } else { "0" }.to_owned());
        argv
    }
}

/// A bucket's holders hash: its counter's key and `:h` (the same hash tag, so the same slot).
pub fn holders_key(counter_key: &str) -> String {
    format!("{counter_key}:h")
}

fn limit<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    ranged(deserializer, 1, u64::from(u32::MAX))
}

/// Parses and validates a lease request. The error is one line that names the field.
pub fn parse_lease_request(body: &[u8], max_entries: usize) -> Result<LeaseRequest, String> {
    let request: LeaseRequest = parse_json(body)?;
    if request.leases.len() > max_entries {
        return Err(format!(
            "leases: at most {max_entries} entries per request, got {}",
            request.leases.len()
        ));
    }
    for (at, entry) in request.leases.iter().enumerate() {
        if entry.elapsed_ms >= entry.window_ms {
            return Err(format!(
                "leases[{at}].elapsed_ms: must be below window_ms ({}), got {}",
                entry.window_ms, entry.elapsed_ms
            ));
        }
        if entry.carried.is_some() && !entry.exact {
            return Err(format!("leases[{at}].carried: only with exact"));
        }
        if entry.grace_ms.is_some_and(|grace| grace >= entry.window_ms) {
            return Err(format!(
                "leases[{at}].grace_ms: must be below window_ms ({}), got {}",
                entry.window_ms,
                entry.grace_ms.unwrap_or_default()
            ));
        }
    }
    Ok(request)
}

/// Lays an entry out: its counters' keys and the script's arguments.
pub fn plan_lease(layout: &Layout, entry: &LeaseEntry) -> PlannedLease {
    let shard = layout.shard(&entry.key);
    PlannedLease {
        shard,
        current_key: layout.counter_key(shard, &entry.key, entry.window_ms, entry.bucket),
        previous_key: entry
            .bucket
            .checked_sub(1)
            .map(|previous| layout.counter_key(shard, &entry.key, entry.window_ms, previous)),
        args: [
            entry.window_ms,
            entry.window_ms.saturating_sub(entry.elapsed_ms),
            entry.limit,
            entry.want,
            entry.returned,
            entry.returned_previous,
            expire_at_ms(entry.window_ms, entry.bucket),
            entry.consumed,
            entry.used,
            entry.used_previous,
            entry.grace_ms.unwrap_or_else(|| default_grace_ms(entry.window_ms)),
            entry.bucket.saturating_mul(entry.window_ms),
        ],
        holder: entry
            .holder
            .as_ref()
            .map(|h| h.as_str().to_owned())
            .unwrap_or_default(),
        at_once: entry.at_once,
        refunded: [entry.refunded, entry.refunded_previous],
        exact: entry.exact,
        carried: entry.carried.as_ref().map(|c| PlannedCarried {
            seen_field: c.proxy.as_str().to_owned(),
            part_field: Some(layout.seen_field(shard, c.proxy.as_str())).filter(|field| field != c.proxy.as_str()),
            seq: c.seq,
            units: c.units,
            seen_keys: layout.seen_keys_of(
                &entry.key,
                entry.window_ms,
                entry.bucket,
                c.longest_window_ms,
                entry.bucket.saturating_mul(entry.window_ms).saturating_add(entry.elapsed_ms),
            ),
        }),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]

    use super::*;

    const KEY: &str = "00000001aaaaaaaaaaaaaaaaaaaaaaaa";

    fn entry(fields: &str) -> String {
        format!(r#"{{"version":1,"leases":[{{"key":"{KEY}","window_ms":1000,"bucket":5,"elapsed_ms":250,"limit":10{fields}}}]}}"#)
    }

    #[test]
    fn parses_and_plans_an_entry() {
        let request = parse_lease_request(entry(r#","want":3,"returned":1"#).as_bytes(), 10).unwrap();
        let lease = &request.leases[0];
        assert_eq!((lease.want, lease.returned, lease.returned_previous), (3, 1, 0));
        let planned = plan_lease(&Layout::new("fg:", 16), lease);
        assert_eq!(planned.current_key, format!("fg:{{1}}:{KEY}:1000:5"));
        assert_eq!(planned.previous_key, Some(format!("fg:{{1}}:{KEY}:1000:4")));
        assert_eq!(planned.args, [1000, 750, 10, 3, 1, 0, 7 * 1000 + 60_000, 0, 0, 0, 250, 5000]);
        assert_eq!(planned.holder, "");
        assert_eq!(
            planned.keys(),
            [
                format!("fg:{{1}}:{KEY}:1000:5"),
                format!("fg:{{1}}:{KEY}:1000:5:h"),
                format!("fg:{{1}}:{KEY}:1000:4"),
                format!("fg:{{1}}:{KEY}:1000:4:h"),
            ]
        );
        let tracked = parse_lease_request(
            entry(r#","want":3,"holder":"00000000000000ff","used":4,"used_previous":5,"grace_ms":999"#).as_bytes(),
            10,
        )
        .unwrap();
        let planned = plan_lease(&Layout::new("fg:", 16), &tracked.leases[0]);
        assert_eq!(planned.args[8..], [4, 5, 999, 5000]);
        assert_eq!(planned.argv()[12], "00000000000000ff");
        assert_eq!((default_grace_ms(399), default_grace_ms(400), default_grace_ms(60_000)), (0, 100, 250));
        let first = parse_lease_request(
            format!(r#"{{"version":1,"leases":[{{"key":"{KEY}","window_ms":1000,"bucket":0,"elapsed_ms":0,"limit":1,"want":0}}]}}"#).as_bytes(),
            10,
        )
        .unwrap();
        let first = plan_lease(&Layout::new("fg:", 16), &first.leases[0]);
        assert_eq!(first.previous_key, None);
        assert_eq!(first.keys().len(), 2);
        assert_eq!(first.args[10], 250, "the default grace: a quarter window, at most 250 ms");
    }

    #[test]
    fn only_the_asks_of_batched_rules_merge() {
        let planned = |fields: &str| plan_lease(&Layout::new("fg:", 16), &parse_lease_request(entry(fields).as_bytes(), 10).unwrap().leases[0]);
        assert!(planned(r#","want":3,"at_once":3,"exact":true,"holder":"0000000000000000""#).is_ask());
        assert_eq!(planned(r#","want":3,"at_once":3,"exact":true"#).shard, 1);
        for other in [
            r#","want":3,"at_once":3"#,
            r#","want":3,"at_once":2,"exact":true"#,
            r#","want":3,"at_once":3,"exact":true,"returned":1"#,
            r#","want":3,"at_once":3,"exact":true,"returned_previous":1"#,
            r#","want":3,"at_once":3,"exact":true,"consumed":1"#,
            r#","want":3,"at_once":3,"exact":true,"used":1"#,
            r#","want":3,"at_once":3,"exact":true,"used_previous":1"#,
            r#","want":3,"at_once":3,"exact":true,"refunded":1"#,
            r#","want":3,"at_once":3,"exact":true,"refunded_previous":1"#,
        ] {
            assert!(!planned(other).is_ask(), "{other}");
        }
    }

    #[test]
    fn names_the_field_of_every_refusal() {
        for (body, expected) in [
            (entry(""), "leases[0]: missing field `want`"),
            (entry(r#","want":-1"#), "leases[0].want: invalid value"),
            (entry(r#","want":2147483648"#), "leases[0].want: must be within 0..=2147483647"),
            (entry(r#","want":1,"returned_previous":2147483648"#), "leases[0].returned_previous: must be within"),
            (entry(r#","want":1,"extra":1"#), "leases[0].extra: unknown field `extra`"),
            (entry(r#","want":1"#).replace(r#""limit":10"#, r#""limit":0"#), "leases[0].limit: must be within 1..=4294967295"),
            (entry(r#","want":1"#).replace(r#""elapsed_ms":250"#, r#""elapsed_ms":1000"#), "leases[0].elapsed_ms: must be below window_ms (1000), got 1000"),
            (entry(r#","want":1"#).replace(r#""version":1"#, r#""version":2"#), "version: unsupported version 2"),
            (entry(r#","want":1,"holder":"XYZ""#), "leases[0].holder: expected 16 lowercase hex characters"),
            (entry(r#","want":1,"grace_ms":1000"#), "leases[0].grace_ms: must be below window_ms (1000), got 1000"),
            (entry(r#","want":1,"used":-2"#), "leases[0].used: invalid value"),
            (entry(r#","want":1"#).replace(KEY, "xyz"), "leases[0].key: expected 32 lowercase hex characters"),
        ] {
            let err = parse_lease_request(body.as_bytes(), 10).unwrap_err();
            assert!(err.starts_with(expected), "{body}\n  got: {err}\n want: {expected}");
        }
        let err = parse_lease_request(entry(r#","want":1"#).as_bytes(), 0).unwrap_err();
        assert_eq!(err, "leases: at most 0 entries per request, got 1");
    }

    #[test]
    fn answers_serialize_as_the_protocol_says() {
        let answer = LeaseResponse {
            version: VERSION,
            leases: vec![Grant { granted: 3, current: 7, previous: u64::MAX, reclaimed: 9 }],
        };
        assert_eq!(
            serde_json::to_string(&answer).unwrap(),
            r#"{"version":1,"leases":[{"granted":3,"current":7,"previous":18446744073709551615}]}"#
        );
    }
}
