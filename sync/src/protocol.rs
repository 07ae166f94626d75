//! The wire protocol of `POST /v1/sync` (version 1): a proxy's batch of counter deltas in, the
//! fleet totals of those counters out. See `sync/README.md` ("Protocol").
//!
//! Parsing is strict: unknown fields, wrong types, another `version`, bad hex and out-of-range
//! values are refused with one line that names the field (`counters[3].key: ...`), before anything
//! reaches Redis.

use serde::de::{self, Deserializer};
use serde::{Deserialize, Serialize};

/// The only protocol version this service speaks.
pub const VERSION: u64 = 1;
/// The longest window a counter may have: 366 days in milliseconds.
pub const MAX_WINDOW_MS: u64 = 31_622_400_000;
/// The largest window bucket (ms since the epoch / `window_ms`): 2^53, exact in a double.
pub const MAX_BUCKET: u64 = 1 << 53;
/// The largest delta of one counter entry: 2^31 − 1.
pub const MAX_DELTA: u64 = 0x7fff_ffff;

/// A proxy's id: exactly 16 lowercase hex characters (a random 64-bit number).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ProxyId(String);

impl ProxyId {
    /// The id as it appears on the wire and in Redis key names.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A counter's key: exactly 32 lowercase hex characters (a 128-bit hash of the rule and the
/// client key, computed by the proxy; opaque here).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CounterKey(String);

impl CounterKey {
    /// The key as it appears on the wire and in Redis key names.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The first 32 bits of the hash (its first 8 hex characters), which choose the shard.
    pub fn high_u32(&self) -> u32 {
        self.0
            .get(..8)
            .and_then(|high| u32::from_str_radix(high, 16).ok())
            .unwrap_or(0)
    }
}

fn is_lower_hex(text: &str, len: usize) -> bool {
    text.len() == len && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

impl TryFrom<String> for ProxyId {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        if is_lower_hex(&text, 16) {
            Ok(ProxyId(text))
        } else {
            Err(format!(
                "expected 16 lowercase hex characters, got {text:?}"
            ))
        }
    }
}

impl TryFrom<String> for CounterKey {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        if is_lower_hex(&text, 32) {
            Ok(CounterKey(text))
        } else {
            Err(format!(
                "expected 32 lowercase hex characters, got {text:?}"
            ))
        }
    }
}

impl<'de> Deserialize<'de> for ProxyId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        ProxyId::try_from(String::deserialize(deserializer)?).map_err(de::Error::custom)
    }
}

impl<'de> Deserialize<'de> for CounterKey {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        CounterKey::try_from(String::deserialize(deserializer)?).map_err(de::Error::custom)
    }
}

/// One counter entry of a batch: add `delta` to (`key`, `window_ms`, `bucket`), then take
/// `refund` off it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a counter object")]
pub struct Counter {
    /// The counter's key.
    pub key: CounterKey,
    /// The window length in milliseconds, 1..=[`MAX_WINDOW_MS`].
    #[serde(deserialize_with = "window_ms")]
    pub window_ms: u64,
    /// The window bucket (ms since the epoch / `window_ms`), at most [`MAX_BUCKET`].
    #[serde(deserialize_with = "bucket")]
    pub bucket: u64,
    /// What to add, 0..=[`MAX_DELTA`] (0 only reads).
    #[serde(deserialize_with = "delta")]
    pub delta: u64,
    /// What to give back after adding `delta`, 0..=[`MAX_DELTA`] (absent: 0): units of the
    /// bucket a proxy reserved and did not use. Never takes the counter below 0, never
    /// creates it.
    #[serde(default, deserialize_with = "delta")]
    pub refund: u64,
}

/// A proxy's batch: `POST /v1/sync`'s body.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, expecting = "a sync batch object")]
pub struct Batch {
    /// Always [`VERSION`].
    #[serde(deserialize_with = "version")]
    pub version: u64,
    /// The proxy that sends the batch.
    pub proxy: ProxyId,
    /// The proxy's batch number, strictly increasing per proxy; a retry resends the same one.
    pub seq: u64,
    /// The counters, in the order the answer gives their totals.
    pub counters: Vec<Counter>,
}

pub(crate) fn ranged<'de, D: Deserializer<'de>>(deserializer: D, min: u64, max: u64) -> Result<u64, D::Error> {
    let value = u64::deserialize(deserializer)?;
    if (min..=max).contains(&value) {
        Ok(value)
    } else {
        Err(de::Error::custom(format!(
            "must be within {min}..={max}, got {value}"
        )))
    }
}

pub(crate) fn window_ms<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    ranged(deserializer, 1, MAX_WINDOW_MS)
}

pub(crate) fn bucket<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    ranged(deserializer, 0, MAX_BUCKET)
}

pub(crate) fn delta<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    ranged(deserializer, 0, MAX_DELTA)
}

pub(crate) fn version<'de, D: Deserializer<'de>>(deserializer: D) -> Result<u64, D::Error> {
    let value = u64::deserialize(deserializer)?;
    if value == VERSION {
        Ok(value)
    } else {
        Err(de::Error::custom(format!(
            "unsupported version {value} (this service speaks version {VERSION})"
        )))
    }
}

/// Parses one JSON value of type `T`, strictly; the error is one line that names the field
/// (`counters[3].key: ...`).
pub(crate) fn parse_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, String> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|err| {
        let path = err.path().to_string();
        let inner = err.into_inner();
        if path == "." {
            inner.to_string()
        } else {
            format!("{path}: {inner}")
        }
    })?;
    deserializer.end().map_err(|err| err.to_string())?;
    Ok(value)
}

/// Parses and validates a request body. The error is one line that names the field.
pub fn parse_batch(body: &[u8], max_counters: usize) -> Result<Batch, String> {
    let batch: Batch = parse_json(body)?;
    if batch.counters.len() > max_counters {
        return Err(format!(
            "counters: at most {max_counters} entries per batch, got {}",
            batch.counters.len()
        ));
    }
    Ok(batch)
}

/// The fleet totals of one request counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Totals {
    /// The total of (key, window_ms, bucket − 1); 0 for bucket 0.
    pub previous: u64,
    /// The total of (key, window_ms, bucket) after the batch.
    pub current: u64,
}

/// `POST /v1/sync`'s answer: one [`Totals`] per request counter, in request order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyncResponse {
    /// Always [`VERSION`].
    pub version: u64,
    /// One entry per request counter, in request order.
    pub counters: Vec<Totals>,
}

/// The body of every error answer: `{"error": "<one line>"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, in one line.
    pub error: String,
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]

    use super::*;

    const KEY: &str = "00112233445566778899aabbccddeeff";
    const PROXY: &str = "0123456789abcdef";

    fn body(counter: &str) -> String {
        format!(r#"{{"version": 1, "proxy": "{PROXY}", "seq": 42, "counters": [{counter}]}}"#)
    }

    fn counter(key: &str, window_ms: &str, bucket: &str, delta: &str) -> String {
        format!(
            r#"{{"key": "{key}", "window_ms": {window_ms}, "bucket": {bucket}, "delta": {delta}}}"#
        )
    }

    fn err(body: &str) -> String {
        parse_batch(body.as_bytes(), 10_000).unwrap_err()
    }

    #[test]
    fn parses_the_example_of_the_protocol() {
        let batch = parse_batch(
            body(&counter(KEY, "60000", "28333333", "17")).as_bytes(),
            10_000,
        )
        .unwrap();
        assert_eq!(batch.version, 1);
        assert_eq!(batch.proxy.as_str(), PROXY);
        assert_eq!(batch.seq, 42);
        assert_eq!(
            batch.counters,
            vec![Counter {
                key: CounterKey(KEY.into()),
                window_ms: 60_000,
                bucket: 28_333_333,
                delta: 17,
                refund: 0
            }]
        );
        let with_refund = parse_batch(
            format!(r#"{{"version":1,"proxy":"{PROXY}","seq":1,"counters":[{{"key":"{KEY}","window_ms":1000,"bucket":3,"delta":0,"refund":70}}]}}"#).as_bytes(),
            10,
        )
        .unwrap();
        assert_eq!(with_refund.counters[0].refund, 70);
    }

    #[test]
    fn accepts_the_bounds_of_every_range() {
        let max = format!("{MAX_DELTA}");
        let bucket = format!("{MAX_BUCKET}");
        let window = format!("{MAX_WINDOW_MS}");
        for (w, b, d) in [
            ("1", "0", "0"),
            (window.as_str(), bucket.as_str(), max.as_str()),
        ] {
            let batch = parse_batch(body(&counter(KEY, w, b, d)).as_bytes(), 10_000).unwrap();
            assert_eq!(batch.counters.len(), 1);
        }
        let empty =
            r#"{"version":1,"proxy":"0123456789abcdef","seq":18446744073709551615,"counters":[]}"#;
        assert_eq!(parse_batch(empty.as_bytes(), 10_000).unwrap().seq, u64::MAX);
    }

    #[test]
    fn names_the_field_of_every_refusal() {
        let cases = [
            (body(&counter(KEY, "0", "1", "1")), "counters[0].window_ms: must be within 1..=31622400000, got 0"),
            (body(&counter(KEY, "31622400001", "1", "1")), "counters[0].window_ms"),
            (body(&counter(KEY, "1000", "9007199254740993", "1")), "counters[0].bucket"),
            (body(&counter(KEY, "1000", "1", "2147483648")), "counters[0].delta: must be within 0..=2147483647"),
            (body(&counter(KEY, "1000", "1", "-1")), "counters[0].delta"),
            (body(&counter(KEY, "1000", "1", "1.5")), "counters[0].delta"),
            (body(&counter(KEY, "1000", "1", "\"1\"")), "counters[0].delta"),
            (body(&counter(&KEY.to_uppercase(), "1000", "1", "1")), "counters[0].key: expected 32 lowercase hex"),
            (body(&counter(&KEY[..31], "1000", "1", "1")), "counters[0].key"),
            (body(&counter(&format!("{KEY}0"), "1000", "1", "1")), "counters[0].key"),
            (body(&counter("0011223344556677889gaabbccddeeff", "1000", "1", "1")), "counters[0].key"),
            (body(r#"{"key": "00112233445566778899aabbccddeeff", "window_ms": 1000, "bucket": 1}"#), "missing field `delta`"),
            (body(r#"{"key": "00112233445566778899aabbccddeeff", "window_ms": 1000, "bucket": 1, "delta": 1, "x": 1}"#), "counters[0]"),
            (body("[]"), "counters[0]"),
            (r#"{"version": 2, "proxy": "0123456789abcdef", "seq": 1, "counters": []}"#.into(), "version: unsupported version 2"),
            (r#"{"version": "1", "proxy": "0123456789abcdef", "seq": 1, "counters": []}"#.into(), "version"),
            (r#"{"version": 1, "proxy": "0123456789ABCDEF", "seq": 1, "counters": []}"#.into(), "proxy: expected 16 lowercase hex"),
            (r#"{"version": 1, "proxy": "0123456789abcde", "seq": 1, "counters": []}"#.into(), "proxy"),
            (r#"{"version": 1, "proxy": "0123456789abcdef", "seq": -1, "counters": []}"#.into(), "seq"),
            (r#"{"version": 1, "proxy": "0123456789abcdef", "seq": 18446744073709551616, "counters": []}"#.into(), "seq"),
            (r#"{"version": 1, "proxy": "0123456789abcdef", "seq": 1, "counters": {}}"#.into(), "counters"),
            (r#"{"version": 1, "proxy": "0123456789abcdef", "seq": 1, "counters": [], "extra": true}"#.into(), "unknown field `extra`"),
            (r#"{"version": 1, "proxy": "0123456789abcdef", "seq": 1}"#.into(), "missing field `counters`"),
            (r#"{"version": 1, "version": 1, "proxy": "0123456789abcdef", "seq": 1, "counters": []}"#.into(), "duplicate field `version`"),
            (r#"{"version": 1, "proxy": "0123456789abcdef", "seq": 1, "counters": []} {}"#.into(), "trailing characters"),
            ("[1]".into(), "expected a sync batch object"),
            ("".into(), "EOF"),
            ("\u{feff}{}".into(), "expected value"),
        ];
        for (body, want) in cases {
            let got = err(&body);
            assert!(got.contains(want), "{body}\n  got:  {got}\n  want: {want}");
            assert!(!got.contains('\n'), "one line: {got}");
        }
    }

    #[test]
    fn refuses_more_counters_than_the_limit() {
        let one = counter(KEY, "1000", "1", "1");
        let three = body(&[one.as_str(), one.as_str(), one.as_str()].join(","));
        assert_eq!(parse_batch(three.as_bytes(), 3).unwrap().counters.len(), 3);
        assert_eq!(
            parse_batch(three.as_bytes(), 2).unwrap_err(),
            "counters: at most 2 entries per batch, got 3"
        );
    }

    #[test]
    fn the_shard_hash_is_the_first_32_bits() {
        assert_eq!(CounterKey(KEY.into()).high_u32(), 0x0011_2233);
        let all_f = CounterKey("f".repeat(32));
        assert_eq!(all_f.high_u32(), u32::MAX);
    }

    /// Compact, fields in declaration order: the filter reads exactly this form without a JSON
    /// parser (`decode_compact` in `filter/src/fleet/batched/protocol.rs`) and any other, more slowly,
    /// through serde_json.
    #[test]
    fn answers_serialize_as_the_protocol_says() {
        let answer = SyncResponse {
            version: 1,
            counters: vec![
                Totals {
                    previous: 120,
                    current: 37,
                },
                Totals {
                    previous: 0,
                    current: u64::MAX,
                },
            ],
        };
        assert_eq!(
            serde_json::to_string(&answer).unwrap(),
            r#"{"version":1,"counters":[{"previous":120,"current":37},{"previous":0,"current":18446744073709551615}]}"#
        );
    }
}
