//! `floodgate explain`: what the filter would do with one request, decision by decision.
//!
//! Every decision is the module's own code, so this command and the proxy never disagree:
//! whether a rule applies and which condition fails ([`Rules::applies`], [`Rules::unmet`]), the
//! key's parts as the rule reads them ([`KeyPart::source`], [`KeyPart::normalize`], and
//! [`probes_where`], which also tells a rule skipped for a missing part), the limit and where it
//! comes from ([`Rules::limit_from`]), the cost ([`Rules::admission`], [`capped`]), the effective
//! mode ([`Config::shadows`]), the partition ([`Partitioner`]), the priority class
//! ([`Classes::class_of`]) and its shedding thresholds ([`Shedder`], [`LagMonitor`]).

use floodgate::config::{Config, Consistency, CostSource, KeyPart, MissingKey, Mode, RateLimitRule, RefusalFormat, Scope};
use floodgate::keys::{hash_key, strip_port, KeyHasher, Source};
use floodgate::keys::fleet::{FleetHasher, FleetKeys};
use floodgate::ratelimit::probes::probes_where;
use floodgate::ratelimit::rules::{capped, Attributes, Later, LimitFrom, Rules, Unmet};
use floodgate::replies::is_health_method;
use floodgate::pipeline::Stage;
use floodgate::selection::partition::Partitioner;
use floodgate::shedding::lag::LagMonitor;
use floodgate::shedding::{Classes, Shedder};
use std::borrow::Cow;
use std::fmt::Write as _;

/// The request `floodgate explain` describes: what the filter reads of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// `:method` (default `GET`).
    pub method: String,
    /// `:path`, query included (default `/`).
    pub path: String,
    /// `:authority`, if any.
    pub authority: Option<String>,
    /// The name of the Envoy route it matched (`xds.route_name`), if any.
    pub route: Option<String>,
    /// Other request headers: lower-case name and value, in order (the first of a name counts).
    pub headers: Vec<(String, String)>,
    /// The downstream address (`source.address`), with or without its port.
    pub source_ip: Option<String>,
}

impl Default for Request {
    fn default() -> Request {
        Request {
            method: "GET".into(),
            path: "/".into(),
            authority: None,
            route: None,
            headers: Vec::new(),
            source_ip: None,
        }
    }
}

impl Request {
    /// The (first) value of a request header (pseudo-headers included), as the host gives it.
    fn header(&self, name: &str) -> Option<&[u8]> {
        match name {
            ":method" => Some(self.method.as_bytes()),
            ":path" => Some(self.path.as_bytes()),
            ":authority" => self.authority.as_deref().map(str::as_bytes),
            _ => self.headers.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_bytes()),
        }
    }

    /// What a key part reads, as the filter fetches it from the host.
    fn fetch(&self, source: Source<'_>) -> Option<&[u8]> {
        match source {
            Source::Header(name) => self.header(name),
            Source::SourceAddress => self.source_ip.as_deref().map(str::as_bytes),
        }
    }

    /// `options`: the command's arguments after `explain`; returns the CONFIG file and the
    /// request, or a usage error.
    pub fn from_args(options: &[String]) -> Result<(String, Request), String> {
        let mut request = Request::default();
        let mut file = None;
        let mut args = options.iter();
        while let Some(arg) = args.next() {
            if !arg.starts_with("--") {
                if file.replace(arg.clone()).is_some() {
                    return Err(format!("one CONFIG only, got a second: {arg}"));
                }
                continue;
            }
            let (option, inline) = match arg.split_once('=') {
                Some((option, value)) => (option, Some(value.to_owned())),
                None => (arg.as_str(), None),
            };
            let known = ["--method", "--path", "--authority", "--route", "--header", "--source-ip"];
            if !known.contains(&option) {
                return Err(format!("unknown option {option}"));
            }
            let value = match inline.or_else(|| args.next().cloned()) {
                Some(value) => value,
                None => return Err(format!("{option} needs a value")),
            };
            match option {
                "--method" => {
                    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_graphic()) {
                        return Err(format!("--method {value:?}: not a method"));
                    }
                    request.method = value;
                }
                "--path" => {
                    if value.is_empty() || value.chars().any(char::is_control) {
                        return Err(format!("--path {value:?}: not a path"));
                    }
                    request.path = value;
                }
                "--authority" => request.authority = Some(value),
                "--route" => request.route = Some(value),
                "--source-ip" => {
                    let address = String::from_utf8_lossy(strip_port(value.as_bytes())).into_owned();
                    if address.parse::<std::net::IpAddr>().is_err() {
                        return Err(format!("--source-ip {value:?}: not an IP address (optionally with :port)"));
                    }
                    request.source_ip = Some(value);
                }
                _ => {
                    let (name, header_value) = header_of(&value)?;
                    request.headers.push((name, header_value));
                }
            }
        }
        let file = file.ok_or("no CONFIG given")?;
        Ok((file, request))
    }

    /// One line: the request as the filter sees it.
    fn describe(&self) -> String {
        let mut text = format!("{} {}", self.method, self.path);
        match &self.authority {
            Some(authority) => write!(text, ", authority {authority:?}").ok(),
            None => write!(text, ", no authority").ok(),
        };
        match &self.route {
            Some(route) => write!(text, ", route {route:?}").ok(),
            None => write!(text, ", no route name").ok(),
        };
        match &self.source_ip {
            Some(address) => write!(text, ", from {address}").ok(),
            None => write!(text, ", no source address").ok(),
        };
        for (name, value) in &self.headers {
            let _ = write!(text, ", {name}: {value:?}");
        }
        text
    }
}

/// `name:value` (`--header`): the name checked (an RFC 9110 token) and lower-cased, as Envoy
/// stores it; the value with its surrounding blanks trimmed, as HTTP parsers do.
fn header_of(text: &str) -> Result<(String, String), String> {
    let Some((name, value)) = text.split_once(':') else {
        return Err(format!("--header {text:?}: expected name:value"));
    };
    let token = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    if name.is_empty() || !name.chars().all(token) {
        return Err(format!(
            "--header {text:?}: {name:?} is not a header name (use --method, --path and --authority for those)"
        ));
    }
    Ok((name.to_ascii_lowercase(), value.trim_matches([' ', '\t']).to_owned()))
}

impl Attributes for Request {
    fn get(&self, name: &str) -> Option<Cow<'_, [u8]>> {
        self.header(name).map(Cow::Borrowed)
    }

    fn route(&self) -> Option<Cow<'_, [u8]>> {
        self.route.as_deref().map(|r| Cow::Borrowed(r.as_bytes()))
    }
}

fn quoted(bytes: &[u8]) -> String {
    format!("{:?}", String::from_utf8_lossy(bytes))
}

fn list(items: &[String]) -> String {
    format!("[{}]", items.join(", "))
}

/// The effective mode of a mechanism whose own mode is `mode`, said with where it comes from.
fn mode_text(config: &Config, mode: Mode, own: &str) -> String {
    match (config.shadows(mode), config.mode == Mode::Shadow) {
        (false, _) => "enforce".into(),
        (true, true) => "shadow (the top-level mode): counts what it would refuse, lets the request go on".into(),
        (true, false) => format!("shadow ({own}): counts what it would refuse, lets the request go on"),
    }
}

/// A key's parts as the filter reads them: `header:x-api-key "k", source_ip "10.0.0.1"`, and
/// the values (`None` for a missing part).
fn key_values<'r>(parts: &[KeyPart], request: &'r Request) -> (String, Vec<Option<&'r [u8]>>) {
    let values: Vec<Option<&[u8]>> = parts.iter().map(|part| request.fetch(part.source()).map(|raw| part.normalize(raw))).collect();
    let text: Vec<String> = parts
        .iter()
        .zip(&values)
        .map(|(part, value)| match value {
            Some(value) => format!("{part} {}", quoted(value)),
            None => format!("{part} (missing)"),
        })
        .collect();
    (text.join(", "), values)
}

/// Why a rule's `match` fails, in words.
fn why_not(rule: &RateLimitRule, unmet: Unmet<'_>, request: &Request) -> String {
    let Some(condition) = &rule.condition else { return "its match fails".into() };
    match unmet {
        Unmet::Path => {
            let wanted = condition.path.as_ref().map_or_else(String::new, |p| {
                [("exact", &p.exact), ("prefix", &p.prefix), ("template", &p.template)]
                    .iter()
                    .find_map(|(kind, value)| value.as_ref().map(|v| format!("{kind} {v:?}")))
                    .unwrap_or_default()
            });
            let path = KeyPart::Path.normalize(request.path.as_bytes());
            format!("path {} does not match match.path {wanted}", quoted(path))
        }
        Unmet::Method => {
            let methods = condition.methods.clone().unwrap_or_default();
            format!("method {:?} is not one of match.methods {}", request.method, list(&methods))
        }
        Unmet::Header(name) => {
            let wanted: Vec<String> = condition
                .headers
                .iter()
                .filter(|h| h.name == name)
                .map(|h| match (&h.equals, h.present) {
                    (Some(value), _) => format!("equal to {value:?}"),
                    (None, Some(false)) => "absent".into(),
                    (None, _) => "present".into(),
                })
                .collect();
            let actual = match request.header(name) {
                Some(value) => format!("is {}", quoted(value)),
                None => "is absent".into(),
            };
            format!("header {name} {actual}, match.headers wants it {}", wanted.join(" and "))
        }
        Unmet::Authority => {
            let wanted = condition.authority.clone().unwrap_or_default();
            match &request.authority {
                Some(authority) => format!("authority {authority:?} is not match.authority {wanted:?} (compared without port, any case)"),
                None => format!("no authority, match.authority is {wanted:?} (give --authority)"),
            }
        }
        Unmet::Route => {
            let routes = condition.routes.clone().unwrap_or_default();
            match &request.route {
                Some(route) => format!("route {route:?} is not one of match.routes {}", list(&routes)),
                None => format!("no route name, match.routes is {} (give --route)", list(&routes)),
            }
        }
    }
}

/// What one configuration does with `request`, in readable lines (each indented by two spaces).
pub fn explain(config: &Config, request: &Request) -> String {
    let mut out = String::new();
    let mut line = |text: String| {
        out.push_str("  ");
        out.push_str(&text);
        out.push('\n');
    };
    line(format!("request: {}", request.describe()));
    if config.mode == Mode::Shadow {
        line("mode: shadow (top-level): every mechanism only counts what it would refuse".into());
    }
    let endpoints = [
        config.health.as_ref().map(|h| ("health", h.path.as_str(), "the health endpoint")),
        config.watchdog.as_ref().map(|w| ("watchdog", w.path.as_str(), "the watchdog's liveness path")),
    ];
    for (section, path, what) in endpoints.into_iter().flatten() {
        if KeyPart::Path.normalize(request.path.as_bytes()) == path.as_bytes() && is_health_method(request.method.as_bytes()) {
            line(format!(
                "{section}: {} {path} is {what}: the filter answers it itself, nothing else applies",
                request.method
            ));
            return out;
        }
    }
    // The stages in the order the filter runs them. A wait for the body decides nothing, and the
    // endpoints are answered above; the queue is told with shedding, leased rules and the delay
    // with the rate-limit rules.
    for stage in Stage::ORDER {
        match stage {
            Stage::Shed => load_shedding(config, request, &mut line),
            Stage::Cap => per_key_cap(config, request, &mut line),
            Stage::RateLimit => rate_limits(config, request, &mut line),
            Stage::Select => cluster_selection(config, request, &mut line),
            Stage::Body | Stage::Endpoints | Stage::Queue | Stage::Leased | Stage::Delay => {}
        }
    }
    out
}

fn rate_limits(config: &Config, request: &Request, line: &mut impl FnMut(String)) {
    if config.rate_limits.is_empty() {
        line("rate limits: none".into());
        return;
    }
    // Any seed: nothing shown depends on it (an override matches by key under every seed).
    let hasher = KeyHasher::new([0; 16]);
    let rules = Rules::new(config, &hasher);
    let mut skipped = Vec::new();
    // The fleet-wide ids, as every proxy of the fleet computes them (the store's keys).
    let fleet = config.global.as_ref().map(|g| FleetHasher::new(g.key_secret.as_deref()));
    let mut fleet_keys = FleetKeys::default();
    let probes = probes_where(
        config,
        &hasher,
        |source| request.fetch(source),
        &mut skipped,
        |rule| rules.applies(rule, request),
        |index, rule, parts| {
            if let Some(fleet) = &fleet {
                fleet_keys.keep(fleet, index, rule, parts);
            }
        },
    );
    for (index, rule) in config.rate_limits.iter().enumerate() {
        let title = format!("rate_limits[{index}] {:?}", rule.name.as_str());
        if let Some(unmet) = rules.unmet(index, request) {
            line(format!("{title}: does not apply: {}", why_not(rule, unmet, request)));
            continue;
        }
        let (key, values) = key_values(&rule.key, request);
        let Some(probe) = probes.iter().find(|p| p.rule == index) else {
            let missing: Vec<String> =
                rule.key.iter().zip(&values).filter(|(_, v)| v.is_none()).map(|(p, _)| p.to_string()).collect();
            let skip = if skipped.contains(&index) { " (missing_key: skip)" } else { "" };
            line(format!("{title}: does not apply: key part {} is missing{skip}", missing.join(", ")));
            continue;
        };
        line(format!("{title}: applies"));
        let detail = |text: String| format!("  {text}");
        line(detail(format!("mode: {}", mode_text(config, rule.mode, "the rule's mode"))));
        if values.iter().any(Option::is_none) && rule.missing_key == MissingKey::Shared {
            line(detail(format!(
                "key: {key}: one counter for every request lacking a part (missing_key: shared)"
            )));
        } else {
            line(detail(format!("key: {key}")));
        }
        let limit = match rules.limit_from(index, probe.key_hash, request) {
            Some((LimitFrom::Override, limit)) => {
                let at = rule.overrides.iter().position(|o| {
                    o.key.len() == values.len() && o.key.iter().zip(&values).all(|(k, v)| Some(k.as_bytes()) == *v)
                });
                let at = at.map_or_else(String::new, |at| format!("[{at}]"));
                line(detail(format!("limit: {limit} per {} (overrides{at}: this key's own limit)", rule.window)));
                limit
            }
            Some((LimitFrom::Tier, limit)) => {
                let (header, tier) = rule
                    .tiers
                    .as_ref()
                    .map(|t| (t.header.as_str(), request.header(&t.header).map(quoted).unwrap_or_default()))
                    .unwrap_or_default();
                line(detail(format!("limit: {limit} per {} (tier {tier}, named by header {header})", rule.window)));
                limit
            }
            None => {
                let limit = rule.limit.get();
                let why = match &rule.tiers {
                    Some(tiers) => match request.header(&tiers.header) {
                        Some(value) => format!("; header {} {} names no tier", tiers.header, quoted(value)),
                        None => format!("; no {} header to name a tier", tiers.header),
                    },
                    None => String::new(),
                };
                line(detail(format!("limit: {limit} per {} (the rule's limit{why})", rule.window)));
                limit
            }
        };
        line(detail(format!("cost: {}", cost_text(rule, &rules, index, request, limit))));
        let format = match rule.refusal_format.unwrap_or(config.refusal_format) {
            RefusalFormat::Problem => None,
            RefusalFormat::Openai => Some("OpenAI's error object (application/json, code rate_limit_exceeded)"),
            RefusalFormat::Anthropic => Some("Anthropic's error object (application/json, type rate_limit_error)"),
        };
        if let Some(format) = format {
            line(detail(format!("refusal: a 429 with {format} instead of the problem document; the same headers")));
        }
        let scope = match (rule.scope, rule.consistency) {
            (Scope::Proxy, _) => "proxy (the workers of this Envoy share the quota)".to_owned(),
            (Scope::Global, Consistency::Batched) => "global, consistency batched (the fleet shares the quota, synced in batches)".to_owned(),
            (Scope::Global, Consistency::Leased) => "global, consistency leased (units leased from the store ahead of use)".to_owned(),
        };
        line(detail(format!("scope: {scope}")));
        if let Some(id) = fleet_keys.of(index) {
            let window_ms = rule.window.get().get();
            line(detail(format!(
                "store key: {:032x} (who holds it: floodgate-sync's GET /v1/holders?key={:032x}&window_ms={window_ms})",
                id.0, id.0
            )));
        }
    }
}

fn cost_text(rule: &RateLimitRule, rules: &Rules, index: usize, request: &Request, limit: std::num::NonZeroU32) -> String {
    let admission = rules.admission(index, request, None);
    let now = capped(admission.now, limit);
    let cap = if now < admission.now { format!(", capped at the limit from {}", admission.now) } else { String::new() };
    let units = |n: u32| if n == 1 { "1 unit".to_owned() } else { format!("{n} units") };
    let Some(cost) = &rule.cost else { return format!("{} now (1 per request)", units(now)) };
    let header = cost.header.clone().unwrap_or_default();
    match (cost.from, admission.later) {
        (CostSource::RequestHeader, _) => match request.header(&header) {
            None => format!("{} now (request header {header} absent: cost.default{cap})", units(now)),
            Some(raw) if admission.invalid => {
                format!("{} now (request header {header} {} is not a count: cost.default{cap})", units(now), quoted(raw))
            }
            Some(_) => format!("{} now (request header {header}{cap})", units(now)),
        },
        (CostSource::RequestBody, Later::BodyBytes) => {
            let why = if admission.invalid { "content-length is not a count" } else { "no content-length" };
            format!("0 units now; later the request body's bytes, counted as it streams and charged when it ends ({why}), capped at the limit {limit}")
        }
        (CostSource::RequestBody, _) => format!("{} now (the request body's content-length{cap})", units(now)),
        (CostSource::ResponseHeader | CostSource::ResponseBody, _) => {
            let place = match (cost.from, &cost.sum) {
                (CostSource::ResponseBody, Some(terms)) => format!(
                    "{} in the response body (JSON, or the events of a text/event-stream: each place's last value), charged when read as the body streams",
                    sum_text(terms)
                ),
                (CostSource::ResponseBody, None) => format!(
                    "at {} in the response body (JSON, or the last event of a text/event-stream that has one), charged when read as the body streams",
                    cost.path.clone().unwrap_or_default()
                ),
                _ => format!("in response header {header}, charged when the response arrives"),
            };
            match &cost.estimate {
                Some(estimate) => {
                    let from = match (&estimate.header, admission.invalid) {
                        (Some(h), true) => format!("request header {h} is not a count: estimate.default"),
                        (Some(h), false) if request.header(h).is_some() => format!("request header {h}, at most estimate.max {}", estimate.max.get()),
                        (header, false) if estimate.body.is_some() || estimate.sum.is_some() => {
                            let places = match (&estimate.body, &estimate.sum) {
                                (Some(places), _) => format!("JSON body's {} (the first listed it holds", places.join(", ")),
                                (None, Some(terms)) => format!("JSON body: {} (each term at the first of its places the body holds", sum_text(terms)),
                                (None, None) => String::new(),
                            };
                            let absent = header.as_ref().map_or(String::new(), |h| format!("request header {h} absent: "));
                            format!("{absent}the request waits for its {places}, at most estimate.max {}; this shows estimate.default, the body not being given)", estimate.max.get())
                        }
                        (Some(h), false) => format!("request header {h} absent: estimate.default"),
                        (None, _) => "estimate.default".to_owned(),
                    };
                    let unreported = match cost.unreported.unwrap_or_default() {
                        floodgate::config::Unreported::Reservation => "the reservation stays charged",
                        floodgate::config::Unreported::Refund => "the reservation is given back",
                    };
                    format!(
                        "{} reserved now ({from}{cap}); later the count {place}, capped at the limit {limit}, settles it: the difference is given back or charged (without a valid count: {unreported})",
                        units(now)
                    )
                }
                None => format!(
                    "{} now; later the count {place} ({} without a valid count), capped at the limit {limit}",
                    units(now),
                    units(cost.default_units())
                ),
            }
        }
    }
}

/// `usage.input_tokens | message.usage.input_tokens + 4 × usage.output_tokens`.
fn sum_text(terms: &[floodgate::config::Term]) -> String {
    let term = |t: &floodgate::config::Term| {
        let places = t.path.0.join(" | ");
        let places = if t.path.0.len() > 1 { format!("({places})") } else { places };
        match t.weight.get().get() {
            1 => places,
            weight => format!("{weight} × {places}"),
        }
    };
    format!("the sum {}", terms.iter().map(term).collect::<Vec<_>>().join(" + "))
}

fn cluster_selection(config: &Config, request: &Request, line: &mut impl FnMut(String)) {
    let Some(selection) = &config.cluster_selection else { return };
    let names = |indexes: &[usize]| -> String {
        indexes.iter().filter_map(|i| selection.clusters.get(*i)).map(|c| c.as_str()).collect::<Vec<_>>().join(", ")
    };
    let (Some(settings), Some(partitioner)) = (&selection.partition, Partitioner::new(selection)) else {
        let all: Vec<usize> = (0..selection.clusters.len()).collect();
        line(format!("cluster selection: among every cluster ({}), no partition", names(&all)));
        return;
    };
    let (key, _) = key_values(partitioner.key(), request);
    let mode = mode_text(config, settings.mode, "cluster_selection.partition.mode");
    match partitioner.key_hash(|source| request.fetch(source)) {
        None => line(format!("partition: key {key}: not confined, may use every cluster; mode {mode}")),
        Some(hash) => {
            let confinement = partitioner.confine(hash);
            let when = match confinement.spill_below {
                None => "refuse when they have no room".to_owned(),
                Some(below) => format!("spill to the others when they are full or all below {below}"),
            };
            line(format!(
                "partition: key {key}: clusters {} ({} of {}; {when}); mode {mode}",
                names(&confinement.members),
                confinement.members.len(),
                selection.clusters.len()
            ));
        }
    }
}

fn load_shedding(config: &Config, request: &Request, line: &mut impl FnMut(String)) {
    let Some(shedding) = &config.load_shedding else { return };
    let classes = Classes::new(shedding);
    let value = request.header(&classes.priority_header);
    let class = classes.class_of(value);
    let why = match value {
        Some(value) if classes.name(class).as_bytes() == value => format!("header {} {}", classes.priority_header, quoted(value)),
        Some(value) => format!("the default class: header {} {} names no class", classes.priority_header, quoted(value)),
        None => format!("the default class: no {} header", classes.priority_header),
    };
    let mut thresholds = Vec::new();
    if let Some(threshold) = Shedder::new(shedding, "explain").and_then(|s| s.classes.get(class).map(|c| c.threshold)) {
        thresholds.push(format!("from {threshold} requests in flight"));
    }
    if let Some(lag) = LagMonitor::new(shedding).and_then(|l| l.threshold_ms(class)) {
        thresholds.push(format!("from {lag}ms of loop lag"));
    }
    if thresholds.is_empty() {
        line(format!("priority class: {:?} ({why})", classes.name(class)));
    } else {
        line(format!(
            "priority class: {:?} ({why}), shed {}; mode {}",
            classes.name(class),
            thresholds.join(" or "),
            mode_text(config, shedding.mode, "load_shedding.mode")
        ));
    }
    if let (Some(queue), Some(_)) = (&shedding.queue, shedding.max_active_requests) {
        let limits = queue.class(shedding, class);
        line(format!(
            "queue: over the in-flight threshold it waits for a slot up to {}ms ({} once the class's queue has stood for {}), behind at most {} others of its class; then shed",
            limits.max_wait_ms, queue.target, queue.interval, limits.max_queued.saturating_sub(1)
        ));
        if let Some(flow) = shedding.flow_of(class) {
            let (key, _) = key_values(&flow.key, request);
            let flow_name = match hash_key(&flow.key, &KeyHasher::new([0; 16]), |source| request.fetch(source)) {
                Some(_) => format!("flow {key}"),
                None => format!("no flow key ({key}): one flow with every request without it"),
            };
            line(format!(
                "flows: {flow_name}; the class's slots and queue are shared fairly between flows ({} queues, hands of {}): it waits only while its flow holds its fair share or more, and when the class's queue is full the request shed is the newest of the flow holding the most",
                flow.queues.get(),
                flow.hand_size.get()
            ));
        }
    }
}

fn per_key_cap(config: &Config, request: &Request, line: &mut impl FnMut(String)) {
    let Some(shedding) = &config.load_shedding else { return };
    if let Some(per_key) = &shedding.per_key {
        let (key, _) = key_values(&per_key.key, request);
        let mode = mode_text(config, per_key.mode, "load_shedding.per_key.mode");
        // The hash is the filter's test of a complete key (any seed tells it).
        match hash_key(&per_key.key, &KeyHasher::new([0; 16]), |source| request.fetch(source)) {
            Some(_) => line(format!(
                "per-key cap: key {key}: at most {} in flight; mode {mode}",
                per_key.max_active_requests.get()
            )),
            None => line(format!("per-key cap: key {key}: not capped (a part is missing)")),
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn config(json: &str) -> Config {
        Config::parse(json.as_bytes()).unwrap()
    }

    fn request(args: &[&str]) -> Request {
        let mut all = vec!["c.json".to_owned()];
        all.extend(args.iter().map(|a| (*a).to_owned()));
        Request::from_args(&all).unwrap().1
    }

    fn explained(json: &str, args: &[&str]) -> String {
        explain(&config(json), &request(args))
    }

    /// The lines of rule `name`: its title line and its details.
    fn rule_lines(text: &str, name: &str) -> Vec<String> {
        let mut lines = text.lines().skip_while(|l| !l.contains(&format!(" \"{name}\": ")));
        let mut out: Vec<String> = lines.next().into_iter().map(str::to_owned).collect();
        out.extend(lines.take_while(|l| l.starts_with("    ")).map(|l| l.trim().to_owned()));
        out
    }

    const RULES: &str = r#"{"rate_limits": [
        {"name": "login", "key": ["source_ip"], "limit": 5, "window": "1m",
         "match": {"path": {"exact": "/login"}, "methods": ["POST"]}},
        {"name": "api", "key": [{"header": "x-api-key"}], "limit": 100, "window": "1m",
         "match": {"path": {"prefix": "/api/"}, "headers": [{"name": "x-env", "equals": "prod"}]},
         "tiers": {"header": "x-plan", "limits": {"gold": 1000}},
         "overrides": [{"key": ["vip"], "limit": 5000}],
         "cost": {"from": "request_header", "header": "x-cost"}},
        {"name": "checkout", "key": ["path"], "limit": 10, "window": "10s", "match": {"routes": ["checkout"]}, "mode": "shadow"},
        {"name": "host", "key": ["authority"], "limit": 7, "window": "1s", "match": {"authority": "api.example.com"}}
    ]}"#;

    #[test]
    fn a_global_rule_names_its_key_in_the_store() {
        let config = r#"{"rate_limits": [{"name": "per-user", "key": [{"header": "x-user"}], "limit": 10, "window": "1m",
                          "scope": "global"}],
                         "global": {"cluster": "floodgate-sync"}}"#;
        let text = explained(config, &["--header", "x-user:alice"]);
        let lines = rule_lines(&text, "per-user");
        // The id every proxy of a fleet without key_secret gives this key (pinned in the filter).
        assert_eq!(
            lines.last().map(String::as_str),
            Some("store key: 63c3129f4c295b1b55af29154cfc6c55 (who holds it: floodgate-sync's GET /v1/holders?key=63c3129f4c295b1b55af29154cfc6c55&window_ms=60000)"),
            "{text}"
        );
        let secret = config.replace(r#""cluster": "floodgate-sync""#, r#""cluster": "floodgate-sync", "key_secret": "s3cret-of-the-fleet""#);
        let text = explained(&secret, &["--header", "x-user:alice"]);
        assert!(text.contains("store key: a5b7831be92d7f30d6a4d947f10f4aa7 "), "{text}");
    }

    #[test]
    fn a_rule_that_applies_tells_its_key_limit_cost_mode_and_scope() {
        let text = explained(RULES, &["--method", "POST", "--path", "/login?next=/", "--source-ip", "10.1.2.3:5555"]);
        assert!(text.starts_with("  request: POST /login?next=/, no authority, no route name, from 10.1.2.3:5555\n"), "{text}");
        assert_eq!(
            rule_lines(&text, "login"),
            [
                "  rate_limits[0] \"login\": applies",
                "mode: enforce",
                "key: source_ip \"10.1.2.3\"",
                "limit: 5 per 1m (the rule's limit)",
                "cost: 1 unit now (1 per request)",
                "scope: proxy (the workers of this Envoy share the quota)",
            ]
        );
    }

    #[test]
    fn a_rule_that_does_not_apply_says_which_condition_fails() {
        for (args, name, why) in [
            (&["--method", "POST", "--path", "/logout"][..], "login", "path \"/logout\" does not match match.path exact \"/login\""),
            (&["--path", "/login"], "login", "method \"GET\" is not one of match.methods [POST]"),
            (&["--path", "/api/x", "--header", "x-env: dev"], "api", "header x-env is \"dev\", match.headers wants it equal to \"prod\""),
            (&["--path", "/api/x"], "api", "header x-env is absent, match.headers wants it equal to \"prod\""),
            (&[], "checkout", "no route name, match.routes is [checkout] (give --route)"),
            (&["--route", "cart"], "checkout", "route \"cart\" is not one of match.routes [checkout]"),
            (
                &["--authority", "evil.com"],
                "host",
                "authority \"evil.com\" is not match.authority \"api.example.com\" (compared without port, any case)",
            ),
            // The conditions hold, but the key has no value: skipped.
            (&["--path", "/api/x", "--header", "x-env:prod"], "api", "key part header:x-api-key is missing (missing_key: skip)"),
        ] {
            let title = &rule_lines(&explained(RULES, args), name)[0];
            assert!(title.ends_with(&format!(" \"{name}\": does not apply: {why}")), "{args:?}: {title}");
        }
        assert_eq!(
            rule_lines(&explained(RULES, &["--authority", "API.example.com:8443"]), "host")[0],
            "  rate_limits[3] \"host\": applies"
        );
    }

    #[test]
    fn tiers_overrides_and_cost_headers() {
        let api = |extra: &[&str]| {
            let mut args = vec!["--path", "/api/v1", "--header", "x-env:prod"];
            args.extend(extra);
            rule_lines(&explained(RULES, &args), "api")
        };
        let lines = api(&["--header", "X-Api-Key: k-1", "--header", "x-plan:gold", "--header", "x-cost:7"]);
        assert_eq!(lines[2], "key: header:x-api-key \"k-1\"");
        assert_eq!(lines[3], "limit: 1000 per 1m (tier \"gold\", named by header x-plan)");
        assert_eq!(lines[4], "cost: 7 units now (request header x-cost)");
        let lines = api(&["--header", "x-api-key:vip", "--header", "x-plan:gold"]);
        assert_eq!(lines[3], "limit: 5000 per 1m (overrides[0]: this key's own limit)", "the override first");
        assert_eq!(lines[4], "cost: 1 unit now (request header x-cost absent: cost.default)");
        let lines = api(&["--header", "x-api-key:k", "--header", "x-plan:platinum", "--header", "x-cost:lots"]);
        assert_eq!(lines[3], "limit: 100 per 1m (the rule's limit; header x-plan \"platinum\" names no tier)");
        assert_eq!(lines[4], "cost: 1 unit now (request header x-cost \"lots\" is not a count: cost.default)");
        let lines = api(&["--header", "x-api-key:k", "--header", "x-cost:99999"]);
        assert_eq!(lines[3], "limit: 100 per 1m (the rule's limit; no x-plan header to name a tier)");
        assert_eq!(lines[4], "cost: 100 units now (request header x-cost, capped at the limit from 99999)");
        let later = explained(
            r#"{"rate_limits": [{"name": "tokens", "key": ["source_ip"], "limit": 50, "window": "1m",
                 "cost": {"from": "response_header", "header": "x-tokens", "default": 2}},
                {"name": "bytes", "key": ["source_ip"], "limit": 4096, "window": "1m", "cost": {"from": "request_body"}}]}"#,
            &["--source-ip", "10.0.0.1", "--header", "content-length:2048"],
        );
        assert_eq!(
            rule_lines(&later, "tokens")[4],
            "cost: 0 units now; later the count in response header x-tokens, charged when the response arrives (2 units without a valid count), capped at the limit 50"
        );
        assert_eq!(rule_lines(&later, "bytes")[4], "cost: 2048 units now (the request body's content-length)");
        let llm = explained(
            r#"{"rate_limits": [{"name": "tokens", "key": ["source_ip"], "limit": 1000, "window": "1m",
                 "cost": {"from": "response_body", "path": "usage.total_tokens", "estimate": {"header": "x-max-tokens", "default": 256, "max": 4096}}}]}"#,
            &["--source-ip", "10.0.0.1", "--header", "x-max-tokens:100"],
        );
        assert_eq!(
            rule_lines(&llm, "tokens")[4],
            "cost: 100 units reserved now (request header x-max-tokens, at most estimate.max 4096); later the count at usage.total_tokens in the response body \
             (JSON, or the last event of a text/event-stream that has one), charged when read as the body streams, capped at the limit 1000, settles it: \
             the difference is given back or charged (without a valid count: the reservation stays charged)"
        );
        let anthropic = explained(
            r#"{"refusal_format": "anthropic", "rate_limits": [{"name": "tokens", "key": [{"header": "authorization"}], "limit": 100000, "window": "1m",
                 "cost": {"from": "response_body", "sum": [{"path": ["usage.input_tokens", "message.usage.input_tokens"]}, {"path": "usage.output_tokens", "weight": 4}],
                          "estimate": {"sum": [{"path": "max_tokens", "weight": 4}], "default": 4096, "max": 65536}}}]}"#,
            &["--header", "authorization:Bearer k"],
        );
        let lines = rule_lines(&anthropic, "tokens");
        assert_eq!(
            lines[4],
            "cost: 4096 units reserved now (the request waits for its JSON body: the sum 4 × max_tokens (each term at the first of its places the body holds, \
             at most estimate.max 65536; this shows estimate.default, the body not being given)); later the count the sum \
             (usage.input_tokens | message.usage.input_tokens) + 4 × usage.output_tokens in the response body (JSON, or the events of a text/event-stream: \
             each place's last value), charged when read as the body streams, capped at the limit 100000, settles it: the difference is given back or charged \
             (without a valid count: the reservation stays charged)"
        );
        assert_eq!(lines[5], "refusal: a 429 with Anthropic's error object (application/json, type rate_limit_error) instead of the problem document; the same headers");
    }

    #[test]
    fn shadow_modes_and_shared_missing_keys() {
        let text = explained(RULES, &["--route", "checkout", "--path", "/cart?x=1"]);
        let lines = rule_lines(&text, "checkout");
        assert_eq!(lines[0], "  rate_limits[2] \"checkout\": applies");
        assert_eq!(lines[1], "mode: shadow (the rule's mode): counts what it would refuse, lets the request go on");
        assert_eq!(lines[2], "key: path \"/cart\"", "the path without its query");
        let top = explained(
            r#"{"mode": "shadow", "rate_limits": [{"name": "a", "key": [{"header": "x-k"}, "source_ip"], "limit": 1, "window": "1s", "missing_key": "shared"}]}"#,
            &["--source-ip", "::1"],
        );
        assert!(top.contains("\n  mode: shadow (top-level): every mechanism only counts what it would refuse\n"), "{top}");
        let lines = rule_lines(&top, "a");
        assert_eq!(lines[1], "mode: shadow (the top-level mode): counts what it would refuse, lets the request go on");
        assert_eq!(
            lines[2],
            "key: header:x-k (missing), source_ip \"::1\": one counter for every request lacking a part (missing_key: shared)"
        );
    }

    #[test]
    fn the_partition_is_the_partitioners() {
        let json = r#"{"cluster_selection": {"clusters": ["a", "b", "c", "d", "e", "f", "g", "h"],
                        "partition": {"key": [{"header": "x-client"}], "size": 2, "mode": "shadow"}}}"#;
        let text = explained(json, &["--header", "x-client:client-7"]);
        let selection = config(json).cluster_selection.unwrap();
        let partitioner = Partitioner::new(&selection).unwrap();
        let members = partitioner.confine(partitioner.key_hash(|_| Some(b"client-7")).unwrap()).members;
        let names: Vec<&str> = members.iter().map(|i| selection.clusters[*i].as_str()).collect();
        assert!(
            text.contains(&format!(
                "  partition: key header:x-client \"client-7\": clusters {} (2 of 8; refuse when they have no room); mode shadow (cluster_selection.partition.mode)",
                names.join(", ")
            )),
            "{text}"
        );
        let text = explained(json, &[]);
        assert!(text.contains("  partition: key header:x-client (missing): not confined, may use every cluster; mode shadow"), "{text}");
        let text = explained(r#"{"cluster_selection": {"clusters": ["a", "b"]}}"#, &[]);
        assert!(text.contains("  cluster selection: among every cluster (a, b), no partition"), "{text}");
    }

    #[test]
    fn the_priority_class_and_the_per_key_cap() {
        let json = r#"{"load_shedding": {"max_active_requests": 100, "max_loop_lag": "40ms",
                        "per_key": {"key": [{"header": "x-api-key"}], "max_active_requests": 3}}}"#;
        let text = explained(json, &["--header", "x-floodgate-priority:low", "--header", "x-api-key:k"]);
        assert!(
            text.contains("  priority class: \"low\" (header x-floodgate-priority \"low\"), shed from 50 requests in flight or from 20ms of loop lag; mode enforce\n"),
            "{text}"
        );
        assert!(text.contains("  per-key cap: key header:x-api-key \"k\": at most 3 in flight; mode enforce\n"), "{text}");
        let text = explained(json, &["--header", "x-floodgate-priority:urgent"]);
        assert!(
            text.contains("  priority class: \"normal\" (the default class: header x-floodgate-priority \"urgent\" names no class), shed from 90 requests"),
            "{text}"
        );
        assert!(text.contains("  per-key cap: key header:x-api-key (missing): not capped (a part is missing)\n"), "{text}");
        let text = explained(json, &[]);
        assert!(text.contains("(the default class: no x-floodgate-priority header)"), "{text}");
        assert!(!text.contains("queue:"), "{text}");
    }

    #[test]
    fn the_stages_are_told_in_the_order_the_filter_runs_them() {
        let json = r#"{"load_shedding": {"max_active_requests": 100, "queue": {"max_queued": 8, "max_wait": "1s"},
                        "per_key": {"key": [{"header": "x-api-key"}], "max_active_requests": 3}},
                       "rate_limits": [{"name": "per-key", "key": [{"header": "x-api-key"}], "limit": 5, "window": "1s"}],
                       "cluster_selection": {"clusters": ["a", "b"]}}"#;
        let text = explained(json, &["--header", "x-api-key:k"]);
        let at = |start: &str| text.lines().position(|l| l.starts_with(start)).expect(start);
        let told = [at("  priority class:"), at("  queue:"), at("  per-key cap:"), at("  rate_limits[0]"), at("  cluster selection:")];
        assert!(told.windows(2).all(|w| w[0] < w[1]), "shed, queue, cap, rate limits, selection: {told:?} in {text}");
    }

    #[test]
    fn a_class_shared_by_flow_names_the_requests_flow() {
        let json = r#"{"load_shedding": {"max_active_requests": 4, "queue": {"max_queued": 50, "max_wait": "5s"},
                        "flow": {"key": [{"header": "x-tenant"}], "queues": 32, "hand_size": 2}}}"#;
        let text = explained(json, &["--header", "x-tenant:acme"]);
        assert!(text.contains("  flows: flow header:x-tenant \"acme\"; the class's slots and queue are shared fairly between flows (32 queues, hands of 2)"), "{text}");
        let text = explained(json, &[]);
        assert!(text.contains("  flows: no flow key (header:x-tenant (missing)): one flow with every request without it;"), "{text}");
    }

    #[test]
    fn a_queue_says_how_long_the_class_waits() {
        let json = r#"{"load_shedding": {"max_active_requests": 10, "queue": {"max_queued": 50, "max_wait": "1s"},
                        "classes": [{"name": "normal", "shed_at": 1.0}, {"name": "low", "shed_at": 0.5, "queue": {"max_wait": "200ms"}}]}}"#;
        let text = explained(json, &["--header", "x-floodgate-priority:low"]);
        assert!(
            text.contains("  queue: over the in-flight threshold it waits for a slot up to 200ms (5ms once the class's queue has stood for 100ms), behind at most 49 others of its class; then shed\n"),
            "{text}"
        );
        assert!(explained(json, &[]).contains("up to 1000ms"));
    }

    #[test]
    fn the_health_endpoint_is_answered_before_everything() {
        let json = r#"{"health": {"path": "/healthz"}, "rate_limits": [{"name": "a", "key": ["path"], "limit": 1, "window": "1s"}]}"#;
        let text = explained(json, &["--path", "/healthz?full=1"]);
        assert!(text.ends_with("  health: GET /healthz is the health endpoint: the filter answers it itself, nothing else applies\n"), "{text}");
        assert!(explained(json, &["--path", "/healthz", "--method", "POST"]).contains("\"a\": applies"));
        let json = r#"{"health": {"path": "/healthz"}, "watchdog": {"path": "/livez"}, "rate_limits": [{"name": "a", "key": ["path"], "limit": 1, "window": "1s"}]}"#;
        let text = explained(json, &["--path", "/livez", "--method", "HEAD"]);
        assert!(text.ends_with("  watchdog: HEAD /livez is the watchdog's liveness path: the filter answers it itself, nothing else applies\n"), "{text}");
        assert!(explained(json, &["--path", "/livez", "--method", "POST"]).contains("\"a\": applies"));
    }

    #[test]
    fn explain_runs_on_each_configuration_of_a_file_and_exits() {
        let dir = std::env::temp_dir().join(format!("floodgate-cli-explain-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let filter = |name: &str, config: &str| {
            format!(
                "  - name: envoy.filters.http.wasm\n    typed_config:\n      \"@type\": {}\n      config:\n        name: {name}\n        failure_policy: FAIL_CLOSED\n        configuration:\n          \"@type\": type.googleapis.com/google.protobuf.StringValue\n          value: '{config}'\n",
                crate::WASM_FILTER_TYPE
            )
        };
        let yaml = format!(
            "http_filters:\n{}{}",
            filter("floodgate", r#"{"rate_limits": [{"name": "per-ip", "key": ["source_ip"], "limit": 5, "window": "1s"}]}"#),
            filter("floodgate-edge", r#"{"load_shedding": {"max_active_requests": 10}}"#)
        );
        let file = dir.join("envoy.yaml");
        std::fs::write(&file, &yaml).unwrap();
        let name = file.display().to_string();
        let run_with = |args: &[&str]| {
            let (mut out, mut err) = (Vec::new(), Vec::new());
            let args: Vec<String> = args.iter().map(|a| (*a).to_owned()).collect();
            let status = crate::run(&args, &mut out, &mut err);
            (status, String::from_utf8_lossy(&out).into_owned(), String::from_utf8_lossy(&err).into_owned())
        };
        let (status, out, err) = run_with(&["explain", &name, "--source-ip", "10.0.0.9:1234"]);
        assert_eq!((status, err.as_str()), (0, ""));
        assert_eq!(
            out,
            format!(
                "{name}: Wasm filter \"floodgate\" at http_filters[0].typed_config:\n\
                 \x20 request: GET /, no authority, no route name, from 10.0.0.9:1234\n\
                 \x20 rate_limits[0] \"per-ip\": applies\n\
                 \x20   mode: enforce\n\
                 \x20   key: source_ip \"10.0.0.9\"\n\
                 \x20   limit: 5 per 1s (the rule's limit)\n\
                 \x20   cost: 1 unit now (1 per request)\n\
                 \x20   scope: proxy (the workers of this Envoy share the quota)\n\
                 {name}: Wasm filter \"floodgate-edge\" at http_filters[1].typed_config:\n\
                 \x20 request: GET /, no authority, no route name, from 10.0.0.9:1234\n\
                 \x20 priority class: \"normal\" (the default class: no x-floodgate-priority header), shed from 9 requests in flight; mode enforce\n\
                 \x20 rate limits: none\n"
            )
        );
        std::fs::write(&file, r#"{"rate_limits": [{"name": "a", "key": ["path"], "limit": 5, "window": "1s", "mode": "observe"}]}"#).unwrap();
        let (status, out, err) = run_with(&["explain", &name]);
        assert_eq!((status, out.as_str()), (1, ""));
        assert_eq!(err, format!("{name}: rate_limits[0].mode: unknown variant `observe`, expected `enforce` or `shadow`\n"));
        assert_eq!(run_with(&["explain"]).0, 2);
        assert_eq!(run_with(&["explain", &name, "--header", "x"]).0, 2);
        assert_eq!(run_with(&["explain", "no/such/file.json"]).0, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn request_options_and_their_errors() {
        let (file, request) = Request::from_args(&[
            "--method=PUT".into(),
            "c.yaml".into(),
            "--header".into(),
            "X-A: 1 ".into(),
            "--authority".into(),
            "h".into(),
        ])
        .unwrap();
        assert_eq!(file, "c.yaml");
        assert_eq!((request.method.as_str(), request.headers[0].clone()), ("PUT", ("x-a".into(), "1".into())));
        for (args, error) in [
            (vec!["--path", "/x"], "no CONFIG given"),
            (vec!["c", "--header", "nocolon"], "expected name:value"),
            (vec!["c", "--header", ":path:/x"], "is not a header name"),
            (vec!["c", "--source-ip", "localhost"], "not an IP address"),
            (vec!["c", "--path"], "--path needs a value"),
            (vec!["c", "--verbose"], "unknown option --verbose"),
            (vec!["c", "d"], "one CONFIG only"),
        ] {
            let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
            let problem = Request::from_args(&args).unwrap_err();
            assert!(problem.contains(error), "{args:?}: {problem}");
        }
    }
}
