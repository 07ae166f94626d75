//! The body of `POST /v1/lease` and its answer (`sync/README.md`, "Leases"): written byte by
//! byte like the batches ([`crate::fleet::protocol`]), read with serde_json (one small answer
//! per call).

use super::{Ask, Grant};
use crate::fleet::protocol::{push_decimal, push_hex, Carried};
use crate::ratelimit::window::Counts;
use serde::Deserialize;

/// The protocol version.
pub const VERSION: u64 = 1;
/// The path of `floodgate-sync`'s lease endpoint.
pub const LEASE_PATH: &str = "/v1/lease";

/// The request body of `asks`, from the proxy `holder` (its id, the same on every worker).
pub fn body(asks: &[Ask], holder: u64) -> Vec<u8> {
    write(asks.iter().map(|ask| (ask, None)), holder, false)
}

/// The request body of the asks of batched rules ([`crate::fleet::batched::ask`]): each entry
/// `exact`, granted whole (its `want`, taken at once) or not at all.
/// Each names the units of its key in this proxy's batch on its way, if any.
pub fn exact_body(asks: &[(Ask, Option<Carried>)]) -> Vec<u8> {
    write(asks.iter().map(|(ask, carried)| (ask, carried.as_ref())), 0, true)
}

fn write<'a>(asks: impl ExactSizeIterator<Item = (&'a Ask, Option<&'a Carried>)>, holder: u64, exact: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(asks.len().saturating_mul(200).saturating_add(32));
    out.extend_from_slice(b"{\"version\":1,\"leases\":[");
    for (n, (ask, carried)) in asks.enumerate() {
        if n > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"key\":\"");
        push_hex(&mut out, ask.key.0, 32);
        for (name, value) in [
            ("\",\"window_ms\":", ask.window_ms),
            (",\"bucket\":", ask.bucket),
            (",\"elapsed_ms\":", ask.elapsed_ms),
            (",\"limit\":", u64::from(ask.limit)),
            (",\"want\":", u64::from(ask.want)),
            (",\"consumed\":", u64::from(ask.consumed)),
            (",\"returned\":", u64::from(ask.returned)),
            (",\"returned_previous\":", u64::from(ask.returned_previous)),
            (",\"used\":", u64::from(ask.used)),
            (",\"used_previous\":", u64::from(ask.used_previous)),
            (",\"grace_ms\":", ask.grace_ms),
            (",\"at_once\":", u64::from(ask.at_once)),
        ] {
            out.extend_from_slice(name.as_bytes());
            push_decimal(&mut out, value);
        }
        // Written only when not 0: a floodgate-sync that does not know them refuses the call.
        for (name, value) in [(",\"refunded\":", ask.refunded), (",\"refunded_previous\":", ask.refunded_previous)] {
            if value > 0 {
                out.extend_from_slice(name.as_bytes());
                push_decimal(&mut out, u64::from(value));
            }
        }
        // Written only when set: a floodgate-sync that does not know it refuses the call.
        if exact {
            out.extend_from_slice(b",\"exact\":true");
        }
        // Written only when set: a floodgate-sync that does not know it refuses the call.
        if let Some(carried) = carried {
            carried.write(&mut out);
        }
        out.extend_from_slice(b",\"holder\":\"");
        push_hex(&mut out, u128::from(holder), 16);
        out.extend_from_slice(b"\"}");
    }
    out.extend_from_slice(b"]}");
    out
}

#[derive(Deserialize)]
struct Answer {
    version: u64,
    leases: Vec<AnswerGrant>,
}

#[derive(Deserialize)]
struct AnswerGrant {
    granted: u64,
    current: u64,
    previous: u64,
}

/// The grants of an answer, one per ask in order, or why it is not one.
pub fn decode(bytes: &[u8], asks: usize) -> Result<Vec<Grant>, String> {
    let answer: Answer = serde_json::from_slice(bytes).map_err(|e| format!("lease answer: {e}"))?;
    if answer.version != VERSION {
        return Err(format!("lease answer: version {} (this filter speaks {VERSION})", answer.version));
    }
    if answer.leases.len() != asks {
        return Err(format!("lease answer: {} grants for {asks} keys", answer.leases.len()));
    }
    let clamp = |n: u64| u32::try_from(n).unwrap_or(u32::MAX);
    Ok(answer
        .leases
        .iter()
        .map(|g| Grant { granted: clamp(g.granted), counts: Counts { previous: clamp(g.previous), current: clamp(g.current) } })
        .collect())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::keys::fleet::FleetKey;

    #[test]
    fn the_body_is_the_documented_json() {
        let ask = Ask {
            key: FleetKey(0x0123_4567_89ab_cdef_0011_2233_4455_6677),
            window_ms: 60_000,
            bucket: 29_000_000,
            elapsed_ms: 1_500,
            limit: u32::MAX,
            want: 12,
            consumed: 3,
            returned: 2,
            returned_previous: 1,
            used: 7,
            used_previous: 8,
            grace_ms: 200,
            at_once: 1,
            refunded: 0,
            refunded_previous: 0,
            call: 9,
        };
        let body = body(&[ask, Ask { want: 0, refunded: 4, refunded_previous: 5, ..ask }], 0xfeed_0000_0000_00ab);
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            value,
            serde_json::json!({"version": 1, "leases": [
                {"key": "0123456789abcdef0011223344556677", "window_ms": 60000, "bucket": 29000000, "elapsed_ms": 1500,
                 "limit": 4294967295u64, "want": 12, "consumed": 3, "returned": 2, "returned_previous": 1,
                 "used": 7, "used_previous": 8, "grace_ms": 200, "at_once": 1, "holder": "feed0000000000ab"},
                {"key": "0123456789abcdef0011223344556677", "window_ms": 60000, "bucket": 29000000, "elapsed_ms": 1500,
                 "limit": 4294967295u64, "want": 0, "consumed": 3, "returned": 2, "returned_previous": 1,
                 "used": 7, "used_previous": 8, "grace_ms": 200, "at_once": 1, "refunded": 4, "refunded_previous": 5,
                 "holder": "feed0000000000ab"}
            ]})
        );
        // An ask of a batched rule names its proxy's batch on its way, when it carries units.
        let carried = Carried { source: 0xab, seq: 18_446_744_073_709_551_615, units: 30, longest_window_ms: 3_600_000 };
        let body = exact_body(&[(ask, Some(carried)), (ask, None)]);
        let value: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(value["leases"][0]["exact"], true);
        assert_eq!(
            value["leases"][0]["carried"],
            serde_json::json!({"proxy": "00000000000000ab", "seq": 18_446_744_073_709_551_615u64, "units": 30, "longest_window_ms": 3_600_000})
        );
        assert!(value["leases"][1].get("carried").is_none());
    }

    #[test]
    fn answers_are_read_and_checked() {
        let grants = decode(br#"{"version":1,"leases":[{"granted":3,"current":10,"previous":99999999999}]}"#, 1).unwrap();
        assert_eq!(grants, [Grant { granted: 3, counts: Counts { previous: u32::MAX, current: 10 } }]);
        assert!(decode(br#"{"version":2,"leases":[]}"#, 0).unwrap_err().contains("version 2"));
        assert!(decode(br#"{"version":1,"leases":[]}"#, 1).unwrap_err().contains("0 grants for 1 keys"));
        assert!(decode(b"not json", 1).is_err());
    }
}
