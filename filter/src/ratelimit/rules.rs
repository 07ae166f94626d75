//! Rules that fit real APIs: which rate-limit rules apply to a request (`match`: the path exactly,
//! by prefix or by a template; the method; headers; the authority; no regular expression), with
//! which limit (an override, then the tier, then the rule's `limit`), and what the request costs
//! (`cost`). Compiled once per configuration from [`crate::config`], asked per request with the
//! request's [`Attributes`]; the limiter ([`crate::ratelimit`]) decides with each probe's limit and
//! cost.
//!
//! Invariants: a rule whose condition fails reads no key and touches no shared data; a request is
//! admitted only with room for its known cost (or its reservation, for a reported cost with an
//! estimate) and for at least one unit, and a cost known later is settled once when known (what
//! admission counted becomes the known cost: the difference charged or given back), or when the
//! stream ends; a count is decimal digits up to `u32::MAX`, anything else is invalid and
//! costs `cost.default`, and a cost above the limit is capped at it: nothing wraps. Limits and
//! tiers are not part of a rule's identity, so changing them keeps the counters.
//!
//! Rationale: docs/design.md, section "Rules: conditions, limits by key, costs".

use crate::config::{Config, CostSource, HeaderCondition, KeyPart, PathMatch, Term, Unreported, DEFAULT_ESTIMATE_BODY_BYTES, DEFAULT_MAX_BODY_BYTES};
use crate::keys::KeyHasher;
use crate::primitives::time::UnixMillis;
use crate::ratelimit::estimate::{BodyEstimates, Found};
use crate::ratelimit::usage::{Format, Scan, Usage, UsageScan};
use crate::ratelimit::Probe;
use std::borrow::Cow;
use std::num::NonZeroU32;

/// The request attributes a condition, a tier or a cost reads: request headers by lower-case
/// name, pseudo-headers (`:path`, `:method`, `:authority`) included.
pub trait Attributes {
    /// The (first) value of `name`, if the request has it.
    fn get(&self, name: &str) -> Option<Cow<'_, [u8]>>;

    /// The name of the Envoy route the request matched, if it has one (read only by a rule
    /// whose `match` names routes).
    fn route(&self) -> Option<Cow<'_, [u8]>> {
        None
    }
}

/// One segment of a path template.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Segment {
    /// `*`: any one non-empty segment.
    Any,
    /// This segment exactly.
    Literal(Vec<u8>),
}

/// A compiled path condition.
#[derive(Clone, Debug, PartialEq, Eq)]
enum PathTest {
    Exact(Vec<u8>),
    Prefix(Vec<u8>),
    Template(Vec<Segment>),
}

impl PathTest {
    fn new(path: &PathMatch) -> Option<PathTest> {
        if let Some(exact) = &path.exact {
            return Some(PathTest::Exact(exact.as_bytes().to_vec()));
        }
        if let Some(prefix) = &path.prefix {
            return Some(PathTest::Prefix(prefix.as_bytes().to_vec()));
        }
        let template = path.template.as_ref()?;
        Some(PathTest::Template(
            template
                .split('/')
                .map(|s| if s == "*" { Segment::Any } else { Segment::Literal(s.as_bytes().to_vec()) })
                .collect(),
        ))
    }

    fn matches(&self, path: &[u8]) -> bool {
        match self {
            PathTest::Exact(exact) => path == exact.as_slice(),
            PathTest::Prefix(prefix) => path.starts_with(prefix),
            PathTest::Template(segments) => {
                let mut parts = path.split(|b| *b == b'/');
                let all_match = segments.iter().all(|segment| match (segment, parts.next()) {
                    (Segment::Any, Some(part)) => !part.is_empty(),
                    (Segment::Literal(literal), Some(part)) => part == literal.as_slice(),
                    (_, None) => false,
                });
                all_match && parts.next().is_none()
            }
        }
    }
}

/// A compiled header condition.
#[derive(Clone, Debug, PartialEq, Eq)]
enum HeaderTest {
    Present(bool),
    Equals(Vec<u8>),
}

/// A compiled `match`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Condition {
    path: Option<PathTest>,
    methods: Option<Vec<Vec<u8>>>,
    headers: Vec<(String, HeaderTest)>,
    authority: Option<Vec<u8>>,
    routes: Option<Vec<Vec<u8>>>,
}

/// The condition of a rule's `match` that a request fails (the first, in the order the filter
/// tests them), as [`Rules::unmet`] tells it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unmet<'a> {
    /// `match.path`.
    Path,
    /// `match.methods`.
    Method,
    /// `match.headers`: the condition on this header (lower-case name).
    Header(&'a str),
    /// `match.authority`.
    Authority,
    /// `match.routes`.
    Route,
}

impl Condition {
    fn holds<A: Attributes + ?Sized>(&self, request: &A) -> bool {
        self.unmet(request).is_none()
    }

    /// The first condition the request fails, if any.
    fn unmet<A: Attributes + ?Sized>(&self, request: &A) -> Option<Unmet<'_>> {
        if let Some(path) = &self.path {
            let raw = request.get(":path");
            let Some(raw) = raw.as_deref() else { return Some(Unmet::Path) };
            if !path.matches(KeyPart::Path.normalize(raw)) {
                return Some(Unmet::Path);
            }
        }
        if let Some(methods) = &self.methods {
            let method = request.get(":method");
            if !method.as_deref().is_some_and(|m| methods.iter().any(|allowed| allowed.as_slice() == m)) {
                return Some(Unmet::Method);
            }
        }
        for (name, test) in &self.headers {
            let value = request.get(name);
            let holds = match test {
                HeaderTest::Present(present) => value.is_some() == *present,
                HeaderTest::Equals(expected) => value.as_deref() == Some(expected.as_slice()),
            };
            if !holds {
                return Some(Unmet::Header(name));
            }
        }
        if let Some(authority) = &self.authority {
            let raw = request.get(":authority");
            let host = raw.as_deref().map(host_of);
            if !host.is_some_and(|h| h.eq_ignore_ascii_case(authority)) {
                return Some(Unmet::Authority);
            }
        }
        // Last: the route's name is a host call, read only when every other condition holds.
        if let Some(routes) = &self.routes {
            let route = request.route();
            if !route.as_deref().is_some_and(|r| routes.iter().any(|name| name.as_slice() == r)) {
                return Some(Unmet::Route);
            }
        }
        None
    }
}

/// `api.example.com:8443` → `api.example.com`; `[::1]:80` → `[::1]`.
fn host_of(authority: &[u8]) -> &[u8] {
    if authority.starts_with(b"[") {
        let end = authority.iter().position(|b| *b == b']').map_or(authority.len(), |e| e.saturating_add(1));
        return authority.get(..end).unwrap_or(authority);
    }
    match authority.iter().rposition(|b| *b == b':') {
        Some(at) => authority.get(..at).unwrap_or(authority),
        None => authority,
    }
}

/// What a rule's request costs, as compiled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CostPlan {
    /// 1 per request (the default).
    One,
    /// A count in request header `header` (`default` when absent or invalid).
    RequestHeader {
        /// The header.
        header: String,
        /// The cost without a valid count.
        default: u32,
    },
    /// The request body's bytes.
    RequestBody,
    /// A count the upstream reports in response header `header` (`default` without one).
    ResponseHeader {
        /// The header.
        header: String,
        /// The cost without a valid count.
        default: u32,
        /// What is reserved at admission, if anything.
        estimate: Option<Reservation>,
    },
    /// A count the upstream reports in its response body, at `usage`'s places.
    ResponseBody {
        /// Where the count is (one path, or a weighted sum).
        usage: Usage,
        /// The most bytes read for it.
        max_bytes: u64,
        /// The cost without a valid count.
        default: u32,
        /// What is reserved at admission, if anything.
        estimate: Option<Reservation>,
    },
}

/// What a request reserves at admission for a cost the upstream reports later (`cost.estimate`),
/// and how a response without a count settles it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reservation {
    /// The request header holding the estimate.
    header: Option<String>,
    /// Its places in the request's JSON body (none: the body is not read).
    body: Option<Usage>,
    /// The most bytes of the request body read for it.
    body_bytes: u64,
    /// The estimate without a valid header.
    default: u32,
    /// The largest estimate.
    max: u32,
    /// A response without a valid count: the reservation stays, or goes back.
    unreported: Unreported,
}

impl Reservation {
    /// The units a request reserves (its header's count if it has the header, else what its
    /// body held, `body`), and whether the value was invalid.
    fn units<A: Attributes + ?Sized>(&self, request: &A, body: Option<Found>) -> (u32, bool) {
        let count = match self.header.as_deref().and_then(|h| request.get(h)) {
            Some(raw) => parse_count(&raw),
            None => match body {
                None => return (self.default, false),
                Some(Found::Count(units)) => Some(units),
                Some(Found::Invalid) => None,
            },
        };
        match count {
            Some(units) => (units.min(self.max), false),
            None => (self.default, true),
        }
    }

    /// Whether a request must wait for its body: the estimate is read there, and the request has
    /// no estimate header.
    fn reads_body<A: Attributes + ?Sized>(&self, request: &A) -> bool {
        self.body.is_some() && self.header.as_deref().is_none_or(|h| request.get(h).is_none())
    }
}

/// What a response told of a rule's count (or the request body, of its bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Report {
    /// The count.
    Count(u32),
    /// No count: the response ended without one (or never came).
    Missing,
    /// A value that is not a count.
    Invalid,
    /// A body that could not be read for one: not JSON, or longer than the rule reads.
    Unreadable,
    /// A body in a `content-encoding` (compressed): not read (counted as unreadable too).
    Compressed,
}

/// A cost owed by an admitted request, now known: the rule's key (`probe`, whose `cost` is
/// what was counted at admission), what the response told, and the key's limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settle {
    /// The rule's key, with the units counted at admission.
    pub probe: Probe,
    /// The count, or why there is none.
    pub report: Report,
    /// The key's limit (a cost is capped at it).
    pub limit: NonZeroU32,
}

/// What a request costs against one rule when it is admitted, and what is charged later.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    /// Units counted at admission.
    pub now: u32,
    /// A cost charged when it is known.
    pub later: Later,
    /// Whether the cost header held an invalid count (the default was used).
    pub invalid: bool,
}

/// A cost known after admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Later {
    /// None.
    Nothing,
    /// The request body's bytes, counted as it streams, charged when it ends.
    BodyBytes,
    /// The count in a response header, charged when the response headers arrive.
    ResponseHeader,
    /// The count in the response body, charged when it has been read.
    ResponseBody,
}

/// A count: decimal digits only, at most `u32::MAX` (`None` otherwise: invalid).
pub fn parse_count(raw: &[u8]) -> Option<u32> {
    let text = std::str::from_utf8(raw).ok()?.trim_matches(|c| c == ' ' || c == '\t');
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

/// A weighted sum's places, as the scanner reads them.
fn sum_of(terms: &[Term]) -> Usage {
    Usage::new(terms.iter().map(|t| (t.path.0.iter().map(String::as_str), t.weight.get().get())))
}

/// No places: what a rule that reads no body reads.
static NO_PLACES: Usage = Usage::EMPTY;

/// Each tier's name (the header's value) and limit, sorted by name.
type TierLimits = Vec<(Vec<u8>, NonZeroU32)>;

/// A rule's compiled extras.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Plan {
    condition: Option<Condition>,
    /// The tier header, and the tiers.
    tiers: Option<(String, TierLimits)>,
    /// Overridden keys' hashes and limits, sorted by hash.
    overrides: Vec<(u64, NonZeroU32)>,
    cost: Option<CostPlan>,
}

/// Where a key's limit comes from, when not from the rule's `limit` ([`Rules::limit_from`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitFrom {
    /// An entry of `overrides` (the key's).
    Override,
    /// A tier of `tiers` (the one the tier header names).
    Tier,
}

/// Every rule's conditions, limits and costs, compiled for the request path.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rules {
    plans: Vec<Plan>,
    /// Some rule reads its estimate from the request body.
    body_estimates: bool,
}

fn header_test(condition: &HeaderCondition) -> HeaderTest {
    match (&condition.equals, condition.present) {
        (Some(value), _) => HeaderTest::Equals(value.as_bytes().to_vec()),
        (None, present) => HeaderTest::Present(present.unwrap_or(true)),
    }
}

impl Rules {
    /// Compiles the rules of `config`; overrides are hashed with `hasher` (the keys' hasher).
    pub fn new(config: &Config, hasher: &KeyHasher) -> Rules {
        let plans = config
            .rate_limits
            .iter()
            .map(|rule| {
                let condition = rule.condition.as_ref().map(|m| Condition {
                    path: m.path.as_ref().and_then(PathTest::new),
                    methods: m.methods.as_ref().map(|ms| ms.iter().map(|x| x.as_bytes().to_vec()).collect()),
                    headers: m.headers.iter().map(|h| (h.name.clone(), header_test(h))).collect(),
                    authority: m.authority.as_ref().map(|a| a.as_bytes().to_vec()),
                    routes: m.routes.as_ref().map(|rs| rs.iter().map(|r| r.as_bytes().to_vec()).collect()),
                });
                let tiers = rule.tiers.as_ref().map(|t| {
                    let limits = t.limits.iter().map(|(name, limit)| (name.as_bytes().to_vec(), limit.get())).collect();
                    (t.header.clone(), limits)
                });
                let mut overrides: Vec<(u64, NonZeroU32)> = rule
                    .overrides
                    .iter()
                    .map(|o| (hasher.hash(o.key.iter().map(|v| Some(v.as_bytes()))), o.limit.get()))
                    .collect();
                overrides.sort_unstable_by_key(|(hash, _)| *hash);
                let cost = rule.cost.as_ref().map(|c| {
                    let estimate = c.estimate.as_ref().map(|e| Reservation {
                        header: e.header.clone(),
                        body: match (&e.body, &e.sum) {
                            (Some(places), _) => Some(Usage::first_of(places.iter().map(String::as_str))),
                            (None, Some(terms)) => Some(sum_of(terms)),
                            (None, None) => None,
                        },
                        body_bytes: e.max_body_bytes.map_or(DEFAULT_ESTIMATE_BODY_BYTES, |m| u64::from(m.get().get())),
                        default: e.default.get().get(),
                        max: e.max.get().get(),
                        unreported: c.unreported.unwrap_or_default(),
                    });
                    match (c.from, c.header.clone()) {
                    (CostSource::RequestBody, _) => CostPlan::RequestBody,
                    (CostSource::ResponseBody, _) => CostPlan::ResponseBody {
                        usage: match (&c.path, &c.sum) {
                            (Some(path), _) => Usage::path(path),
                            (None, Some(terms)) => sum_of(terms),
                            (None, None) => Usage::default(),
                        },
                        max_bytes: c.max_body_bytes.map_or(DEFAULT_MAX_BODY_BYTES, |m| u64::from(m.get().get())),
                        default: c.default_units(),
                        estimate,
                    },
                    (CostSource::RequestHeader, Some(header)) => CostPlan::RequestHeader { header, default: c.default_units() },
                    (CostSource::ResponseHeader, Some(header)) => CostPlan::ResponseHeader { header, default: c.default_units(), estimate },
                    // Refused by validation: a header cost names its header.
                    (_, None) => CostPlan::One,
                    }
                });
                Plan { condition, tiers, overrides, cost }
            })
            .collect();
        let body_estimates =
            config.rate_limits.iter().any(|r| r.cost.as_ref().and_then(|c| c.estimate.as_ref()).is_some_and(|e| e.body.is_some() || e.sum.is_some()));
        Rules { plans, body_estimates }
    }

    fn plan(&self, rule: usize) -> Option<&Plan> {
        self.plans.get(rule)
    }

    /// Whether rule `rule` applies to the request (no condition: always).
    pub fn applies<A: Attributes + ?Sized>(&self, rule: usize, request: &A) -> bool {
        self.plan(rule)
            .and_then(|p| p.condition.as_ref())
            .is_none_or(|condition| condition.holds(request))
    }

    /// The first condition of rule `rule`'s `match` that the request fails (`None`: the rule
    /// applies), tested as [`Rules::applies`] tests them.
    pub fn unmet<A: Attributes + ?Sized>(&self, rule: usize, request: &A) -> Option<Unmet<'_>> {
        self.plan(rule)?.condition.as_ref()?.unmet(request)
    }

    /// The limit of rule `rule` for the key of hash `key_hash`: an override's, else the tier's,
    /// else `None` (the rule's `limit`).
    pub fn limit<A: Attributes + ?Sized>(&self, rule: usize, key_hash: u64, request: &A) -> Option<NonZeroU32> {
        self.limit_from(rule, key_hash, request).map(|(_, limit)| limit)
    }

    /// [`Rules::limit`], with where it comes from.
    pub fn limit_from<A: Attributes + ?Sized>(&self, rule: usize, key_hash: u64, request: &A) -> Option<(LimitFrom, NonZeroU32)> {
        let plan = self.plan(rule)?;
        if let Ok(at) = plan.overrides.binary_search_by_key(&key_hash, |(hash, _)| *hash) {
            return plan.overrides.get(at).map(|(_, limit)| (LimitFrom::Override, *limit));
        }
        let (header, tiers) = plan.tiers.as_ref()?;
        let value = request.get(header)?;
        let at = tiers.binary_search_by(|(name, _)| name.as_slice().cmp(&value)).ok()?;
        tiers.get(at).map(|(_, limit)| (LimitFrom::Tier, *limit))
    }

    fn reservation(&self, rule: usize) -> Option<&Reservation> {
        match self.plan(rule).and_then(|p| p.cost.as_ref()) {
            Some(CostPlan::ResponseHeader { estimate, .. } | CostPlan::ResponseBody { estimate, .. }) => estimate.as_ref(),
            _ => None,
        }
    }

    /// Whether some rule reads its estimate from the request body (one flag: a configuration
    /// without does no more per request).
    pub fn reads_request_bodies(&self) -> bool {
        self.body_estimates
    }

    /// The readings of the request body for the rules that apply to the request and read their
    /// estimate there (the request has no estimate header); `None`: it is decided at once.
    pub fn body_estimates<A: Attributes + ?Sized>(&self, request: &A) -> Option<BodyEstimates> {
        let reading = (0..self.plans.len()).filter_map(|rule| {
            let reservation = self.reservation(rule)?;
            let places = reservation.body.as_ref()?;
            (self.applies(rule, request) && reservation.reads_body(request)).then_some((rule, places, reservation.body_bytes))
        });
        BodyEstimates::new(reading)
    }

    /// Rule `rule`'s places of the estimate in the request body.
    pub fn estimate_places(&self, rule: usize) -> &Usage {
        self.reservation(rule).and_then(|r| r.body.as_ref()).unwrap_or(&NO_PLACES)
    }

    /// What a request costs against rule `rule` at admission (`body`: what its body held for
    /// the rules that read their estimate there), and later.
    pub fn admission<A: Attributes + ?Sized>(&self, rule: usize, request: &A, body: Option<&BodyEstimates>) -> Admission {
        let one = Admission { now: 1, later: Later::Nothing, invalid: false };
        let Some(cost) = self.plan(rule).and_then(|p| p.cost.as_ref()) else { return one };
        match cost {
            CostPlan::One => one,
            CostPlan::RequestHeader { header, default } => match request.get(header) {
                None => Admission { now: *default, ..one },
                Some(raw) => match parse_count(&raw) {
                    Some(units) => Admission { now: units, ..one },
                    None => Admission { now: *default, invalid: true, ..one },
                },
            },
            CostPlan::RequestBody => match request.get("content-length") {
                Some(raw) => match parse_count(&raw) {
                    Some(bytes) => Admission { now: bytes, ..one },
                    // An unreadable length: count the body as it streams.
                    None => Admission { now: 0, later: Later::BodyBytes, invalid: true },
                },
                None => Admission { now: 0, later: Later::BodyBytes, invalid: false },
            },
            CostPlan::ResponseHeader { estimate, .. } | CostPlan::ResponseBody { estimate, .. } => {
                let later = if matches!(cost, CostPlan::ResponseBody { .. }) { Later::ResponseBody } else { Later::ResponseHeader };
                let (now, invalid) = estimate.as_ref().map_or((0, false), |e| e.units(request, body.and_then(|b| b.found(rule))));
                Admission { now, later, invalid }
            }
        }
    }

    /// What a response whose cost header holds `raw` (`None`: absent) tells rule `rule`.
    pub fn response_report(raw: Option<&[u8]>) -> Report {
        match raw.map(parse_count) {
            None => Report::Missing,
            Some(Some(units)) => Report::Count(units),
            Some(None) => Report::Invalid,
        }
    }

    /// The units rule `rule` charges in all for a response that told `report`, `reserved`
    /// having been counted at admission: the count, capped at `limit`; without one, the
    /// reservation (or nothing, as `unreported` says) for a rule with an estimate, else the
    /// rule's `cost.default`.
    pub fn settled_units(&self, rule: usize, report: Report, reserved: u32, limit: NonZeroU32) -> u32 {
        if let Report::Count(units) = report {
            return capped(units, limit);
        }
        let (default, estimate) = match self.plan(rule).and_then(|p| p.cost.as_ref()) {
            Some(CostPlan::ResponseHeader { default, estimate, .. } | CostPlan::ResponseBody { default, estimate, .. }) => (*default, estimate.as_ref()),
            _ => (0, None),
        };
        match estimate.map(|e| e.unreported) {
            Some(Unreported::Reservation) => reserved,
            Some(Unreported::Refund) => 0,
            None => capped(default, limit),
        }
    }

    /// A scan of a response body (`content_type`: the response's; `encoded`: it has a
    /// `content-encoding`) for rule `rule`'s count; `Err`: the body cannot be read for it
    /// ([`Report::Compressed`]); `None`: the rule reads no body.
    pub fn body_scan(&self, rule: usize, content_type: Option<&[u8]>, encoded: bool) -> Option<Result<UsageScan, Report>> {
        match self.plan(rule).and_then(|p| p.cost.as_ref()) {
            Some(CostPlan::ResponseBody { .. }) if encoded => Some(Err(Report::Compressed)),
            Some(CostPlan::ResponseBody { usage, max_bytes, .. }) => Some(Ok(UsageScan::new(Format::of(content_type), usage, *max_bytes))),
            _ => None,
        }
    }

    /// Where rule `rule`'s count is in a response body.
    pub fn body_usage(&self, rule: usize) -> &Usage {
        match self.plan(rule).and_then(|p| p.cost.as_ref()) {
            Some(CostPlan::ResponseBody { usage, .. }) => usage,
            _ => &NO_PLACES,
        }
    }

    /// Whether any rule reads its cost from a response body.
    pub fn reads_response_bodies(&self) -> bool {
        self.plans.iter().any(|p| matches!(p.cost, Some(CostPlan::ResponseBody { .. })))
    }

    /// The response header rule `rule` reads its cost from, if any.
    pub fn response_header(&self, rule: usize) -> Option<&str> {
        match self.plan(rule).and_then(|p| p.cost.as_ref()) {
            Some(CostPlan::ResponseHeader { header, .. }) => Some(header),
            _ => None,
        }
    }

    /// The request headers the rules read, each with whether requests usually carry it (for
    /// [`crate::pipeline::headers::HeaderPlan`]).
    pub fn request_headers(config: &Config) -> Vec<(String, bool)> {
        let mut names = Vec::new();
        for rule in &config.rate_limits {
            if let Some(condition) = &rule.condition {
                if condition.path.is_some() {
                    names.push((":path".to_owned(), true));
                }
                if condition.methods.is_some() {
                    names.push((":method".to_owned(), true));
                }
                if condition.authority.is_some() {
                    names.push((":authority".to_owned(), true));
                }
                names.extend(condition.headers.iter().map(|h| (h.name.clone(), false)));
            }
            if let Some(tiers) = &rule.tiers {
                names.push((tiers.header.clone(), true));
            }
            if let Some(header) = rule.cost.as_ref().and_then(|c| c.estimate.as_ref()).and_then(|e| e.header.clone()) {
                names.push((header, true));
            }
            match rule.cost.as_ref().map(|c| (c.from, c.header.clone())) {
                Some((CostSource::RequestHeader, Some(header))) => names.push((header, true)),
                Some((CostSource::RequestBody, _)) => names.push(("content-length".to_owned(), false)),
                _ => {}
            }
        }
        names
    }
}

/// The costs an admitted request still owes, settled when they are known: its body's bytes
/// (counted as the body streams, charged when it ends) and the units the upstream reports (in a
/// response header, or in the response body, read as it streams).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Charges {
    /// What each rule's key still owes.
    owed: Vec<Owed>,
    /// Request body bytes seen so far.
    body_bytes: u64,
    /// When the request was admitted (a reservation given back goes back to that window bucket).
    admitted_at: UnixMillis,
}

/// One rule's key's cost still owed.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Owed {
    probe: Probe,
    later: Later,
    limit: NonZeroU32,
    /// For [`Later::ResponseBody`], once the response headers came: the body's scan.
    scan: Option<Box<UsageScan>>,
}

impl Charges {
    /// Remembers that `probe` (admitted at `now`, `probe.cost` counted then) owes a cost known
    /// `later`, capped at `limit`.
    pub fn owe(&mut self, probe: Probe, later: Later, limit: NonZeroU32, now: UnixMillis) {
        if later != Later::Nothing {
            self.owed.push(Owed { probe, later, limit, scan: None });
            self.admitted_at = now;
        }
    }

    /// When the request was admitted.
    pub fn admitted_at(&self) -> UnixMillis {
        self.admitted_at
    }

    /// Whether anything is still owed.
    pub fn is_empty(&self) -> bool {
        self.owed.is_empty()
    }

    /// Whether a body count is owed (the body callbacks need to count).
    pub fn counts_body(&self) -> bool {
        self.owed.iter().any(|o| o.later == Later::BodyBytes)
    }

    /// Whether the response headers are awaited (a count in them, or a body to read).
    pub fn awaits_response(&self) -> bool {
        self.owed.iter().any(|o| o.later == Later::ResponseHeader || (o.later == Later::ResponseBody && o.scan.is_none()))
    }

    /// Whether the response body is being read for a count.
    pub fn reads_response_body(&self) -> bool {
        self.owed.iter().any(|o| o.scan.is_some())
    }

    /// A chunk of `bytes` of the request body went by.
    pub fn body(&mut self, bytes: usize) {
        self.body_bytes = self.body_bytes.saturating_add(u64::try_from(bytes).unwrap_or(u64::MAX));
    }

    /// The request body ended: the body charges.
    pub fn body_done(&mut self) -> Vec<Settle> {
        let bytes = u32::try_from(self.body_bytes).unwrap_or(u32::MAX);
        self.take(|o| (o.later == Later::BodyBytes).then_some(Report::Count(bytes)))
    }

    /// The response headers came: the response-header costs, from `report(rule)` (what the
    /// rule's header told); the body costs start reading, with `scan(rule)` (`None`: the
    /// response has no body, and told nothing; `Err`: a body that cannot be read, which tells
    /// that).
    pub fn response(
        &mut self,
        mut report: impl FnMut(usize) -> Report,
        mut scan: impl FnMut(usize) -> Option<Result<UsageScan, Report>>,
    ) -> Vec<Settle> {
        self.take(|o| match o.later {
            Later::ResponseHeader => Some(report(o.probe.rule)),
            Later::ResponseBody if o.scan.is_none() => match scan(o.probe.rule) {
                Some(Ok(body)) => {
                    o.scan = Some(Box::new(body));
                    None
                }
                Some(Err(unreadable)) => Some(unreadable),
                None => Some(Report::Missing),
            },
            _ => None,
        })
    }

    /// A chunk of the response body (`end`: the last): the body costs it settles (a count
    /// found, a body that cannot be read, or the body's end). `usage(rule)` is where the
    /// rule's count is.
    pub fn response_body<'a>(&mut self, chunk: &[u8], end: bool, path: impl Fn(usize) -> &'a Usage) -> Vec<Settle> {
        self.take(|o| {
            let rule = o.probe.rule;
            let scan = o.scan.as_mut()?;
            let mut state = scan.feed(chunk, path(rule));
            if end {
                state = scan.end(path(rule));
            }
            match state {
                Scan::Found(count) => Some(Report::Count(count)),
                Scan::Invalid => Some(Report::Invalid),
                Scan::Gave(_) => Some(Report::Unreadable),
                Scan::Reading(Some(count)) if end => Some(Report::Count(count)),
                Scan::Reading(None) if end => Some(Report::Missing),
                Scan::Reading(_) => None,
            }
        })
    }

    /// The stream ended: whatever is still owed (a body cut short: the bytes seen; a response
    /// that never came, or whose body never told: `Missing`; an event stream cut after a
    /// count: that count).
    pub fn end(&mut self) -> Vec<Settle> {
        let mut settled = self.body_done();
        settled.extend(self.take(|o| match o.scan.as_ref().map(|s| s.state()) {
            Some(Scan::Reading(Some(count))) => Some(Report::Count(count)),
            _ => Some(Report::Missing),
        }));
        settled
    }

    fn take(&mut self, mut report: impl FnMut(&mut Owed) -> Option<Report>) -> Vec<Settle> {
        let mut settled = Vec::new();
        self.owed.retain_mut(|owed| match report(owed) {
            Some(report) => {
                settled.push(Settle { probe: owed.probe, report, limit: owed.limit });
                false
            }
            None => true,
        });
        settled
    }
}

/// A cost capped at the limit (a request above it takes the whole window's quota).
pub fn capped(units: u32, limit: NonZeroU32) -> u32 {
    units.min(limit.get())
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Request(HashMap<&'static str, &'static str>);

    impl Attributes for Request {
        fn get(&self, name: &str) -> Option<Cow<'_, [u8]>> {
            self.0.get(name).map(|v| Cow::Borrowed(v.as_bytes()))
        }
    }

    fn request(pairs: &[(&'static str, &'static str)]) -> Request {
        Request(pairs.iter().copied().collect())
    }

    fn rules(rules_json: &str) -> Rules {
        let config = Config::parse(format!(r#"{{"rate_limits":{rules_json}}}"#).as_bytes()).unwrap();
        Rules::new(&config, &KeyHasher::new([3; 16]))
    }

    #[test]
    fn conditions_on_path_method_headers_and_authority() {
        let r = rules(
            r#"[
            {"name":"login","key":["source_ip"],"limit":5,"window":"1m","match":{"path":{"exact":"/login"},"methods":["POST"]}},
            {"name":"api","key":["source_ip"],"limit":5,"window":"1m","match":{"path":{"prefix":"/api/"}}},
            {"name":"orders","key":["source_ip"],"limit":5,"window":"1m","match":{"path":{"template":"/users/*/orders"}}},
            {"name":"anon","key":["source_ip"],"limit":5,"window":"1m","match":{"headers":[{"name":"Authorization","present":false}]}},
            {"name":"prod","key":["source_ip"],"limit":5,"window":"1m","match":{"headers":[{"name":"x-env","equals":"prod"}],"authority":"API.example.com"}}
        ]"#,
        );
        let applies = |rule: usize, pairs: &[(&'static str, &'static str)]| r.applies(rule, &request(pairs));
        assert!(applies(0, &[(":path", "/login?next=/"), (":method", "POST")]));
        assert!(!applies(0, &[(":path", "/login"), (":method", "GET")]));
        assert!(!applies(0, &[(":path", "/login/x"), (":method", "POST")]));
        assert!(!applies(0, &[(":method", "POST")]), "no path: no match");
        assert!(applies(1, &[(":path", "/api/v1")]) && !applies(1, &[(":path", "/apix")]));
        assert!(applies(2, &[(":path", "/users/42/orders")]));
        assert!(!applies(2, &[(":path", "/users//orders")]), "* is one non-empty segment");
        assert!(!applies(2, &[(":path", "/users/42/orders/7")]));
        assert!(!applies(2, &[(":path", "/users/42")]));
        assert!(applies(3, &[]) && !applies(3, &[("authorization", "Bearer x")]));
        assert!(applies(4, &[("x-env", "prod"), (":authority", "api.EXAMPLE.com:8443")]));
        assert!(!applies(4, &[("x-env", "prod2"), (":authority", "api.example.com")]));
        assert!(!applies(4, &[("x-env", "prod"), (":authority", "evil.com")]));
    }

    #[test]
    fn unmet_names_the_first_condition_that_fails_as_applies_tests_them() {
        let r = rules(
            r#"[{"name":"a","key":["source_ip"],"limit":5,"window":"1m",
                 "match":{"path":{"prefix":"/api/"},"methods":["POST"],"headers":[{"name":"X-Env","equals":"prod"}],
                          "authority":"api.example.com","routes":["checkout"]}},
                {"name":"b","key":["source_ip"],"limit":5,"window":"1m"}]"#,
        );
        let all = [(":path", "/api/x"), (":method", "POST"), ("x-env", "prod"), (":authority", "api.example.com")];
        struct Routed(Request, Option<&'static str>);
        impl Attributes for Routed {
            fn get(&self, name: &str) -> Option<Cow<'_, [u8]>> {
                self.0.get(name)
            }
            fn route(&self) -> Option<Cow<'_, [u8]>> {
                self.1.map(|r| Cow::Borrowed(r.as_bytes()))
            }
        }
        let unmet = |drop: Option<&str>, route: Option<&'static str>| {
            let pairs: Vec<_> = all.iter().copied().filter(|(name, _)| Some(*name) != drop).collect();
            let request = Routed(request(&pairs), route);
            let unmet = r.unmet(0, &request);
            assert_eq!(unmet.is_none(), r.applies(0, &request));
            unmet
        };
        assert_eq!(unmet(None, Some("checkout")), None);
        assert_eq!(unmet(Some(":path"), Some("checkout")), Some(Unmet::Path));
        assert_eq!(unmet(Some(":method"), None), Some(Unmet::Method), "the first that fails");
        assert_eq!(unmet(Some("x-env"), Some("checkout")), Some(Unmet::Header("x-env")));
        assert_eq!(unmet(Some(":authority"), Some("checkout")), Some(Unmet::Authority));
        assert_eq!(unmet(None, Some("cart")), Some(Unmet::Route));
        assert_eq!(r.unmet(1, &request(&[])), None, "no match: always applies");
    }

    #[test]
    fn limits_come_from_an_override_then_a_tier_then_the_rule() {
        let r = rules(
            r#"[{"name":"plan","key":[{"header":"x-api-key"}],"limit":10,"window":"1m",
                 "tiers":{"header":"X-Plan","limits":{"gold":1000,"silver":100}},
                 "overrides":[{"key":["vip"],"limit":5000}]}]"#,
        );
        let hasher = KeyHasher::new([3; 16]);
        let hash = |key: &str| hasher.hash([Some(key.as_bytes())]);
        let limit = |key: &str, pairs: &[(&'static str, &'static str)]| r.limit(0, hash(key), &request(pairs)).map(NonZeroU32::get);
        assert_eq!(limit("vip", &[("x-plan", "silver")]), Some(5000), "the override first");
        assert_eq!(limit("k", &[("x-plan", "gold")]), Some(1000));
        assert_eq!(limit("k", &[("x-plan", "silver")]), Some(100));
        assert_eq!(limit("k", &[("x-plan", "platinum")]), None, "unknown tier: the rule's limit");
        assert_eq!(limit("k", &[]), None);
        let from = |key: &str, pairs: &[(&'static str, &'static str)]| r.limit_from(0, hash(key), &request(pairs)).map(|(from, _)| from);
        assert_eq!(from("vip", &[("x-plan", "gold")]), Some(LimitFrom::Override));
        assert_eq!(from("k", &[("x-plan", "gold")]), Some(LimitFrom::Tier));
        assert_eq!(from("k", &[]), None);
    }

    #[test]
    fn costs_and_their_bad_values() {
        let r = rules(
            r#"[{"name":"h","key":["source_ip"],"limit":10,"window":"1m","cost":{"from":"request_header","header":"x-cost"}},
                {"name":"b","key":["source_ip"],"limit":10,"window":"1m","cost":{"from":"request_body"}},
                {"name":"t","key":["source_ip"],"limit":10,"window":"1m","cost":{"from":"response_header","header":"x-tokens","default":2}},
                {"name":"plain","key":["source_ip"],"limit":10,"window":"1m"}]"#,
        );
        let now = |rule, pairs: &[(&'static str, &'static str)]| r.admission(rule, &request(pairs), None);
        assert_eq!(now(0, &[("x-cost", "7")]).now, 7);
        assert_eq!(now(0, &[]), Admission { now: 1, later: Later::Nothing, invalid: false }, "absent: the default, 1");
        for bad in ["-1", "1.5", "seven", "", "99999999999", "0x10", "+3"] {
            let x = now(0, &[("x-cost", bad)]);
            assert_eq!((x.now, x.invalid), (1, true), "{bad:?}");
        }
        assert_eq!(now(0, &[("x-cost", " 12 ")]).now, 12, "spaces around are fine");
        assert_eq!(now(1, &[("content-length", "2048")]).now, 2048);
        assert_eq!(now(1, &[]), Admission { now: 0, later: Later::BodyBytes, invalid: false });
        assert_eq!(now(2, &[]).later, Later::ResponseHeader);
        let ten = NonZeroU32::new(10).unwrap();
        assert_eq!(Rules::response_report(Some(b"15")), Report::Count(15));
        assert_eq!(r.settled_units(2, Report::Count(15), 0, ten), 10, "capped at the limit");
        assert_eq!(r.settled_units(2, Rules::response_report(None), 0, ten), 2, "no report: the default");
        assert_eq!(Rules::response_report(Some(b"lots")), Report::Invalid);
        assert_eq!(r.settled_units(2, Report::Invalid, 0, ten), 2);
        assert_eq!(r.response_header(2), Some("x-tokens"));
        assert_eq!(now(3, &[("x-cost", "7")]).now, 1);
        assert_eq!(capped(u32::MAX, NonZeroU32::new(10).unwrap()), 10);
    }

    fn settle(probe: Probe, report: Report, limit: u32) -> Settle {
        Settle { probe, report, limit: NonZeroU32::new(limit).unwrap() }
    }

    #[test]
    fn charges_owed_are_settled_once_when_known() {
        let limit = |n| NonZeroU32::new(n).unwrap();
        let at = UnixMillis(1_000);
        let mut charges = Charges::default();
        charges.owe(Probe::new(0, 1), Later::BodyBytes, limit(1000), at);
        charges.owe(Probe::new(1, 1), Later::ResponseHeader, limit(50), at);
        charges.owe(Probe::new(2, 1), Later::Nothing, limit(5), at);
        assert!(charges.counts_body() && charges.awaits_response());
        assert_eq!(charges.admitted_at(), at);
        charges.body(600);
        charges.body(700);
        assert_eq!(charges.body_done(), vec![settle(Probe::new(0, 1), Report::Count(1300), 1000)]);
        assert!(charges.body_done().is_empty(), "once");
        assert_eq!(charges.response(|rule| Report::Count(u32::try_from(rule).unwrap() * 80), |_| None), vec![settle(Probe::new(1, 1), Report::Count(80), 50)]);
        assert!(charges.is_empty());
        let mut cut = Charges::default();
        cut.owe(Probe::new(0, 2), Later::BodyBytes, limit(1000), at);
        cut.owe(Probe::new(1, 2), Later::ResponseHeader, limit(50), at);
        cut.body(10);
        assert_eq!(cut.end(), vec![settle(Probe::new(0, 2), Report::Count(10), 1000), settle(Probe::new(1, 2), Report::Missing, 50)], "the stream ended first");
    }

    #[test]
    fn body_counts_are_read_as_the_body_streams() {
        let r = rules(
            r#"[{"name":"total","key":["source_ip"],"limit":1000,"window":"1m",
                 "cost":{"from":"response_body","path":"usage.total_tokens","estimate":{"header":"x-max-tokens","default":50,"max":400}}},
                {"name":"out","key":["source_ip"],"limit":1000,"window":"1m",
                 "cost":{"from":"response_body","path":"usage.completion_tokens","max_body_bytes":64,"estimate":{"default":10,"max":10},"unreported":"refund"}}]"#,
        );
        let at = |pairs: &[(&'static str, &'static str)]| r.admission(0, &request(pairs), None);
        assert_eq!(at(&[("x-max-tokens", "100")]), Admission { now: 100, later: Later::ResponseBody, invalid: false });
        assert_eq!(at(&[("x-max-tokens", "100000")]).now, 400, "capped at estimate.max");
        assert_eq!(at(&[]), Admission { now: 50, later: Later::ResponseBody, invalid: false });
        for bad in ["-1", "1e9", "abc", ""] {
            assert_eq!(at(&[("x-max-tokens", bad)]), Admission { now: 50, later: Later::ResponseBody, invalid: true }, "{bad:?}");
        }
        let limit = NonZeroU32::new(1000).unwrap();
        assert_eq!(r.settled_units(0, Report::Missing, 100, limit), 100, "unreported: the reservation stays");
        assert_eq!(r.settled_units(1, Report::Unreadable, 10, limit), 0, "unreported: refund");
        assert_eq!(r.settled_units(0, Report::Count(30), 100, limit), 30);

        let owe = |charges: &mut Charges| {
            charges.owe(Probe::new(0, 1), Later::ResponseBody, limit, UnixMillis(5));
            charges.owe(Probe::new(1, 1), Later::ResponseBody, limit, UnixMillis(5));
        };
        let body = br#"{"choices":[{"message":{"content":"hello"}}],"usage":{"prompt_tokens":12,"completion_tokens":18,"total_tokens":30}}"#;
        let mut json = Charges::default();
        owe(&mut json);
        assert_eq!(json.response(|_| Report::Missing, |rule| r.body_scan(rule, Some(b"application/json"), false)), vec![]);
        assert!(json.reads_response_body() && !json.awaits_response());
        let (head, tail) = body.split_at(70);
        assert_eq!(json.response_body(head, false, |rule| r.body_usage(rule)), vec![settle(Probe::new(1, 1), Report::Unreadable, 1000)], "past 64 bytes");
        assert_eq!(json.response_body(tail, false, |rule| r.body_usage(rule)), vec![settle(Probe::new(0, 1), Report::Count(30), 1000)], "found before the end");
        assert!(json.is_empty());

        let mut events = Charges::default();
        owe(&mut events);
        events.response(|_| Report::Missing, |rule| r.body_scan(rule, Some(b"text/event-stream"), false));
        let sse = b"data: {\"usage\":null}\n\ndata: {\"usage\":{\"total_tokens\":9}}\n\n";
        assert!(events.response_body(sse, false, |rule| r.body_usage(rule)).is_empty(), "the last event decides");
        assert_eq!(events.end(), vec![settle(Probe::new(0, 1), Report::Count(9), 1000), settle(Probe::new(1, 1), Report::Missing, 1000)], "cut: the last count seen");

        let mut gzipped = Charges::default();
        owe(&mut gzipped);
        let settled = gzipped.response(|_| Report::Missing, |rule| r.body_scan(rule, Some(b"application/json"), true));
        assert_eq!(settled, vec![settle(Probe::new(0, 1), Report::Compressed, 1000), settle(Probe::new(1, 1), Report::Compressed, 1000)], "a compressed body is not read");
        assert_eq!(r.settled_units(0, Report::Compressed, 100, limit), 100, "unreported: the reservation stays");

        let mut headless = Charges::default();
        owe(&mut headless);
        assert_eq!(headless.response(|_| Report::Missing, |_| None).len(), 2, "no body: nothing reported");
    }

    #[test]
    fn counts_parse_strictly() {
        assert_eq!(parse_count(b"0"), Some(0));
        assert_eq!(parse_count(b"4294967295"), Some(u32::MAX));
        assert_eq!(parse_count(b"4294967296"), None);
        assert_eq!(parse_count(b"\xff"), None);
    }
}
