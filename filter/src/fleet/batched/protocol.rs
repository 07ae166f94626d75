//! The wire format between a proxy and `floodgate-sync` (`POST /v1/sync`, JSON; `sync/README.md`
//! is the reference).
//!
//! ```text
//! request:  {"version": 1, "proxy": "<16 hex>", "seq": 42,
//!            "counters": [{"key": "<32 hex>", "window_ms": 60000, "bucket": 28333333, "delta": 17},
//!                         {"key": "<32 hex>", "window_ms": 60000, "bucket": 28333332, "delta": 0, "refund": 70}]}
//! response: {"version": 1, "counters": [{"previous": 120, "current": 37}]}
//! ```
//!
//! `proxy` is the sending source (a flusher VM of one proxy) and `seq` its batch number,
//! strictly increasing: the store applies a (source, seq) batch exactly once, so a batch whose
//! answer was lost is sent again unchanged. The response gives, per counter and in request
//! order, the fleet-wide totals of its bucket (`current`) and of the bucket before (`previous`)
//! after the batch. `refund` (written only when not 0) gives units back: the store takes them
//! off the counter after adding `delta`, never below zero and never creating it; a
//! floodgate-sync that does not know the field refuses the whole batch (`400`, naming it) and
//! applies nothing of it.
//!
//! Rationale: docs/design.md, section "Batched consistency".

use crate::fleet::protocol::{push_decimal, push_hex};
use crate::keys::fleet::FleetKey;
use serde::Deserialize;

/// The protocol version this build speaks.
pub const VERSION: u32 = 1;

/// One counter of a batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counter {
    /// The fleet-wide key.
    pub key: FleetKey,
    /// The rule's window.
    pub window_ms: u64,
    /// The window bucket (ms since the epoch / window).
    pub bucket: u64,
    /// Requests to add (0: only read the totals).
    pub delta: u32,
    /// Units to give back (written only when not 0).
    pub refund: u32,
}

/// A counter's fleet-wide totals after a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
pub struct Totals {
    /// The total of the bucket before the counter's.
    pub previous: u64,
    /// The total of the counter's bucket.
    pub current: u64,
}

/// Why a response could not be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProtocolError {
    /// Not the JSON this build expects.
    Malformed(String),
    /// Another protocol version.
    Version(u32),
    /// Not one total per counter.
    Count {
        /// Counters sent.
        sent: usize,
        /// Totals received.
        received: usize,
    },
}

impl std::fmt::Display for ProtocolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ProtocolError::Malformed(why) => write!(f, "malformed response: {why}"),
            ProtocolError::Version(v) => write!(f, "protocol version {v} (this build speaks {VERSION})"),
            ProtocolError::Count { sent, received } => {
                write!(f, "{received} totals for {sent} counters")
            }
        }
    }
}

#[derive(Deserialize)]
#[cfg_attr(test, derive(serde::Serialize))]
#[serde(deny_unknown_fields)]
struct Response {
    version: u32,
    counters: Vec<Totals>,
}

/// The request body of a batch. Written byte by byte: `core::fmt` took about 1 500 instructions
/// per counter, as much as the rest of an interval's work on the key.
pub fn encode_request(source: u64, seq: u64, counters: &[Counter]) -> Vec<u8> {
    // About 100 bytes per counter.
    let mut out = Vec::with_capacity(counters.len().saturating_mul(100).saturating_add(80));
    out.extend_from_slice(br#"{"version":"#);
    push_decimal(&mut out, u64::from(VERSION));
    out.extend_from_slice(br#","proxy":""#);
    push_hex(&mut out, u128::from(source), 16);
    out.extend_from_slice(br#"","seq":"#);
    push_decimal(&mut out, seq);
    out.extend_from_slice(br#","counters":["#);
    for (i, c) in counters.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(br#"{"key":""#);
        push_hex(&mut out, c.key.0, 32);
        out.extend_from_slice(br#"","window_ms":"#);
        push_decimal(&mut out, c.window_ms);
        out.extend_from_slice(br#","bucket":"#);
        push_decimal(&mut out, c.bucket);
        out.extend_from_slice(br#","delta":"#);
        push_decimal(&mut out, u64::from(c.delta));
        if c.refund > 0 {
            out.extend_from_slice(br#","refund":"#);
            push_decimal(&mut out, u64::from(c.refund));
        }
        out.push(b'}');
    }
    out.extend_from_slice(b"]}");
    out
}

/// The totals of a `200` response to a batch of `sent` counters. The compact form
/// `floodgate-sync` writes is read by `decode_compact` (serde_json took about 1 200
/// instructions per counter); anything else, other spacing included, by serde_json, which also
/// names what is wrong.
pub fn decode_response(body: &[u8], sent: usize) -> Result<Vec<Totals>, ProtocolError> {
    let counters = match decode_compact(body, sent) {
        Some(counters) => counters,
        None => {
            let response: Response =
                serde_json::from_slice(body).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
            if response.version != VERSION {
                return Err(ProtocolError::Version(response.version));
            }
            response.counters
        }
    };
    if counters.len() != sent {
        return Err(ProtocolError::Count {
            sent,
            received: counters.len(),
        });
    }
    Ok(counters)
}

/// `{"version":1,"counters":[{"previous":120,"current":37},...]}` exactly (trailing whitespace
/// allowed), as serde_json writes [`Response`] for this version; `None` for anything else.
fn decode_compact(body: &[u8], sent: usize) -> Option<Vec<Totals>> {
    let mut rest = body.strip_prefix(br#"{"version":1,"counters":["#)?;
    let mut counters = Vec::with_capacity(sent);
    if let Some(after) = rest.strip_prefix(b"]}") {
        rest = after;
    } else {
        loop {
            let (previous, after) = number(rest.strip_prefix(br#"{"previous":"#)?)?;
            let (current, after) = number(after.strip_prefix(br#","current":"#)?)?;
            counters.push(Totals { previous, current });
            rest = after.strip_prefix(b"}")?;
            if let Some(after) = rest.strip_prefix(b",") {
                rest = after;
            } else {
                rest = rest.strip_prefix(b"]}")?;
                break;
            }
        }
    }
    rest.iter().all(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r')).then_some(counters)
}

// `decode_compact`'s prefix names the version.
const _: () = assert!(VERSION == 1, "decode_compact reads version 1 only");

/// A JSON number that is a `u64` (no sign, fraction, exponent nor leading zero) at the start of
/// `bytes`, and what follows it.
fn number(bytes: &[u8]) -> Option<(u64, &[u8])> {
    let len = bytes.iter().take_while(|b| b.is_ascii_digit()).count();
    let (digits, rest) = bytes.split_at_checked(len)?;
    if digits.is_empty() || (digits.len() > 1 && digits.first() == Some(&b'0')) || matches!(rest.first(), Some(b'.' | b'e' | b'E')) {
        return None;
    }
    let value = digits.iter().try_fold(0u64, |n, d| n.checked_mul(10)?.checked_add(u64::from(d.saturating_sub(b'0'))))?;
    Some((value, rest))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_the_documented_json() {
        let counters = [
            Counter { key: FleetKey(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff), window_ms: 60_000, bucket: 28_333_333, delta: 17, refund: 0 },
            Counter { key: FleetKey(1), window_ms: 1000, bucket: 7, delta: 0, refund: 0 },
            Counter { key: FleetKey(2), window_ms: 1000, bucket: 6, delta: 3, refund: 70 },
        ];
        let body = encode_request(0xabc, 42, &counters);
        let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            parsed,
            serde_json::json!({"version": 1, "proxy": "0000000000000abc", "seq": 42, "counters": [
                {"key": "00112233445566778899aabbccddeeff", "window_ms": 60000, "bucket": 28333333, "delta": 17},
                {"key": "00000000000000000000000000000001", "window_ms": 1000, "bucket": 7, "delta": 0},
                {"key": "00000000000000000000000000000002", "window_ms": 1000, "bucket": 6, "delta": 3, "refund": 70}
            ]})
        );
        assert_eq!(encode_request(1, 1, &[]), br#"{"version":1,"proxy":"0000000000000001","seq":1,"counters":[]}"#);
    }

    #[test]
    fn the_compact_answer_is_read_without_serde_and_anything_else_with_it() {
        let compact = br#"{"version":1,"counters":[{"previous":0,"current":18446744073709551615},{"previous":7,"current":10}]}"#;
        let want = vec![Totals { previous: 0, current: u64::MAX }, Totals { previous: 7, current: 10 }];
        assert_eq!(decode_compact(compact, 2), Some(want.clone()));
        assert_eq!(decode_compact(br#"{"version":1,"counters":[]}"#, 0), Some(vec![]));
        assert_eq!(decode_compact(b"{\"version\":1,\"counters\":[]}\n", 0), Some(vec![]));
        // Other spacing, order or versions, leading zeros, fractions, overflow: serde_json's.
        for other in [
            &br#"{"version": 1, "counters": [{"previous": 0, "current": 1}]}"#[..],
            br#"{"counters":[{"previous":0,"current":1}],"version":1}"#,
            br#"{"version":1,"counters":[{"current":1,"previous":0}]}"#,
            br#"{"version":2,"counters":[]}"#,
            br#"{"version":1,"counters":[{"previous":01,"current":1}]}"#,
            br#"{"version":1,"counters":[{"previous":1.0,"current":1}]}"#,
            br#"{"version":1,"counters":[{"previous":1e2,"current":1}]}"#,
            br#"{"version":1,"counters":[{"previous":18446744073709551616,"current":1}]}"#,
            br#"{"version":1,"counters":[{"previous":1,"current":1},]}"#,
            br#"{"version":1,"counters":[]}x"#,
            b"{\"version\":1,\"counters\":[]}\x0c",
            br#"{"version":1,"counters":[{"previous":-0,"current":1}]}"#,
            br#"{"version":1,"counters":[{"previous":1, "current":1}]}"#,
        ] {
            assert_eq!(decode_compact(other, 1), None, "{}", String::from_utf8_lossy(other));
        }
        assert_eq!(
            decode_response(br#"{"version": 1, "counters": [{"current": 1, "previous": 0}]}"#, 1),
            Ok(vec![Totals { previous: 0, current: 1 }])
        );
    }

    proptest::proptest! {
        #[test]
        fn the_fast_paths_agree_with_serde_json(
            counters in proptest::collection::vec((proptest::prelude::any::<u128>(), 1..u64::MAX, proptest::prelude::any::<u64>(), proptest::prelude::any::<u32>()), 0..8),
            totals in proptest::collection::vec((proptest::prelude::any::<u64>(), proptest::prelude::any::<u64>()), 0..8),
            source in proptest::prelude::any::<u64>(),
            seq in proptest::prelude::any::<u64>(),
            at in proptest::prelude::any::<usize>(),
            byte in proptest::prelude::any::<u8>(),
            damage in 0..3u8,
        ) {
            let counters: Vec<Counter> = counters.into_iter().map(|(k, w, b, d)| Counter { key: FleetKey(k), window_ms: w, bucket: b, delta: d, refund: 0 }).collect();
            let body: serde_json::Value = serde_json::from_slice(&encode_request(source, seq, &counters)).unwrap();
            let want = serde_json::json!({"version": VERSION, "proxy": format!("{source:016x}"), "seq": seq, "counters":
                counters.iter().map(|c| serde_json::json!({"key": format!("{:032x}", c.key.0), "window_ms": c.window_ms, "bucket": c.bucket, "delta": c.delta})).collect::<Vec<_>>()});
            proptest::prop_assert_eq!(body, want);

            let totals: Vec<Totals> = totals.into_iter().map(|(previous, current)| Totals { previous, current }).collect();
            let bytes = serde_json::to_vec(&Response { version: VERSION, counters: totals.clone() }).unwrap();
            proptest::prop_assert_eq!(decode_compact(&bytes, totals.len()), Some(totals.clone()));
            // A damaged answer: whatever the fast path reads, serde_json reads the same.
            let mut damaged = bytes.clone();
            let at = at % damaged.len();
            match damage {
                0 => damaged[at] = byte,
                1 => damaged.insert(at, byte),
                _ => damaged.truncate(at),
            }
            if let Some(fast) = decode_compact(&damaged, 0) {
                let slow: Response = serde_json::from_slice(&damaged).unwrap();
                proptest::prop_assert_eq!(slow.version, VERSION);
                proptest::prop_assert_eq!(fast, slow.counters);
            }
        }
    }

    #[test]
    fn responses_are_checked() {
        let ok = br#"{"version": 1, "counters": [{"previous": 120, "current": 37}]}"#;
        assert_eq!(decode_response(ok, 1), Ok(vec![Totals { previous: 120, current: 37 }]));
        assert_eq!(decode_response(ok, 2), Err(ProtocolError::Count { sent: 2, received: 1 }));
        assert_eq!(
            decode_response(br#"{"version": 2, "counters": []}"#, 0),
            Err(ProtocolError::Version(2))
        );
        for bad in [&b""[..], b"{", br#"{"version":1}"#, br#"{"version":1,"counters":[{"previous":-1,"current":0}]}"#,
            br#"{"version":1,"counters":[],"extra":1}"#, b"\xff\xfe"] {
            assert!(matches!(decode_response(bad, 0), Err(ProtocolError::Malformed(_))), "{bad:?}");
        }
    }
}
