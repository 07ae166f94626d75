//! Usage counts in response bodies, read as they stream: the number at a JSON path (an LLM API's
//! `usage.total_tokens`) in a JSON body or in the `data:` lines of a server-sent-event stream
//! (OpenAI-compatible `stream_options.include_usage`: the usage comes in the last events).
//!
//! Invariants: memory is fixed whatever the body (a few counters, no buffer: keys are compared
//! byte by byte as they stream, numbers accumulated as they stream); nesting deeper than
//! [`MAX_DEPTH`] or a body past its byte bound ends the scan ([`Scan::Gave`]), as does anything
//! that is not JSON where a value should be; nothing panics on any input. In a JSON body the
//! first count at the path is the answer; in an event stream, the last one (each event's count
//! replaces the one before: providers that report cumulative counts report the total last).
//!
//! Rationale: docs/llm.md.

/// Containers nested deeper than this end the scan.
pub const MAX_DEPTH: u32 = 64;

/// How the body carries its usage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// One JSON document.
    Json,
    /// A server-sent-event stream whose `data:` lines are JSON documents.
    EventStream,
}

impl Format {
    /// The format of a response of this `content-type` (`text/event-stream`: an event stream;
    /// anything else: JSON).
    pub fn of(content_type: Option<&[u8]>) -> Format {
        let event_stream = content_type.is_some_and(|v| {
            let v = v.trim_ascii_start();
            v.len() >= 17 && v.get(..17).is_some_and(|p| p.eq_ignore_ascii_case(b"text/event-stream"))
        });
        if event_stream {
            Format::EventStream
        } else {
            Format::Json
        }
    }
}

/// Where a scan stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scan {
    /// Still reading; `Some`: the count found so far (an event stream's latest).
    Reading(Option<u32>),
    /// The count (a JSON body's, found: nothing more is read).
    Found(u32),
    /// The value at the path is not a count (negative, fractional, too big, a string).
    Invalid,
    /// The body could not be read to its end: not JSON, nested too deep, or past its bound.
    Gave(GaveUp),
}

/// Why a scan gave up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GaveUp {
    /// Not JSON where JSON was expected, or nested deeper than [`MAX_DEPTH`].
    Malformed,
    /// More bytes than the rule reads.
    TooLong,
}

/// The tokenizer's place inside a JSON document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lex {
    /// Between tokens.
    Between,
    /// Inside a string; `escaped`: after a backslash; `key`: an object's key being compared
    /// (`matching`: equal to the segment so far, `at`: bytes compared).
    Str { escaped: bool, key: bool, matching: bool, at: u16 },
    /// Inside a number; `target`: the one at the path (`value` so far, `ok`: digits only).
    Number { target: bool, value: u64, ok: bool },
    /// Inside `true`, `false` or `null`.
    Word,
}

/// Reads one JSON document for the number at a path of object keys, byte by byte.
#[derive(Clone, Debug, PartialEq, Eq)]
struct JsonScan {
    lex: Lex,
    /// Open containers.
    depth: u32,
    /// One bit per open container (up to [`MAX_DEPTH`]): set for an array.
    arrays: u64,
    /// Segments of the path matched by the open objects: the innermost open object is on the
    /// path when `depth == matched + 1`.
    matched: u32,
    /// The next string is an object's key.
    expect_key: bool,
    /// The last key read matched the path's next segment.
    key_matched: bool,
    /// Set once the document's first value ended (anything after it is not read).
    done: bool,
}

/// What one byte of a document told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Go,
    Count(u32),
    Null,
    Invalid,
    Malformed,
}

impl JsonScan {
    fn new() -> JsonScan {
        JsonScan { lex: Lex::Between, depth: 0, arrays: 0, matched: 0, expect_key: false, key_matched: false, done: false }
    }

    fn in_array(&self) -> bool {
        self.depth > 0 && self.arrays & (1u64 << self.depth.saturating_sub(1).min(63)) != 0
    }

    /// The value starting now is the one at the path.
    fn at_target(&self, path: &[Vec<u8>]) -> bool {
        self.key_matched && usize::try_from(self.matched).is_ok_and(|m| m.saturating_add(1) == path.len())
    }

    fn open(&mut self, array: bool) -> Step {
        if self.depth >= MAX_DEPTH {
            return Step::Malformed;
        }
        // An object that is the value of the path's next key (or the document itself) is on it.
        let on_path = !array && (self.depth == 0 || (self.key_matched && self.depth == self.matched.saturating_add(1)));
        if on_path && self.depth > 0 {
            self.matched = self.matched.saturating_add(1);
        }
        let bit = 1u64 << self.depth.min(63);
        if array {
            self.arrays |= bit;
        } else {
            self.arrays &= !bit;
        }
        self.depth = self.depth.saturating_add(1);
        self.expect_key = !array;
        self.key_matched = false;
        Step::Go
    }

    fn close(&mut self) -> Step {
        if self.depth == 0 {
            return Step::Malformed;
        }
        if self.depth == self.matched.saturating_add(1) && self.matched > 0 {
            self.matched = self.matched.saturating_sub(1);
        }
        self.depth = self.depth.saturating_sub(1);
        self.key_matched = false;
        self.expect_key = false;
        if self.depth == 0 {
            self.done = true;
        }
        Step::Go
    }

    /// A scalar value ended.
    fn value_ended(&mut self) {
        self.key_matched = false;
        if self.depth == 0 {
            self.done = true;
        }
    }

    fn byte(&mut self, b: u8, path: &[Vec<u8>]) -> Step {
        match self.lex {
            Lex::Str { escaped, key, matching, at } => {
                if escaped {
                    // An escaped byte in a key never matches a plain segment.
                    self.lex = Lex::Str { escaped: false, key, matching: false, at };
                } else if b == b'\\' {
                    self.lex = Lex::Str { escaped: true, key, matching: false, at };
                } else if b == b'"' {
                    self.lex = Lex::Between;
                    if key {
                        let segment = usize::try_from(self.matched).ok().and_then(|m| path.get(m));
                        self.key_matched = matching && segment.is_some_and(|s| s.len() == usize::from(at));
                    } else {
                        let target = self.at_target(path);
                        self.value_ended();
                        if target {
                            return Step::Invalid;
                        }
                    }
                } else if key && matching {
                    let segment = usize::try_from(self.matched).ok().and_then(|m| path.get(m));
                    let same = segment.and_then(|s| s.get(usize::from(at))) == Some(&b);
                    self.lex = Lex::Str { escaped, key, matching: same, at: at.saturating_add(1) };
                }
                Step::Go
            }
            Lex::Number { target, value, ok } => {
                if b.is_ascii_digit() {
                    let value = value.saturating_mul(10).saturating_add(u64::from(b.saturating_sub(b'0')));
                    self.lex = Lex::Number { target, value, ok };
                    return Step::Go;
                }
                if matches!(b, b'.' | b'e' | b'E' | b'+' | b'-') {
                    self.lex = Lex::Number { target, value, ok: false };
                    return Step::Go;
                }
                self.lex = Lex::Between;
                self.value_ended();
                let step = self.between(b, path);
                if target {
                    return match u32::try_from(value) {
                        Ok(count) if ok => Step::Count(count),
                        _ => Step::Invalid,
                    };
                }
                step
            }
            Lex::Word => {
                if b.is_ascii_alphabetic() {
                    return Step::Go;
                }
                self.lex = Lex::Between;
                self.value_ended();
                self.between(b, path)
            }
            Lex::Between => self.between(b, path),
        }
    }

    fn between(&mut self, b: u8, path: &[Vec<u8>]) -> Step {
        if self.done && !b.is_ascii_whitespace() {
            return Step::Go;
        }
        match b {
            b' ' | b'\t' | b'\n' | b'\r' => Step::Go,
            b'{' => {
                if self.at_target(path) && self.depth > 0 {
                    self.key_matched = false;
                    self.open(false);
                    // An object where the count should be: not a count.
                    return Step::Invalid;
                }
                self.open(false)
            }
            b'[' => {
                let target = self.at_target(path);
                let step = self.open(true);
                if target && step == Step::Go {
                    return Step::Invalid;
                }
                step
            }
            b'}' | b']' => self.close(),
            b',' => {
                self.expect_key = !self.in_array();
                self.key_matched = false;
                Step::Go
            }
            b':' => {
                self.expect_key = false;
                Step::Go
            }
            b'"' => {
                let key = self.expect_key;
                let on_path = key && self.depth == self.matched.saturating_add(1);
                self.lex = Lex::Str { escaped: false, key, matching: on_path, at: 0 };
                Step::Go
            }
            b'0'..=b'9' | b'-' => {
                let target = self.at_target(path);
                let ok = b != b'-';
                let value = if ok { u64::from(b.saturating_sub(b'0')) } else { 0 };
                self.lex = Lex::Number { target, value, ok };
                Step::Go
            }
            b't' | b'f' | b'n' => {
                let target = self.at_target(path);
                self.lex = Lex::Word;
                if target {
                    self.key_matched = false;
                    // `null` where the count goes: not reported here (an event stream's
                    // chunks before the last say `"usage": null`); `true`/`false`: invalid.
                    return if b == b'n' { Step::Null } else { Step::Invalid };
                }
                Step::Go
            }
            _ => Step::Malformed,
        }
    }

    /// The document ended (end of body, end of line): a number at the path ends too.
    fn finish(&mut self) -> Step {
        if let Lex::Number { target: true, value, ok } = self.lex {
            self.lex = Lex::Between;
            return match u32::try_from(value) {
                Ok(count) if ok => Step::Count(count),
                _ => Step::Invalid,
            };
        }
        Step::Go
    }
}

/// Where an event stream's reader is in its current line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Line {
    /// At a line's start, `at` bytes of `data:` matched so far.
    Field { at: u8 },
    /// After `data:`: the first byte may be a space to skip.
    DataStart,
    /// Inside a `data:` line's JSON.
    Data,
    /// Inside any other line (a comment, `event:`, `id:`), or a data line that is not JSON
    /// (`[DONE]`).
    Skip,
}

/// Reads a response body for the count at a path, as it streams ([`UsageScan::feed`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageScan {
    format: Format,
    json: JsonScan,
    line: Line,
    /// The count found so far.
    count: Option<u32>,
    state: Option<Scan>,
    /// Bytes read so far, and the most the rule reads.
    read: u64,
    max_bytes: u64,
}

impl UsageScan {
    /// A scan of a body in `format` that reads at most `max_bytes`.
    pub fn new(format: Format, max_bytes: u64) -> UsageScan {
        UsageScan { format, json: JsonScan::new(), line: Line::Field { at: 0 }, count: None, state: None, read: 0, max_bytes }
    }

    /// Where the scan stands.
    pub fn state(&self) -> Scan {
        self.state.unwrap_or(Scan::Reading(self.count))
    }

    /// Whether more bytes can change the answer.
    pub fn reading(&self) -> bool {
        self.state.is_none()
    }

    /// Reads the next bytes of the body, looking for the count at `path` (object keys from the
    /// document's top); returns where the scan stands.
    pub fn feed(&mut self, chunk: &[u8], path: &[Vec<u8>]) -> Scan {
        if self.state.is_some() {
            return self.state();
        }
        let len = u64::try_from(chunk.len()).unwrap_or(u64::MAX);
        let room = self.max_bytes.saturating_sub(self.read);
        self.read = self.read.saturating_add(len);
        let (chunk, over) = match usize::try_from(room) {
            Ok(room) if room < chunk.len() => (chunk.get(..room).unwrap_or_default(), true),
            _ => (chunk, false),
        };
        let mut rest = chunk;
        while !rest.is_empty() {
            // Bytes that cannot change the scan's state (inside a string value, or a line that is
            // skipped) are passed over in one search, not a byte at a time.
            let skip = self.skippable(rest);
            let Some((&b, after)) = rest.get(skip..).and_then(<[u8]>::split_first) else { break };
            rest = after;
            if let Some(done) = self.byte(b, path) {
                return done;
            }
        }
        if over {
            self.state = Some(Scan::Gave(GaveUp::TooLong));
        }
        self.state()
    }

    /// Reads one byte; `Some` once the answer is final.
    fn byte(&mut self, b: u8, path: &[Vec<u8>]) -> Option<Scan> {
        let step = match self.format {
            Format::Json => self.json.byte(b, path),
            Format::EventStream => self.event_byte(b, path),
        };
        match step {
            Step::Go | Step::Null => {}
            Step::Count(count) => {
                if self.format == Format::Json {
                    self.state = Some(Scan::Found(count));
                    return Some(self.state());
                }
                self.count = Some(count);
            }
            Step::Invalid => {
                self.state = Some(Scan::Invalid);
                return Some(self.state());
            }
            Step::Malformed => {
                if self.format == Format::Json {
                    self.state = Some(Scan::Gave(GaveUp::Malformed));
                    return Some(self.state());
                }
                // One event that is not JSON does not end the stream's scan.
                self.line = Line::Skip;
            }
        }
        None
    }

    /// The body ended: the answer (a count, or why there is none: `Reading(None)` for a body
    /// that ended without one).
    pub fn end(&mut self, path: &[Vec<u8>]) -> Scan {
        if self.state.is_none() {
            match self.format {
                Format::Json => {
                    if let Step::Count(count) = self.json.finish() {
                        if self.json.depth == 0 {
                            self.state = Some(Scan::Found(count));
                        }
                    }
                }
                Format::EventStream => match self.event_byte(b'\n', path) {
                    Step::Count(count) => self.count = Some(count),
                    Step::Invalid => self.state = Some(Scan::Invalid),
                    _ => {}
                },
            }
        }
        let state = self.state();
        self.state = Some(state);
        state
    }

    /// How many of `bytes`, from the first, leave the scan where it is: the inside of a string
    /// value up to its closing quote or an escape (and, in an event stream, the line's end), or
    /// the rest of a skipped line.
    fn skippable(&self, bytes: &[u8]) -> usize {
        let in_value = matches!(self.json.lex, Lex::Str { escaped: false, key: false, .. });
        let stop = match (self.format, self.line) {
            (Format::Json, _) if in_value => bytes.iter().position(|&b| b == b'"' || b == b'\\'),
            (Format::EventStream, Line::Data) if in_value => {
                bytes.iter().position(|&b| b == b'"' || b == b'\\' || b == b'\n' || b == b'\r')
            }
            (Format::EventStream, Line::Skip) => bytes.iter().position(|&b| b == b'\n' || b == b'\r'),
            _ => return 0,
        };
        stop.unwrap_or(bytes.len())
    }

    fn event_byte(&mut self, b: u8, path: &[Vec<u8>]) -> Step {
        const DATA: &[u8] = b"data:";
        if b == b'\n' || b == b'\r' {
            let step = if self.line == Line::Data { self.json.finish() } else { Step::Go };
            self.line = Line::Field { at: 0 };
            return step;
        }
        match self.line {
            Line::Field { at } => {
                if DATA.get(usize::from(at)) == Some(&b) {
                    let at = at.saturating_add(1);
                    self.line = if usize::from(at) == DATA.len() { Line::DataStart } else { Line::Field { at } };
                } else {
                    self.line = Line::Skip;
                }
                Step::Go
            }
            Line::DataStart => {
                self.json = JsonScan::new();
                if b == b' ' {
                    self.line = Line::Data;
                    return Step::Go;
                }
                self.line = Line::Data;
                self.data_byte(b, path)
            }
            Line::Data => self.data_byte(b, path),
            Line::Skip => Step::Go,
        }
    }

    fn data_byte(&mut self, b: u8, path: &[Vec<u8>]) -> Step {
        if self.json.depth == 0 && !self.json.done && self.json.lex == Lex::Between && !b.is_ascii_whitespace() && b != b'{' {
            // `[DONE]` and other data that is not a JSON object.
            self.line = Line::Skip;
            return Step::Go;
        }
        self.json.byte(b, path)
    }
}

/// A path as the scanner reads it: `usage.total_tokens` → `[b"usage", b"total_tokens"]`.
pub fn segments(path: &str) -> Vec<Vec<u8>> {
    path.split('.').map(|s| s.as_bytes().to_vec()).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn scan_all(format: Format, body: &[u8], path: &str, chunk: usize) -> Scan {
        let path = segments(path);
        let mut scan = UsageScan::new(format, 1 << 20);
        for part in body.chunks(chunk.max(1)) {
            scan.feed(part, &path);
        }
        scan.end(&path)
    }

    fn json(body: &str) -> Scan {
        let whole = scan_all(Format::Json, body.as_bytes(), "usage.total_tokens", usize::MAX);
        for chunk in [1, 2, 3, 7] {
            assert_eq!(scan_all(Format::Json, body.as_bytes(), "usage.total_tokens", chunk), whole, "{body} in chunks of {chunk}");
        }
        whole
    }

    #[test]
    fn a_json_body_s_count_at_the_path() {
        let body = r#"{"id":"x","choices":[{"message":{"content":"hi \"usage\": {\"total_tokens\": 9}"},"usage":{"total_tokens":3}}],
                      "usage":{"prompt_tokens":10,"completion_tokens":20,"total_tokens":30}}"#;
        assert_eq!(json(body), Scan::Found(30));
        let path = segments("usage.prompt_tokens");
        let mut scan = UsageScan::new(Format::Json, 1 << 20);
        assert_eq!(scan.feed(body.as_bytes(), &path), Scan::Found(10));
        assert_eq!(json(r#"{"usage":{"total_tokens":0}}"#), Scan::Found(0));
        assert_eq!(json(r#" { "usage" : { "total_tokens" : 4294967295 } } "#), Scan::Found(u32::MAX));
        assert_eq!(json(r#"{"x":{"usage":{"total_tokens":5}},"usage":{"total_tokens":6}}"#), Scan::Found(6), "only from the top");
        assert_eq!(json(r#"{"usage":{"total":{"total_tokens":5}},"usage2":1}"#), Scan::Reading(None));
        assert_eq!(json(r#"{"usagex":{"total_tokens":5}}"#), Scan::Reading(None));
        assert_eq!(json(r#"{"usage":{"total_tokens_x":5}}"#), Scan::Reading(None));
        assert_eq!(json(r#"{"us\u0061ge":{"total_tokens":5}}"#), Scan::Reading(None), "escaped keys are not compared");
        assert_eq!(json(r#"[{"usage":{"total_tokens":5}}]"#), Scan::Reading(None));
    }

    #[test]
    fn bad_values_and_bodies() {
        for bad in ["-1", "1.5", "1e9", "4294967296", "\"30\"", "true", "{}", "[30]"] {
            assert_eq!(json(&format!(r#"{{"usage":{{"total_tokens":{bad}}}}}"#)), Scan::Invalid, "{bad}");
        }
        assert_eq!(json(r#"{"usage":{"total_tokens":null}}"#), Scan::Reading(None));
        assert_eq!(json(r#"{"usage":{"total_tok"#), Scan::Reading(None), "truncated");
        assert_eq!(json(r#"{"usage":{"total_tokens":12"#), Scan::Reading(None), "truncated in the number");
        assert_eq!(json("<html>oops</html>"), Scan::Gave(GaveUp::Malformed));
        assert_eq!(json(&"[".repeat(100)), Scan::Gave(GaveUp::Malformed));
        assert_eq!(json("}}}"), Scan::Gave(GaveUp::Malformed));
        let path = segments("usage.total_tokens");
        let mut scan = UsageScan::new(Format::Json, 10);
        assert_eq!(scan.feed(br#"{"pad":"01234567890","usage":{"total_tokens":1}}"#, &path), Scan::Gave(GaveUp::TooLong));
        assert!(!scan.reading());
    }

    #[test]
    fn an_event_stream_s_last_count() {
        let stream = "data: {\"choices\":[{\"delta\":{\"content\":\"a\"}}],\"usage\":null}\n\n\
                      : a comment\n\
                      event: message\n\
                      data: {\"choices\":[],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":23,\"total_tokens\":30}}\r\n\r\n\
                      data: [DONE]\n\n";
        for chunk in [1, 2, 5, 64, usize::MAX] {
            assert_eq!(scan_all(Format::EventStream, stream.as_bytes(), "usage.total_tokens", chunk), Scan::Reading(Some(30)));
            assert_eq!(scan_all(Format::EventStream, stream.as_bytes(), "usage.completion_tokens", chunk), Scan::Reading(Some(23)));
        }
        let cumulative = "data:{\"usage\":{\"output_tokens\":1}}\n\ndata:{\"usage\":{\"output_tokens\":12}}\n\n";
        assert_eq!(scan_all(Format::EventStream, cumulative.as_bytes(), "usage.output_tokens", 3), Scan::Reading(Some(12)));
        let none = "data: {\"choices\":[]}\n\ndata: not json\n\ndata: [DONE]\n\n";
        assert_eq!(scan_all(Format::EventStream, none.as_bytes(), "usage.total_tokens", 4), Scan::Reading(None));
        let unterminated = "data: {\"usage\":{\"total_tokens\":41}}";
        assert_eq!(scan_all(Format::EventStream, unterminated.as_bytes(), "usage.total_tokens", 4), Scan::Reading(Some(41)));
        let bad = "data: {\"usage\":{\"total_tokens\":-3}}\n\n";
        assert_eq!(scan_all(Format::EventStream, bad.as_bytes(), "usage.total_tokens", 4), Scan::Invalid);
    }

    #[test]
    fn formats_from_the_content_type() {
        assert_eq!(Format::of(Some(b"text/event-stream; charset=utf-8")), Format::EventStream);
        assert_eq!(Format::of(Some(b"Text/Event-Stream")), Format::EventStream);
        assert_eq!(Format::of(Some(b"application/json")), Format::Json);
        assert_eq!(Format::of(None), Format::Json);
    }

    #[test]
    fn bytes_passed_over_in_one_search_leave_the_same_answer_as_one_at_a_time() {
        let split = "data: {\"x\":\"ab\ndata: {\"usage\":{\"total_tokens\":5}}\n\n";
        for chunk in [1, 3, usize::MAX] {
            assert_eq!(scan_all(Format::EventStream, split.as_bytes(), "usage.total_tokens", chunk), Scan::Reading(Some(5)), "a line ends a string");
        }
        let path = segments("a.b");
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            usize::try_from(seed % n).unwrap()
        };
        let mut outcomes = std::collections::BTreeSet::new();
        for _ in 0..4000 {
            // Objects with the count after a string of noise (quotes, escapes, line ends), as
            // lines of an event stream between comments and `[DONE]`, with every line ending.
            let mut body = Vec::new();
            for line in 0..1 + next(4) {
                let mut noise = String::new();
                for _ in 0..next(12) {
                    noise.push_str(["x", "\\\"", "\\\\", "\"", "\\", "\n", "\r", "data: ", "{", " "].get(next(10)).unwrap());
                }
                let text = match next(5) {
                    0 => format!(": {noise}"),
                    1 => "data: [DONE]".to_owned(),
                    _ => format!("{}{{\"x\":\"{noise}\",\"a\":{{\"b\":{line}{}}}}}", ["data: ", "data:", ""].get(next(3)).unwrap(), next(10)),
                };
                body.extend_from_slice(text.as_bytes());
                body.extend_from_slice(["\n", "\r", "\r\n", "\n\n"].get(next(4)).unwrap().as_bytes());
            }
            for format in [Format::Json, Format::EventStream] {
                let whole = {
                    let mut scan = UsageScan::new(format, 1 << 20);
                    scan.feed(&body, &path);
                    scan.end(&path)
                };
                // Every byte through the state machine, none passed over.
                let mut scan = UsageScan::new(format, 1 << 20);
                for &b in &body {
                    if scan.byte(b, &path).is_some() {
                        break;
                    }
                }
                assert_eq!(scan.end(&path), whole, "{format:?} {}", String::from_utf8_lossy(&body));
                outcomes.insert(format!("{whole:?}"));
            }
        }
        assert!(outcomes.len() >= 5, "the bodies reach every kind of answer: {outcomes:?}");
    }

    #[test]
    fn any_bytes_never_panic() {
        let path = segments("a.b");
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..2000 {
            let mut body = Vec::new();
            for _ in 0..64 {
                seed ^= seed << 13;
                seed ^= seed >> 7;
                seed ^= seed << 17;
                body.push(*b"{}[]\":,ab0123-.e \n\\datn".get(usize::try_from(seed % 23).unwrap()).unwrap());
            }
            for format in [Format::Json, Format::EventStream] {
                let mut scan = UsageScan::new(format, 48);
                scan.feed(&body, &path);
                scan.end(&path);
            }
        }
    }
}
