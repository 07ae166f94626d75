//! `GET /v1/holders`: who holds a leased key's units, for an operator. The key is named as the
//! proxies send it (`key`: 32 hex characters, with `window_ms`, the rule's window in ms), or as
//! the store names its counter (`<prefix>{<shard>}:<key>:<window_ms>:<bucket>`, as `redis-cli
//! --scan` lists it). The answer shows the key's current bucket (or the counter's) and the one
//! before: each bucket's counter (units granted and not given back), and each holder (a proxy
//! that leases the key) with its units outstanding and when its entry expires.

use serde::Serialize;

use crate::layout::Layout;
use crate::protocol::CounterKey;

/// What `GET /v1/holders` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HoldersQuery {
    /// The counter key.
    pub key: CounterKey,
    /// The rule's window, in ms.
    pub window_ms: u64,
    /// The bucket asked for (a counter named in full), else the current one.
    pub bucket: Option<u64>,
}

/// One bucket's holders.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BucketHolders {
    /// The bucket (`unix ms / window_ms`).
    pub bucket: u64,
    /// Its counter's key in the store.
    pub counter: String,
    /// The counter: units granted in the bucket and not given back (0 when absent).
    pub count: u64,
    /// Each holder, by its id (one per proxy), most units first.
    pub holders: Vec<Holder>,
}

/// One holder of a bucket's units.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Holder {
    /// The proxy's holder id (16 hex characters).
    pub holder: String,
    /// Its units outstanding: granted, less given back, less reported used.
    pub units: u64,
    /// When its entry expires (the bucket's holders hash), in ms since the epoch; `null`
    /// without an expiry.
    pub expires_at_ms: Option<u64>,
}

/// The answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HoldersAnswer {
    /// The key.
    pub key: String,
    /// The window, in ms.
    pub window_ms: u64,
    /// The bucket asked for (the current one, or the counter's), then the one before.
    pub buckets: Vec<BucketHolders>,
}

/// Parses the query string (`key=...&window_ms=...`); the error names the parameter.
pub fn parse_holders_query(query: Option<&str>, layout: &Layout) -> Result<HoldersQuery, String> {
    let (mut key, mut window) = (None, None);
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = percent_decode(value).ok_or_else(|| format!("{name}: not valid percent-encoding"))?;
        match name {
            "key" => key = Some(value),
            "window_ms" => window = Some(value),
            other => return Err(format!("{other}: unknown parameter (key, window_ms)")),
        }
    }
    let key = key.ok_or("key: required (32 hex characters, or a counter's key in the store)")?;
    let window = window
        .map(|w| w.parse::<u64>().ok().filter(|w| *w > 0).ok_or(format!("window_ms: expected a positive integer, got {w:?}")))
        .transpose()?;
    if let Ok(counter) = CounterKey::try_from(key.clone()) {
        let window_ms = window.ok_or("window_ms: required with a 32-hex key (the rule's window in ms)")?;
        return Ok(HoldersQuery { key: counter, window_ms, bucket: None });
    }
    // A counter's key in the store: <prefix>{<shard>}:<key>:<window_ms>:<bucket>.
    let not_counter = || format!("key: expected 32 lowercase hex characters or a counter's key under the prefix {:?}, got {key:?}", layout.prefix());
    let rest = key.strip_prefix(layout.prefix()).ok_or_else(not_counter)?;
    let rest = rest.strip_prefix('{').and_then(|r| r.split_once("}:")).map(|(_, r)| r).ok_or_else(not_counter)?;
    let mut parts = rest.split(':');
    let (Some(hex), Some(window_ms), Some(bucket), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return Err(not_counter());
    };
    let counter = CounterKey::try_from(hex.to_owned()).map_err(|_| not_counter())?;
    let window_ms = window_ms.parse::<u64>().ok().filter(|w| *w > 0).ok_or_else(not_counter)?;
    let bucket = bucket.parse::<u64>().map_err(|_| not_counter())?;
    if window.is_some_and(|w| w != window_ms) {
        return Err(format!("window_ms: {} does not match the counter's window {window_ms}", window.unwrap_or(0)));
    }
    Ok(HoldersQuery { key: counter, window_ms, bucket: Some(bucket) })
}

/// The counters' keys of the buckets the query shows at `now_ms`: the bucket, then the one
/// before (none before bucket 0).
pub fn buckets(query: &HoldersQuery, layout: &Layout, now_ms: u64) -> Vec<(u64, String)> {
    let bucket = query.bucket.unwrap_or(now_ms.checked_div(query.window_ms).unwrap_or(0));
    let shard = layout.shard(&query.key);
    [Some(bucket), bucket.checked_sub(1)]
        .into_iter()
        .flatten()
        .map(|b| (b, layout.counter_key(shard, &query.key, query.window_ms, b)))
        .collect()
}

fn percent_decode(text: &str) -> Option<String> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while let Some(&b) = bytes.get(at) {
        if b == b'%' {
            let hex = text.get(at.saturating_add(1)..at.saturating_add(3))?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            at = at.saturating_add(3);
        } else {
            out.push(if b == b'+' { b' ' } else { b });
            at = at.saturating_add(1);
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const KEY: &str = "00000003aaaaaaaaaaaaaaaaaaaaaaaa";

    #[test]
    fn a_key_with_its_window_or_a_counter_s_key_names_the_buckets() {
        let layout = Layout::new("fg:", 16);
        let query = parse_holders_query(Some(&format!("key={KEY}&window_ms=60000")), &layout).unwrap();
        assert_eq!(query.window_ms, 60_000);
        assert_eq!(
            buckets(&query, &layout, 60_000 * 7 + 5),
            vec![(7, format!("fg:{{3}}:{KEY}:60000:7")), (6, format!("fg:{{3}}:{KEY}:60000:6"))]
        );
        let counter = format!("fg:%7B3%7D:{KEY}:60000:4");
        let query = parse_holders_query(Some(&format!("key={counter}")), &layout).unwrap();
        assert_eq!(query.bucket, Some(4));
        assert_eq!(buckets(&query, &layout, u64::MAX), vec![(4, format!("fg:{{3}}:{KEY}:60000:4")), (3, format!("fg:{{3}}:{KEY}:60000:3"))]);
        let query = parse_holders_query(Some(&format!("key=fg:{{3}}:{KEY}:1000:0")), &layout).unwrap();
        assert_eq!(buckets(&query, &layout, 0).len(), 1, "no bucket before 0");
    }

    #[test]
    fn a_bad_query_is_refused_naming_the_parameter() {
        let layout = Layout::new("fg:", 16);
        let error = |query: &str| parse_holders_query(Some(query), &layout).unwrap_err();
        assert!(error("").starts_with("key: required"));
        assert!(error(&format!("key={KEY}")).starts_with("window_ms: required"));
        assert!(error(&format!("key={KEY}&window_ms=0")).starts_with("window_ms: expected"));
        assert!(error("key=tenant-a&window_ms=1000").starts_with("key: expected"));
        assert!(error(&format!("key=other:{{3}}:{KEY}:60000:4")).starts_with("key: expected"));
        assert!(error(&format!("key=fg:{{3}}:{KEY}:60000:4&window_ms=1000")).starts_with("window_ms: 1000 does not match"));
        assert!(error("limit=3").starts_with("limit: unknown parameter"));
        assert!(error("key=%zz").starts_with("key: not valid"));
    }
}
