//! The estimate a request reserves, read from its JSON body (`cost.estimate.body`, or the
//! weighted sum `cost.estimate.sum`): an LLM request's `max_tokens` or `max_completion_tokens`.
//! Each rule that applies and reads its estimate there gets one streaming scan of its places
//! ([`crate::ratelimit::usage`], the same fixed-memory scanner that reads the counts of
//! responses); the request waits, its body held by the host, until every such rule's estimate
//! is known.
//!
//! Invariants: memory is fixed whatever the body (a few counters per listed place); at most the
//! configured number of bytes is read (`max_body_bytes`); a term's count is the value at the
//! first of its places the body holds, known as soon as that place's value is read, else when
//! the body ends or the bound is reached; a body that is not JSON ends the reading at once
//! (with what was read before, usually no estimate: the rule's `default`). Nothing here reads
//! the host.
//!
//! Rationale: docs/llm.md, "The estimate in the request body".

use crate::ratelimit::usage::{Format, Scan, Total, Usage, UsageScan};

/// What a request body held at a rule's places.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Found {
    /// A count.
    Count(u32),
    /// A value that is not a count (`-1`, `1e9`, `"abc"`).
    Invalid,
}

/// One rule's scan of the body.
#[derive(Clone, Debug, PartialEq, Eq)]
struct RuleReading {
    rule: usize,
    scan: UsageScan,
    /// Known: `Some(found)` (or `Some(None)`: the body holds no count for a term).
    known: Option<Option<Found>>,
}

impl RuleReading {
    /// The estimate the places read so far tell.
    fn value(&self) -> Option<Found> {
        match self.scan.total() {
            Total::Count(count) => Some(Found::Count(count)),
            Total::Invalid => Some(Found::Invalid),
            Total::Missing => None,
        }
    }

    /// Whether the estimate is known before the body ends: each term's first place has a
    /// value, or no place can have one any more (a body that is not JSON).
    fn settle_early(&mut self) {
        if self.known.is_none() && !self.scan.reading() {
            self.known = Some(self.value());
        }
    }
}

/// The request body's estimates for the rules that read it, as the body streams.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BodyEstimates {
    rules: Vec<RuleReading>,
    /// Bytes read so far.
    read: u64,
    /// Bytes of the body the host holds so far.
    held: usize,
    /// The most bytes any of the rules reads.
    max_bytes: u64,
    /// Every rule's estimate is known: the request is decided with them.
    done: bool,
}

impl BodyEstimates {
    /// The readings of `rules` (each rule's index, its places and its byte bound); `None` if
    /// there are none.
    pub fn new<'u>(rules: impl IntoIterator<Item = (usize, &'u Usage, u64)>) -> Option<BodyEstimates> {
        let mut max_bytes = 0;
        let rules: Vec<RuleReading> = rules
            .into_iter()
            .map(|(rule, usage, bytes)| {
                max_bytes = max_bytes.max(bytes);
                RuleReading { rule, scan: UsageScan::new(Format::Json, usage, bytes), known: None }
            })
            .collect();
        (!rules.is_empty()).then_some(BodyEstimates { rules, read: 0, held: 0, max_bytes, done: false })
    }

    /// Whether every estimate is known.
    pub fn done(&self) -> bool {
        self.done
    }

    /// The bytes of the body the host holds so far (as the last [`BodyEstimates::hold`] said).
    pub fn held(&self) -> usize {
        self.held
    }

    /// Whether any of the body came.
    pub fn started(&self) -> bool {
        self.held > 0 || self.read > 0
    }

    /// The body will not be read: no rule found an estimate in it.
    pub fn give_up(&mut self) {
        for reading in &mut self.rules {
            reading.known = Some(None);
        }
        self.done = true;
    }

    /// The host holds `body_size` bytes of the body so far.
    pub fn hold(&mut self, body_size: usize) {
        self.held = self.held.max(body_size);
    }

    /// The bytes of a body of `body_size` bytes so far to read next: from `start`, `len` bytes
    /// (at most up to the bound); `None` when nothing more is read.
    pub fn wants(&self, body_size: usize) -> Option<(usize, usize)> {
        if self.done {
            return None;
        }
        let start = usize::try_from(self.read).unwrap_or(usize::MAX);
        let end = body_size.min(usize::try_from(self.max_bytes).unwrap_or(usize::MAX));
        (end > start).then(|| (start, end.saturating_sub(start)))
    }

    /// Reads the next bytes of the body (`places(rule)`: rule `rule`'s places); `end`: the
    /// body ended. Returns whether every estimate is known.
    pub fn feed<'p>(&mut self, chunk: &[u8], end: bool, places: impl Fn(usize) -> &'p Usage) -> bool {
        if self.done {
            return true;
        }
        self.read = self.read.saturating_add(u64::try_from(chunk.len()).unwrap_or(u64::MAX));
        for reading in self.rules.iter_mut().filter(|r| r.known.is_none()) {
            let usage = places(reading.rule);
            if let Scan::Found(_) | Scan::Invalid | Scan::Gave(_) = reading.scan.feed(chunk, usage) {
                reading.settle_early();
            }
        }
        let bound = self.read >= self.max_bytes;
        if end || bound || self.rules.iter().all(|r| r.known.is_some()) {
            for reading in self.rules.iter_mut().filter(|r| r.known.is_none()) {
                reading.scan.end(places(reading.rule));
                reading.known = Some(reading.value());
            }
            self.done = true;
        }
        self.done
    }

    /// What the body held for rule `rule` (`None`: none of its places, or it reads no body).
    pub fn found(&self, rule: usize) -> Option<Found> {
        self.rules.iter().find(|r| r.rule == rule).and_then(|r| r.known.flatten())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn read(body: &str, places: &[&str], max_bytes: u64, chunk: usize) -> (Option<Found>, u64) {
        read_usage(body, &Usage::first_of(places.iter().copied()), max_bytes, chunk)
    }

    fn read_usage(body: &str, paths: &Usage, max_bytes: u64, chunk: usize) -> (Option<Found>, u64) {
        let mut estimates = BodyEstimates::new([(3, paths, max_bytes)]).unwrap();
        let bytes = body.as_bytes();
        let mut done = false;
        while !done {
            let Some((start, len)) = estimates.wants(bytes.len()) else {
                estimates.feed(&[], true, |_| paths);
                break;
            };
            let part = &bytes[start..start + len.min(chunk)];
            let end = start + part.len() == bytes.len();
            done = estimates.feed(part, end, |_| paths);
        }
        assert!(estimates.done());
        (estimates.found(3), estimates.read)
    }

    #[test]
    fn the_first_listed_place_the_body_holds() {
        let both = r#"{"max_tokens":100,"messages":[{"role":"user","content":"hi"}],"max_completion_tokens":70}"#;
        for chunk in [1, 3, 1000] {
            assert_eq!(read(both, &["max_completion_tokens", "max_tokens"], 1 << 20, chunk).0, Some(Found::Count(70)));
            assert_eq!(read(both, &["max_tokens", "max_completion_tokens"], 1 << 20, chunk).0, Some(Found::Count(100)));
        }
        let legacy = r#"{"messages":[],"max_tokens":100}"#;
        assert_eq!(read(legacy, &["max_completion_tokens", "max_tokens"], 1 << 20, 4).0, Some(Found::Count(100)));
        assert_eq!(read(r#"{"options":{"num_predict":9}}"#, &["options.num_predict"], 1 << 20, 2).0, Some(Found::Count(9)));
    }

    #[test]
    fn known_as_soon_as_the_first_place_is_read() {
        let body = format!(r#"{{"max_tokens":100,"messages":"{}"}}"#, "x".repeat(10_000));
        let (found, read_bytes) = read(&body, &["max_tokens"], 1 << 20, 64);
        assert_eq!(found, Some(Found::Count(100)));
        assert!(read_bytes <= 64, "read {read_bytes} bytes");
    }

    #[test]
    fn no_estimate_from_bad_bodies_and_values() {
        for bad in ["-1", "1e9", "\"abc\"", "1.5", "4294967296", "true", "{}"] {
            let body = format!(r#"{{"model":"m","max_tokens":{bad}}}"#);
            assert_eq!(read(&body, &["max_tokens"], 1 << 20, 3).0, Some(Found::Invalid), "{bad}");
        }
        assert_eq!(read(r#"{"model":"m"}"#, &["max_tokens"], 1 << 20, 3).0, None, "absent");
        assert_eq!(read(r#"{"max_tokens":null}"#, &["max_tokens"], 1 << 20, 3).0, None, "null");
        assert_eq!(read("max_tokens=100", &["max_tokens"], 1 << 20, 3).0, None, "not JSON");
        assert_eq!(read(r#"{"model":"m","max_tok"#, &["max_tokens"], 1 << 20, 3).0, None, "truncated");
        let late = format!(r#"{{"messages":"{}","max_tokens":100}}"#, "x".repeat(5000));
        let (found, read_bytes) = read(&late, &["max_tokens"], 1000, 256);
        assert_eq!(found, None, "past the bound");
        assert_eq!(read_bytes, 1000);
    }

    #[test]
    fn a_rule_without_reading_has_no_estimate() {
        let paths = Usage::path("max_tokens");
        let mut estimates = BodyEstimates::new([(0, &paths, 100)]).unwrap();
        assert!(estimates.feed(br#"{"max_tokens":5}"#, false, |_| &paths));
        assert_eq!(estimates.found(0), Some(Found::Count(5)));
        assert_eq!(estimates.found(1), None);
        assert_eq!(estimates.wants(1000), None);
        assert!(BodyEstimates::new([]).is_none());
    }

    #[test]
    fn a_weighted_estimate() {
        let four = Usage::new([(vec!["max_completion_tokens", "max_tokens"], 4)]);
        assert_eq!(read_usage(r#"{"max_tokens":100,"messages":[]}"#, &four, 1 << 20, 3).0, Some(Found::Count(400)));
        let two = Usage::new([(vec!["max_tokens"], 4), (vec!["n"], 10)]);
        assert_eq!(read_usage(r#"{"n":2,"max_tokens":100}"#, &two, 1 << 20, 3).0, Some(Found::Count(420)));
        assert_eq!(read_usage(r#"{"max_tokens":100}"#, &two, 1 << 20, 3).0, None, "a term without a count: no estimate");
        assert_eq!(read_usage(r#"{"n":"x","max_tokens":100}"#, &two, 1 << 20, 3).0, Some(Found::Invalid));
    }
}
