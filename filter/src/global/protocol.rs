//! The wire format between a proxy and `floodgate-sync` (`POST /v1/sync`, JSON; `sync/README.md`
//! is the reference).
//!
//! ```text
//! request:  {"version": 1, "proxy": "<16 hex>", "seq": 42,
//!            "counters": [{"key": "<32 hex>", "window_ms": 60000, "bucket": 28333333, "delta": 17}]}
//! response: {"version": 1, "counters": [{"previous": 120, "current": 37}]}
//! ```
//!
//! `proxy` is the sending source (a flusher VM of one proxy) and `seq` its batch number,
//! strictly increasing: the store applies a (source, seq) batch exactly once, so a batch whose
//! answer was lost is sent again unchanged. The response gives, per counter and in request
//! order, the fleet-wide totals of its bucket (`current`) and of the bucket before (`previous`)
//! after the batch.

use super::FleetKey;
use serde::Deserialize;
use std::fmt::Write as _;

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
}

/// A counter's fleet-wide totals after a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
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
#[serde(deny_unknown_fields)]
struct Response {
    version: u32,
    counters: Vec<Totals>,
}

/// The request body of a batch.
pub fn encode_request(source: u64, seq: u64, counters: &[Counter]) -> String {
    // About 100 bytes per counter.
    let mut out = String::with_capacity(counters.len().saturating_mul(100).saturating_add(80));
    let _ = write!(out, r#"{{"version":{VERSION},"proxy":"{source:016x}","seq":{seq},"counters":["#);
    for (i, c) in counters.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        let _ = write!(
            out,
            r#"{{"key":"{:032x}","window_ms":{},"bucket":{},"delta":{}}}"#,
            c.key.0, c.window_ms, c.bucket, c.delta
        );
    }
    out.push_str("]}");
    out
}

/// The totals of a `200` response to a batch of `sent` counters.
pub fn decode_response(body: &[u8], sent: usize) -> Result<Vec<Totals>, ProtocolError> {
    let response: Response =
        serde_json::from_slice(body).map_err(|e| ProtocolError::Malformed(e.to_string()))?;
    if response.version != VERSION {
        return Err(ProtocolError::Version(response.version));
    }
    if response.counters.len() != sent {
        return Err(ProtocolError::Count {
            sent,
            received: response.counters.len(),
        });
    }
    Ok(response.counters)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn requests_are_the_documented_json() {
        let counters = [
            Counter { key: FleetKey(0x0011_2233_4455_6677_8899_aabb_ccdd_eeff), window_ms: 60_000, bucket: 28_333_333, delta: 17 },
            Counter { key: FleetKey(1), window_ms: 1000, bucket: 7, delta: 0 },
        ];
        let body = encode_request(0xabc, 42, &counters);
        let parsed: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(
            parsed,
            serde_json::json!({"version": 1, "proxy": "0000000000000abc", "seq": 42, "counters": [
                {"key": "00112233445566778899aabbccddeeff", "window_ms": 60000, "bucket": 28333333, "delta": 17},
                {"key": "00000000000000000000000000000001", "window_ms": 1000, "bucket": 7, "delta": 0}
            ]})
        );
        assert_eq!(encode_request(1, 1, &[]), r#"{"version":1,"proxy":"0000000000000001","seq":1,"counters":[]}"#);
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
