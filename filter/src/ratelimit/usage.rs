//! Usage counts in response bodies, read as they stream: the number at a JSON path (an LLM API's
//! `usage.total_tokens`), or a weighted sum of the numbers at several paths ([`Usage`]: input
//! tokens × 1 + output tokens × 4), in a JSON body or in the `data:` lines of a
//! server-sent-event stream (OpenAI-compatible `stream_options.include_usage`: the usage comes
//! in the last events; Anthropic's stream: the input tokens in its first event, the output
//! tokens in a later one).
//!
//! Invariants: memory is fixed whatever the body (a few counters per place, no buffer: keys
//! are compared byte by byte as they stream, numbers accumulated as they stream), and one pass
//! reads every place; nesting deeper than [`MAX_DEPTH`] or a body past its byte bound ends the
//! scan ([`Scan::Gave`]), as does anything that is not JSON where a value should be; nothing
//! panics on any input. Each place keeps one value: in a JSON body the first there, in an event
//! stream the last (each event's value replaces the one before: providers that report
//! cumulative counts report the total last). A term's count is the value of the first of its
//! places that has one; the sum is known when every term has its count, and a JSON body is
//! read until each term's first place has a value (for a single path: until its count).
//!
//! Rationale: docs/llm.md.

/// Containers nested deeper than this end the scan.
pub const MAX_DEPTH: u32 = 64;

/// The most places a [`Usage`] reads (beyond them, places are ignored; configurations allow
/// far fewer).
pub const MAX_PLACES: usize = 32;

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

/// Whether a response with this `content-encoding` is encoded (compressed): any value but
/// `identity`. Such a body is not read: its bytes are not the JSON they encode.
pub fn is_encoded(content_encoding: Option<&[u8]>) -> bool {
    content_encoding.is_some_and(|v| {
        let v = v.trim_ascii();
        !v.is_empty() && !v.eq_ignore_ascii_case(b"identity")
    })
}

/// Where the count is: terms, each a weight and the places where its count may be (the
/// first that has one gives it). Compiled once per rule.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Every place, term after term, each as object keys.
    paths: Vec<Vec<Vec<u8>>>,
    /// Per term: its first place's index in `paths`, its number of places, its weight.
    terms: Vec<(usize, usize, u32)>,
}

impl Usage {
    /// No places (nothing is ever found).
    pub const EMPTY: Usage = Usage { paths: Vec::new(), terms: Vec::new() };

    /// The terms: each its places (paths of object keys joined by dots) and its weight.
    pub fn new<'a, P: IntoIterator<Item = &'a str>>(terms: impl IntoIterator<Item = (P, u32)>) -> Usage {
        let mut usage = Usage::default();
        for (places, weight) in terms {
            let first = usage.paths.len();
            usage.paths.extend(places.into_iter().map(segments));
            usage.paths.truncate(MAX_PLACES);
            let count = usage.paths.len().saturating_sub(first);
            if count > 0 {
                usage.terms.push((first, count, weight));
            }
        }
        usage
    }

    /// One count at one path, weight 1.
    pub fn path(path: &str) -> Usage {
        Usage::new([([path], 1)])
    }

    /// One count, at the first of `places` that has one, weight 1.
    pub fn first_of<'a>(places: impl IntoIterator<Item = &'a str>) -> Usage {
        Usage::new([(places, 1)])
    }

    /// The number of places.
    pub fn places(&self) -> usize {
        self.paths.len()
    }

    /// Each term's count (the value of its first place that has one), weighted and added up.
    fn total(&self, values: &[Value]) -> Total {
        let mut sum = 0u64;
        let mut missing = false;
        for &(first, count, weight) in &self.terms {
            let value = values.get(first..first.saturating_add(count)).and_then(|v| v.iter().find(|v| **v != Value::None));
            match value {
                Some(Value::Count(count)) => sum = sum.saturating_add(u64::from(*count).saturating_mul(u64::from(weight))),
                Some(Value::Invalid) => return Total::Invalid,
                Some(Value::None) | None => missing = true,
            }
        }
        if missing || self.terms.is_empty() {
            Total::Missing
        } else {
            Total::Count(u32::try_from(sum).unwrap_or(u32::MAX))
        }
    }

    /// Whether every term's first place has a value: a JSON body can tell nothing more.
    fn settled(&self, values: &[Value]) -> bool {
        self.terms.iter().all(|&(first, _, _)| values.get(first).is_some_and(|v| *v != Value::None))
    }
}

/// A count as the places read so far tell it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Total {
    /// A term has no count (yet).
    Missing,
    /// The weighted sum.
    Count(u32),
    /// A term's value is not a count.
    Invalid,
}

/// Where a scan stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scan {
    /// Still reading; `Some`: the count found so far (an event stream's latest).
    Reading(Option<u32>),
    /// The count (a JSON body's, found: nothing more is read).
    Found(u32),
    /// A value where a count should be is not a count (negative, fractional, too big, a
    /// string).
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

/// The value read at one place.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Value {
    /// None (yet), or `null`.
    None,
    Count(u32),
    Invalid,
}

/// The tokenizer's place inside a JSON document.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lex {
    /// Between tokens.
    Between,
    /// Inside a string; `escaped`: after a backslash; `key`: an object's key (compared with the
    /// places' next segments as it streams).
    Str { escaped: bool, key: bool },
    /// Inside a number (`value` so far, `ok`: digits only).
    Number { value: u64, ok: bool },
    /// Inside `true`, `false` or `null`.
    Word,
}

/// One place's progress along the document.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Matcher {
    /// Segments of the path matched by the open objects: the innermost open object is on the
    /// path when `depth == matched + 1`.
    matched: u32,
    /// The last key read matched the path's next segment.
    key_matched: bool,
    /// While a key is read: equal to the segment so far, `at` bytes compared.
    matching: bool,
    at: u16,
}

/// Reads one JSON document for the numbers at its places, byte by byte.
#[derive(Clone, Debug, PartialEq, Eq)]
struct JsonScan {
    lex: Lex,
    /// The places whose value the current scalar is (one bit per place).
    targets: u32,
    /// Open containers.
    depth: u32,
    /// One bit per open container (up to [`MAX_DEPTH`]): set for an array.
    arrays: u64,
    /// The next string is an object's key.
    expect_key: bool,
    /// Set once the document's first value ended (anything after it is not read).
    done: bool,
    places: Vec<Matcher>,
}

/// What one byte of a document told.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    Go,
    /// The value of the places in the mask.
    At(u32, Value),
    Malformed,
}

impl JsonScan {
    fn new(places: usize) -> JsonScan {
        JsonScan {
            lex: Lex::Between,
            targets: 0,
            depth: 0,
            arrays: 0,
            expect_key: false,
            done: false,
            places: vec![Matcher::default(); places.min(MAX_PLACES)],
        }
    }

    /// Back to the start of a document (the next event of a stream), in place.
    fn reset(&mut self) {
        self.lex = Lex::Between;
        self.targets = 0;
        self.depth = 0;
        self.arrays = 0;
        self.expect_key = false;
        self.done = false;
        self.places.fill(Matcher::default());
    }

    fn in_array(&self) -> bool {
        self.depth > 0 && self.arrays & (1u64 << self.depth.saturating_sub(1).min(63)) != 0
    }

    /// The places whose value starts now.
    fn at_targets(&self, paths: &[Vec<Vec<u8>>]) -> u32 {
        let mut mask = 0;
        for (i, (m, path)) in self.places.iter().zip(paths).enumerate() {
            if m.key_matched && usize::try_from(m.matched).is_ok_and(|n| n.saturating_add(1) == path.len()) {
                mask |= 1u32 << i;
            }
        }
        mask
    }

    fn open(&mut self, array: bool) -> Step {
        if self.depth >= MAX_DEPTH {
            return Step::Malformed;
        }
        let depth = self.depth;
        for m in &mut self.places {
            // An object that is the value of the path's next key (or the document itself) is on it.
            let on_path = !array && (depth == 0 || (m.key_matched && depth == m.matched.saturating_add(1)));
            if on_path && depth > 0 {
                m.matched = m.matched.saturating_add(1);
            }
            m.key_matched = false;
        }
        let bit = 1u64 << depth.min(63);
        if array {
            self.arrays |= bit;
        } else {
            self.arrays &= !bit;
        }
        self.depth = depth.saturating_add(1);
        self.expect_key = !array;
        Step::Go
    }

    fn close(&mut self) -> Step {
        if self.depth == 0 {
            return Step::Malformed;
        }
        let depth = self.depth;
        for m in &mut self.places {
            if depth == m.matched.saturating_add(1) && m.matched > 0 {
                m.matched = m.matched.saturating_sub(1);
            }
            m.key_matched = false;
        }
        self.depth = depth.saturating_sub(1);
        self.expect_key = false;
        if self.depth == 0 {
            self.done = true;
        }
        Step::Go
    }

    /// A scalar value ended.
    fn value_ended(&mut self) {
        for m in &mut self.places {
            m.key_matched = false;
        }
        if self.depth == 0 {
            self.done = true;
        }
    }

    /// The places of `mask` found no count where theirs should be.
    fn not_a_count(&mut self, mask: u32) -> Step {
        for (i, m) in self.places.iter_mut().enumerate() {
            if mask & (1u32 << i) != 0 {
                m.key_matched = false;
            }
        }
        Step::At(mask, Value::Invalid)
    }

    fn number(&mut self, value: u64, ok: bool) -> Step {
        let targets = std::mem::take(&mut self.targets);
        if targets == 0 {
            return Step::Go;
        }
        match u32::try_from(value) {
            Ok(count) if ok => Step::At(targets, Value::Count(count)),
            _ => Step::At(targets, Value::Invalid),
        }
    }

    fn byte(&mut self, b: u8, paths: &[Vec<Vec<u8>>]) -> Step {
        match self.lex {
            Lex::Str { escaped, key } => {
                if escaped {
                    self.lex = Lex::Str { escaped: false, key };
                } else if b == b'\\' {
                    // An escaped byte in a key never matches a plain segment.
                    self.places.iter_mut().for_each(|m| m.matching = false);
                    self.lex = Lex::Str { escaped: true, key };
                } else if b == b'"' {
                    self.lex = Lex::Between;
                    if key {
                        for (m, path) in self.places.iter_mut().zip(paths) {
                            let segment = usize::try_from(m.matched).ok().and_then(|n| path.get(n));
                            m.key_matched = m.matching && segment.is_some_and(|s| s.len() == usize::from(m.at));
                        }
                    } else {
                        let targets = self.at_targets(paths);
                        self.value_ended();
                        if targets != 0 {
                            return Step::At(targets, Value::Invalid);
                        }
                    }
                } else if key {
                    for (m, path) in self.places.iter_mut().zip(paths) {
                        if m.matching {
                            let segment = usize::try_from(m.matched).ok().and_then(|n| path.get(n));
                            m.matching = segment.and_then(|s| s.get(usize::from(m.at))) == Some(&b);
                            m.at = m.at.saturating_add(1);
                        }
                    }
                }
                Step::Go
            }
            Lex::Number { value, ok } => {
                if b.is_ascii_digit() {
                    let value = value.saturating_mul(10).saturating_add(u64::from(b.saturating_sub(b'0')));
                    self.lex = Lex::Number { value, ok };
                    return Step::Go;
                }
                if matches!(b, b'.' | b'e' | b'E' | b'+' | b'-') {
                    self.lex = Lex::Number { value, ok: false };
                    return Step::Go;
                }
                self.lex = Lex::Between;
                self.value_ended();
                let counted = self.number(value, ok);
                let step = self.between(b, paths);
                if counted == Step::Go {
                    step
                } else {
                    counted
                }
            }
            Lex::Word => {
                if b.is_ascii_alphabetic() {
                    return Step::Go;
                }
                self.lex = Lex::Between;
                self.value_ended();
                self.between(b, paths)
            }
            Lex::Between => self.between(b, paths),
        }
    }

    fn between(&mut self, b: u8, paths: &[Vec<Vec<u8>>]) -> Step {
        if self.done && !b.is_ascii_whitespace() {
            return Step::Go;
        }
        match b {
            b' ' | b'\t' | b'\n' | b'\r' => Step::Go,
            b'{' => {
                let targets = if self.depth > 0 { self.at_targets(paths) } else { 0 };
                // An object where a count should be: not a count (for those places; others
                // may go on into it).
                let step = if targets != 0 { self.not_a_count(targets) } else { Step::Go };
                match self.open(false) {
                    Step::Go => step,
                    other => other,
                }
            }
            b'[' => {
                let targets = self.at_targets(paths);
                match self.open(true) {
                    Step::Go if targets != 0 => Step::At(targets, Value::Invalid),
                    step => step,
                }
            }
            b'}' | b']' => self.close(),
            b',' => {
                self.expect_key = !self.in_array();
                self.places.iter_mut().for_each(|m| m.key_matched = false);
                Step::Go
            }
            b':' => {
                self.expect_key = false;
                Step::Go
            }
            b'"' => {
                let key = self.expect_key;
                let depth = self.depth;
                for m in &mut self.places {
                    m.matching = key && depth == m.matched.saturating_add(1);
                    m.at = 0;
                }
                self.lex = Lex::Str { escaped: false, key };
                Step::Go
            }
            b'0'..=b'9' | b'-' => {
                self.targets = self.at_targets(paths);
                let ok = b != b'-';
                let value = if ok { u64::from(b.saturating_sub(b'0')) } else { 0 };
                self.lex = Lex::Number { value, ok };
                Step::Go
            }
            b't' | b'f' | b'n' => {
                let targets = self.at_targets(paths);
                self.lex = Lex::Word;
                if targets == 0 {
                    return Step::Go;
                }
                // `null` where the count goes: not reported here (an event stream's chunks
                // before the last say `"usage": null`); `true`/`false`: not a count.
                let step = self.not_a_count(targets);
                if b == b'n' {
                    Step::Go
                } else {
                    step
                }
            }
            _ => Step::Malformed,
        }
    }

    /// The document ended (end of body, end of line): a number at a place ends too.
    fn finish(&mut self) -> Step {
        if let Lex::Number { value, ok } = self.lex {
            self.lex = Lex::Between;
            return self.number(value, ok);
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

/// Reads a response body for its count ([`Usage`]), as it streams ([`UsageScan::feed`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageScan {
    format: Format,
    json: JsonScan,
    line: Line,
    /// Each place's value so far.
    values: Vec<Value>,
    /// What they add up to.
    total: Total,
    state: Option<Scan>,
    /// Bytes read so far, and the most the rule reads.
    read: u64,
    max_bytes: u64,
}

impl UsageScan {
    /// A scan of a body in `format`, for `usage`, that reads at most `max_bytes`.
    pub fn new(format: Format, usage: &Usage, max_bytes: u64) -> UsageScan {
        let places = usage.places();
        UsageScan {
            format,
            json: JsonScan::new(places),
            line: Line::Field { at: 0 },
            values: vec![Value::None; places.min(MAX_PLACES)],
            total: Total::Missing,
            state: None,
            read: 0,
            max_bytes,
        }
    }

    /// Where the scan stands.
    pub fn state(&self) -> Scan {
        self.state.unwrap_or(Scan::Reading(match self.total {
            Total::Count(count) => Some(count),
            Total::Missing | Total::Invalid => None,
        }))
    }

    /// What the places read so far add up to (a body that could not be read to its end has
    /// its values up to there).
    pub fn total(&self) -> Total {
        self.total
    }

    /// Whether more bytes can change the answer.
    pub fn reading(&self) -> bool {
        self.state.is_none()
    }

    /// Reads the next bytes of the body, looking for `usage`'s places (object keys from the
    /// document's top); returns where the scan stands.
    pub fn feed(&mut self, chunk: &[u8], usage: &Usage) -> Scan {
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
            if let Some(done) = self.byte(b, usage) {
                return done;
            }
        }
        if over {
            self.state = Some(Scan::Gave(GaveUp::TooLong));
        }
        self.state()
    }

    /// Reads one byte; `Some` once the answer is final.
    fn byte(&mut self, b: u8, usage: &Usage) -> Option<Scan> {
        let step = match self.format {
            Format::Json => self.json.byte(b, &usage.paths),
            Format::EventStream => self.event_byte(b, &usage.paths),
        };
        match step {
            Step::Go => None,
            Step::At(mask, value) => self.record(mask, value, usage),
            Step::Malformed => {
                if self.format == Format::Json {
                    self.state = Some(Scan::Gave(GaveUp::Malformed));
                    return Some(self.state());
                }
                // One event that is not JSON does not end the stream's scan.
                self.line = Line::Skip;
                None
            }
        }
    }

    /// The places of `mask` hold `value`: in a JSON body, unless they had one already; in an
    /// event stream, instead of the one they had. `Some` once a JSON body's answer is final.
    fn record(&mut self, mask: u32, value: Value, usage: &Usage) -> Option<Scan> {
        let json = self.format == Format::Json;
        for (i, slot) in self.values.iter_mut().enumerate() {
            if mask & (1u32 << i) != 0 && !(json && *slot != Value::None) {
                *slot = value;
            }
        }
        self.total = usage.total(&self.values);
        if json && usage.settled(&self.values) {
            self.state = Some(match self.total {
                Total::Count(count) => Scan::Found(count),
                Total::Invalid | Total::Missing => Scan::Invalid,
            });
            return self.state;
        }
        None
    }

    /// The body ended: the answer (a count, or why there is none: `Reading(None)` for a body
    /// that ended without one).
    pub fn end(&mut self, usage: &Usage) -> Scan {
        if self.state.is_none() {
            match self.format {
                Format::Json => {
                    if let (Step::At(mask, value), 0) = (self.json.finish(), self.json.depth) {
                        self.record(mask, value, usage);
                    }
                    if self.state.is_none() {
                        self.state = Some(match self.total {
                            Total::Count(count) => Scan::Found(count),
                            Total::Invalid => Scan::Invalid,
                            Total::Missing => Scan::Reading(None),
                        });
                    }
                }
                Format::EventStream => {
                    if let Step::At(mask, value) = self.event_byte(b'\n', &usage.paths) {
                        self.record(mask, value, usage);
                    }
                    if self.total == Total::Invalid {
                        self.state = Some(Scan::Invalid);
                    }
                }
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
        let in_value = matches!(self.json.lex, Lex::Str { escaped: false, key: false });
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

    fn event_byte(&mut self, b: u8, paths: &[Vec<Vec<u8>>]) -> Step {
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
                self.json.reset();
                self.line = Line::Data;
                if b == b' ' {
                    return Step::Go;
                }
                self.data_byte(b, paths)
            }
            Line::Data => self.data_byte(b, paths),
            Line::Skip => Step::Go,
        }
    }

    fn data_byte(&mut self, b: u8, paths: &[Vec<Vec<u8>>]) -> Step {
        if self.json.depth == 0 && !self.json.done && self.json.lex == Lex::Between && !b.is_ascii_whitespace() && b != b'{' {
            // `[DONE]` and other data that is not a JSON object.
            self.line = Line::Skip;
            return Step::Go;
        }
        self.json.byte(b, paths)
    }
}

/// A path as the scanner reads it: `usage.total_tokens` → `[b"usage", b"total_tokens"]`.
fn segments(path: &str) -> Vec<Vec<u8>> {
    path.split('.').map(|s| s.as_bytes().to_vec()).collect()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn scan_all(format: Format, body: &[u8], path: &str, chunk: usize) -> Scan {
        scan_usage(format, body, &Usage::path(path), chunk)
    }

    fn scan_usage(format: Format, body: &[u8], usage: &Usage, chunk: usize) -> Scan {
        let mut scan = UsageScan::new(format, usage, 1 << 20);
        for part in body.chunks(chunk.max(1)) {
            scan.feed(part, usage);
        }
        scan.end(usage)
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
        let path = Usage::path("usage.prompt_tokens");
        let mut scan = UsageScan::new(Format::Json, &path, 1 << 20);
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
        let path = Usage::path("usage.total_tokens");
        let mut scan = UsageScan::new(Format::Json, &path, 10);
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
    fn encoded_bodies_are_told_by_their_content_encoding() {
        assert!(is_encoded(Some(b"gzip")) && is_encoded(Some(b" br ")) && is_encoded(Some(b"gzip, identity")));
        assert!(!is_encoded(None) && !is_encoded(Some(b"identity")) && !is_encoded(Some(b"Identity")) && !is_encoded(Some(b"")));
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
        let path = Usage::path("a.b");
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
                    let mut scan = UsageScan::new(format, &path, 1 << 20);
                    scan.feed(&body, &path);
                    scan.end(&path)
                };
                // Every byte through the state machine, none passed over.
                let mut scan = UsageScan::new(format, &path, 1 << 20);
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
        let path = Usage::new([(vec!["a.b", "a"], 2), (vec!["b"], 1)]);
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
                let mut scan = UsageScan::new(format, &path, 48);
                scan.feed(&body, &path);
                scan.end(&path);
            }
        }
    }

    /// Anthropic's Messages API: input tokens and output tokens, the output weighted 4.
    fn anthropic() -> Usage {
        Usage::new([(vec!["usage.input_tokens", "message.usage.input_tokens"], 1), (vec!["usage.output_tokens"], 4)])
    }

    #[test]
    fn a_weighted_sum_of_counts_from_different_events_of_a_stream() {
        let stream = "event: message_start\n\
                      data: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"usage\":{\"input_tokens\":40,\"output_tokens\":1}}}\n\n\
                      event: content_block_delta\n\
                      data: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n\
                      event: message_delta\n\
                      data: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":25}}\n\n\
                      event: message_stop\n\
                      data: {\"type\":\"message_stop\"}\n\n";
        for chunk in [1, 2, 7, 64, usize::MAX] {
            assert_eq!(scan_usage(Format::EventStream, stream.as_bytes(), &anthropic(), chunk), Scan::Reading(Some(40 + 25 * 4)), "chunks of {chunk}");
        }
        // A stream cut before the output tokens: no count (the sum needs every term).
        let cut = stream.get(..stream.find("event: message_delta").unwrap()).unwrap();
        assert_eq!(scan_usage(Format::EventStream, cut.as_bytes(), &anthropic(), 5), Scan::Reading(None));
        // A later event that repeats a count at a place listed first gives it (the last value).
        let cumulative = stream.replace("{\"output_tokens\":25}", "{\"input_tokens\":41,\"output_tokens\":25}");
        assert_eq!(scan_usage(Format::EventStream, cumulative.as_bytes(), &anthropic(), 3), Scan::Reading(Some(41 + 100)));
        // The same rule on the JSON answer: known as soon as both first places are read.
        let json = r#"{"id":"m","type":"message","content":[{"type":"text","text":"Hi"}],"usage":{"input_tokens":40,"output_tokens":25},"tail":"x"}"#;
        let usage = anthropic();
        let mut scan = UsageScan::new(Format::Json, &usage, 1 << 20);
        let at = json.find(",\"tail\"").unwrap();
        assert_eq!(scan.feed(json.get(..at).unwrap().as_bytes(), &usage), Scan::Found(140), "before the body's end");
        for chunk in [1, 3, usize::MAX] {
            assert_eq!(scan_usage(Format::Json, json.as_bytes(), &usage, chunk), Scan::Found(140));
        }
    }

    #[test]
    fn a_sum_s_terms_each_at_the_first_of_their_places() {
        // OpenAI's Responses API: the usage at the top of a JSON answer, inside `response` in a
        // stream's last event.
        let total = Usage::first_of(["usage.total_tokens", "response.usage.total_tokens"]);
        let json = r#"{"id":"r","object":"response","usage":{"input_tokens":5,"output_tokens":7,"total_tokens":12}}"#;
        assert_eq!(scan_usage(Format::Json, json.as_bytes(), &total, 4), Scan::Found(12));
        let stream = "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\":\"r\",\"usage\":null}}\n\n\
                      event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"id\":\"r\",\"usage\":{\"total_tokens\":12}}}\n\n";
        assert_eq!(scan_usage(Format::EventStream, stream.as_bytes(), &total, 6), Scan::Reading(Some(12)));
        // Where a place listed first and one listed later both have a count, the first gives it
        // (a JSON body is read to its end for the first place then).
        let both = r#"{"response":{"usage":{"total_tokens":99}},"usage":{"total_tokens":12}}"#;
        assert_eq!(scan_usage(Format::Json, both.as_bytes(), &total, 5), Scan::Found(12));
        let only_later = r#"{"response":{"usage":{"total_tokens":99}}}"#;
        assert_eq!(scan_usage(Format::Json, only_later.as_bytes(), &total, 5), Scan::Found(99));
        // A term without a count: none; a value that is not a count: invalid; weights saturate.
        let chat = Usage::new([(vec!["usage.prompt_tokens"], 1), (vec!["usage.completion_tokens"], 4)]);
        assert_eq!(scan_usage(Format::Json, br#"{"usage":{"prompt_tokens":3,"completion_tokens":2}}"#, &chat, 2), Scan::Found(11));
        assert_eq!(scan_usage(Format::Json, br#"{"usage":{"prompt_tokens":3}}"#, &chat, 2), Scan::Reading(None));
        assert_eq!(scan_usage(Format::Json, br#"{"usage":{"prompt_tokens":3,"completion_tokens":-2}}"#, &chat, 2), Scan::Invalid);
        assert_eq!(scan_usage(Format::Json, br#"{"usage":{"prompt_tokens":{"x":1},"completion_tokens":2}}"#, &chat, 2), Scan::Invalid);
        let big = Usage::new([(vec!["a"], 1000)]);
        assert_eq!(scan_usage(Format::Json, br#"{"a":4294967295}"#, &big, 3), Scan::Found(u32::MAX));
        // A place inside another's value: `usage` is an object (not a count) for one place, the
        // way to the count for the other.
        let nested = Usage::new([(vec!["usage"], 1), (vec!["usage.b"], 1)]);
        assert_eq!(scan_usage(Format::Json, br#"{"usage":{"b":3}}"#, &nested, 1), Scan::Invalid);
        let inner = Usage::new([(vec!["usage.b"], 1), (vec!["c"], 2)]);
        assert_eq!(scan_usage(Format::Json, br#"{"usage":{"b":3},"c":4}"#, &inner, 1), Scan::Found(11));
    }
}
