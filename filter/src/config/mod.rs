//! The filter's JSON configuration, parsed once (in `on_configure`) into typed, validated values
//! that every stream then shares by reference.
//!
//! Every problem is reported as one [`ConfigError`] naming the field path and what is wrong,
//! e.g. `rate_limits[0].window: "ten seconds" is not a duration ...`. Unknown fields, wrong
//! types, zero or negative numbers, bad durations, empty key lists and duplicate rule names are
//! all refused: nothing half-configured ever serves traffic.

mod values;

pub use values::{DurationMs, Name, Positive, MAX_DURATION_MS};

use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use std::fmt;

/// Tracked keys per rule when `capacity` is not given.
pub const DEFAULT_CAPACITY: u32 = 16_384;
/// The largest accepted `capacity` (tracked keys per rule).
pub const MAX_CAPACITY: u32 = 1 << 24;
/// The metric name prefix when `stat_prefix` is not given.
pub const DEFAULT_STAT_PREFIX: &str = "floodgate";

/// The whole configuration.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Rate-limit rules; every rule that applies to a request must admit it.
    #[serde(default)]
    pub rate_limits: Vec<RateLimitRule>,
    /// Prefix of every metric name (default `floodgate`).
    #[serde(default = "default_stat_prefix")]
    pub stat_prefix: Name,
    /// When responses carry the `ratelimit` / `ratelimit-policy` fields.
    #[serde(default)]
    pub ratelimit_headers: RateLimitHeaders,
}

fn default_stat_prefix() -> Name {
    Name::trusted(DEFAULT_STAT_PREFIX)
}

/// One rate-limit rule.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimitRule {
    /// Unique name, used in metrics, shared-data keys and responses.
    pub name: Name,
    /// The parts of the request that make the key, joined in order.
    pub key: Vec<KeyPart>,
    /// Requests admitted per window and key.
    pub limit: Positive,
    /// The window length.
    pub window: DurationMs,
    /// How many distinct keys the rule tracks exactly (default 16384); beyond that, keys share
    /// slots as documented in [`crate::ratelimit::table`].
    #[serde(default = "default_capacity")]
    pub capacity: Positive,
    /// What the rule does with a request that lacks a key part.
    #[serde(default)]
    pub missing_key: MissingKey,
}

fn default_capacity() -> Positive {
    Positive::new(DEFAULT_CAPACITY).unwrap_or(Positive::ONE)
}

/// What a rule does when a request lacks one of its key parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MissingKey {
    /// The rule does not apply to the request (the default).
    #[default]
    Skip,
    /// All requests lacking a part share one counter (the missing part counts as empty).
    Shared,
}

/// When admitted responses carry the `ratelimit` / `ratelimit-policy` fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RateLimitHeaders {
    /// On every response a rule applied to: the rule with the least remaining quota (default).
    #[default]
    Always,
    /// Only on `429` responses.
    OnReject,
}

/// One part of a rate-limit key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum KeyPart {
    /// A request header (name stored lower-case); its raw bytes.
    Header(String),
    /// The downstream peer address without its port.
    SourceIp,
    /// The request path without its query.
    Path,
    /// The request method.
    Method,
    /// The `:authority` (host) header.
    Authority,
}

impl fmt::Display for KeyPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeyPart::Header(name) => write!(f, "header:{name}"),
            KeyPart::SourceIp => f.write_str("source_ip"),
            KeyPart::Path => f.write_str("path"),
            KeyPart::Method => f.write_str("method"),
            KeyPart::Authority => f.write_str("authority"),
        }
    }
}

impl<'de> Deserialize<'de> for KeyPart {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyPartVisitor;
        impl<'de> Visitor<'de> for KeyPartVisitor {
            type Value = KeyPart;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(
                    "\"source_ip\", \"path\", \"method\", \"authority\" or {\"header\": NAME}",
                )
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<KeyPart, E> {
                match text {
                    "source_ip" => Ok(KeyPart::SourceIp),
                    "path" => Ok(KeyPart::Path),
                    "method" => Ok(KeyPart::Method),
                    "authority" => Ok(KeyPart::Authority),
                    other => Err(E::custom(format!(
                        "unknown key part {other:?} (expected \"source_ip\", \"path\", \"method\", \"authority\" or {{\"header\": NAME}})"
                    ))),
                }
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<KeyPart, A::Error> {
                let mut header: Option<String> = None;
                while let Some(field) = map.next_key::<String>()? {
                    if field != "header" {
                        return Err(de::Error::custom(format!(
                            "unknown field {field:?} in a key part (expected {{\"header\": NAME}})"
                        )));
                    }
                    if header.is_some() {
                        return Err(de::Error::custom("duplicate field \"header\""));
                    }
                    header = Some(map.next_value()?);
                }
                let name = header.ok_or_else(|| de::Error::custom("missing field \"header\""))?;
                header_name(&name).map(KeyPart::Header).map_err(de::Error::custom)
            }
        }
        deserializer.deserialize_any(KeyPartVisitor)
    }
}

/// Checks an HTTP header name (RFC 9110 token) and lower-cases it, as Envoy stores them.
fn header_name(name: &str) -> Result<String, String> {
    let token_char = |c: char| c.is_ascii_alphanumeric() || "!#$%&'*+-.^_`|~".contains(c);
    let pseudo = name.strip_prefix(':').unwrap_or(name);
    if pseudo.is_empty() || !pseudo.chars().all(token_char) {
        return Err(format!("{name:?} is not a valid header name"));
    }
    Ok(name.to_ascii_lowercase())
}

/// A configuration problem: the field path and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// Where, e.g. `rate_limits[0].window` (empty for the document itself).
    pub path: String,
    /// What is wrong.
    pub problem: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "{}", self.problem)
        } else {
            write!(f, "{}: {}", self.path, self.problem)
        }
    }
}

impl std::error::Error for ConfigError {}

impl Config {
    /// Parses and validates a configuration. Empty input (Envoy passes none when the
    /// `configuration` field is absent) is the same as `{}`.
    pub fn parse(bytes: &[u8]) -> Result<Config, ConfigError> {
        let text = std::str::from_utf8(bytes).map_err(|err| ConfigError {
            path: String::new(),
            problem: format!("the configuration is not UTF-8 ({err})"),
        })?;
        let text = if text.trim().is_empty() { "{}" } else { text };
        let document: serde_json::Value = serde_json::from_str(text).map_err(|err| ConfigError {
            path: String::new(),
            problem: without_position(&err.to_string()),
        })?;
        require_objects(&document)?;
        let config: Config = serde_path_to_error::deserialize(document).map_err(|err| {
            let path = err.path().to_string();
            ConfigError {
                path: if path == "." { String::new() } else { path },
                problem: without_position(&err.inner().to_string()),
            }
        })?;
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        for (index, rule) in self.rate_limits.iter().enumerate() {
            let at = |field: &str| format!("rate_limits[{index}].{field}");
            if rule.key.is_empty() {
                return Err(ConfigError {
                    path: at("key"),
                    problem: "must list at least one key part".into(),
                });
            }
            if rule.capacity.get().get() > MAX_CAPACITY {
                return Err(ConfigError {
                    path: at("capacity"),
                    problem: format!("must be at most {MAX_CAPACITY}, got {}", rule.capacity.get()),
                });
            }
            if let Some(first) = self.rate_limits.iter().position(|r| r.name == rule.name) {
                if first < index {
                    return Err(ConfigError {
                        path: at("name"),
                        problem: format!(
                            "duplicate rule name \"{}\" (also rate_limits[{first}].name)",
                            rule.name
                        ),
                    });
                }
            }
        }
        Ok(())
    }

    /// A one-line summary of what the configuration enforces, for the configure-time log.
    pub fn summary(&self) -> String {
        if self.rate_limits.is_empty() {
            return "no rate limits".into();
        }
        let rules: Vec<String> = self
            .rate_limits
            .iter()
            .map(|r| {
                let key: Vec<String> = r.key.iter().map(ToString::to_string).collect();
                format!(
                    "{} = {} per {} by [{}] ({} keys)",
                    r.name,
                    r.limit.get(),
                    r.window,
                    key.join(", "),
                    r.capacity.get()
                )
            })
            .collect();
        format!("rate limits: {}", rules.join("; "))
    }
}

/// serde's derived structs also accept a JSON array of their fields in order; a configuration
/// written that way is unreadable and surely a mistake, so sections must be objects.
fn require_objects(document: &serde_json::Value) -> Result<(), ConfigError> {
    let not_object = |path: String| ConfigError {
        path,
        problem: "must be a JSON object".into(),
    };
    let top = document.as_object().ok_or_else(|| not_object(String::new()))?;
    if let Some(serde_json::Value::Array(rules)) = top.get("rate_limits") {
        if let Some(index) = rules.iter().position(|rule| !rule.is_object()) {
            return Err(not_object(format!("rate_limits[{index}]")));
        }
    }
    Ok(())
}

/// serde_json appends " at line L column C"; the field path says more, so drop it.
fn without_position(message: &str) -> String {
    match message.rfind(" at line ") {
        Some(cut) => message.get(..cut).unwrap_or(message).to_owned(),
        None => message.to_owned(),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn error_of(json: &str) -> String {
        Config::parse(json.as_bytes()).unwrap_err().to_string()
    }

    const RULE: &str = r#"{"name":"a","key":[{"header":"X-Api-Key"}],"limit":5,"window":"10s"}"#;

    #[test]
    fn defaults_are_valid() {
        assert_eq!(Name::parse(DEFAULT_STAT_PREFIX).unwrap(), default_stat_prefix());
        assert_eq!(default_capacity().get().get(), DEFAULT_CAPACITY);
    }

    #[test]
    fn empty_object_and_empty_input_do_nothing() {
        for text in ["{}", "", "  \n"] {
            let config = Config::parse(text.as_bytes()).unwrap();
            assert!(config.rate_limits.is_empty());
            assert_eq!(config.stat_prefix.as_str(), "floodgate");
        }
    }

    #[test]
    fn spec_example_parses_into_typed_values() {
        let config = Config::parse(
            br#"{"rate_limits":[
                {"name":"per-api-key","key":[{"header":"x-api-key"}],"limit":100,"window":"60s"},
                {"name":"per-ip","key":["source_ip","path","method","authority"],"limit":1000,"window":"1m",
                 "capacity":1000,"missing_key":"shared"}],
               "ratelimit_headers":"on_reject","stat_prefix":"edge"}"#,
        )
        .unwrap();
        let rule = &config.rate_limits[1];
        assert_eq!(rule.window.get().get(), 60_000);
        assert_eq!(rule.limit.get().get(), 1000);
        assert_eq!(rule.capacity.get().get(), 1000);
        assert_eq!(rule.missing_key, MissingKey::Shared);
        assert_eq!(
            rule.key,
            vec![KeyPart::SourceIp, KeyPart::Path, KeyPart::Method, KeyPart::Authority]
        );
        assert_eq!(config.rate_limits[0].key, vec![KeyPart::Header("x-api-key".into())]);
        assert_eq!(config.rate_limits[0].capacity.get().get(), DEFAULT_CAPACITY);
        assert_eq!(config.ratelimit_headers, RateLimitHeaders::OnReject);
        assert!(config.summary().contains("per-api-key = 100 per 1m by [header:x-api-key]"));
    }

    #[test]
    fn header_names_are_lower_cased() {
        let config = Config::parse(format!(r#"{{"rate_limits":[{RULE}]}}"#).as_bytes()).unwrap();
        assert_eq!(config.rate_limits[0].key, vec![KeyPart::Header("x-api-key".into())]);
    }

    #[test]
    fn unknown_field_is_named() {
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path"],"limt":5,"limit":5,"window":"1s"}]}"#,
        );
        assert!(err.starts_with("rate_limits[0].limt: unknown field `limt`"), "{err}");
        let err = error_of(r#"{"rate_limit":[]}"#);
        assert!(err.starts_with("rate_limit: unknown field `rate_limit`"), "{err}");
    }

    #[test]
    fn bad_duration_is_named() {
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path"],"limit":5,"window":"ten seconds"}]}"#,
        );
        assert!(err.starts_with(r#"rate_limits[0].window: "ten seconds" is not a duration"#), "{err}");
        let err =
            error_of(r#"{"rate_limits":[{"name":"a","key":["path"],"limit":5,"window":10}]}"#);
        assert!(err.starts_with("rate_limits[0].window: invalid type: integer `10`"), "{err}");
    }

    #[test]
    fn zero_negative_fractional_and_huge_limits_are_refused() {
        for (limit, words) in [
            ("0", "must be a positive integer"),
            ("-5", "must be a positive integer, got -5"),
            ("1.5", "must be a positive integer, got 1.5"),
            ("4294967296", "at most 4294967295"),
            ("\"5\"", "invalid type: string \"5\", expected a positive integer"),
        ] {
            let err = error_of(&format!(
                r#"{{"rate_limits":[{{"name":"a","key":["path"],"limit":{limit},"window":"1s"}}]}}"#
            ));
            assert!(err.starts_with("rate_limits[0].limit: "), "{err}");
            assert!(err.contains(words), "{limit}: {err}");
        }
    }

    #[test]
    fn zero_and_oversized_capacity_are_refused() {
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path"],"limit":5,"window":"1s","capacity":0}]}"#,
        );
        assert!(err.starts_with("rate_limits[0].capacity: must be a positive integer"), "{err}");
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path"],"limit":5,"window":"1s","capacity":99999999}]}"#,
        );
        assert!(err.starts_with("rate_limits[0].capacity: must be at most"), "{err}");
    }

    #[test]
    fn duplicate_rule_names_are_refused() {
        let err = error_of(&format!(r#"{{"rate_limits":[{RULE},{RULE}]}}"#));
        assert_eq!(err, r#"rate_limits[1].name: duplicate rule name "a" (also rate_limits[0].name)"#);
    }

    #[test]
    fn empty_key_list_is_refused() {
        let err = error_of(r#"{"rate_limits":[{"name":"a","key":[],"limit":5,"window":"1s"}]}"#);
        assert_eq!(err, "rate_limits[0].key: must list at least one key part");
    }

    #[test]
    fn bad_key_parts_are_named() {
        let err = error_of(r#"{"rate_limits":[{"name":"a","key":["ip"],"limit":5,"window":"1s"}]}"#);
        assert!(err.starts_with(r#"rate_limits[0].key[0]: unknown key part "ip""#), "{err}");
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path",{"header":"bad header"}],"limit":5,"window":"1s"}]}"#,
        );
        assert!(err.starts_with(r#"rate_limits[0].key[1]: "bad header" is not a valid header name"#), "{err}");
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":[{"cookie":"x"}],"limit":5,"window":"1s"}]}"#,
        );
        assert!(err.starts_with(r#"rate_limits[0].key[0]: unknown field "cookie""#), "{err}");
    }

    #[test]
    fn bad_names_and_enums_are_named() {
        let err = error_of(r#"{"rate_limits":[{"name":"a b","key":["path"],"limit":5,"window":"1s"}]}"#);
        assert!(err.starts_with(r#"rate_limits[0].name: "a b" is not a valid name"#), "{err}");
        let err = error_of(
            r#"{"rate_limits":[{"name":"a","key":["path"],"limit":5,"window":"1s","missing_key":"deny"}]}"#,
        );
        assert!(err.starts_with("rate_limits[0].missing_key: unknown variant `deny`"), "{err}");
    }

    #[test]
    fn missing_required_fields_are_named() {
        let err = error_of(r#"{"rate_limits":[{"name":"a","key":["path"],"window":"1s"}]}"#);
        assert!(err.starts_with("rate_limits[0]: missing field `limit`"), "{err}");
    }

    #[test]
    fn wrong_document_shapes_are_refused() {
        let err = error_of(r#"{"rate_limits":{}}"#);
        assert!(err.starts_with("rate_limits: invalid type: map, expected a sequence"), "{err}");
        assert_eq!(error_of("[]"), "must be a JSON object");
        let err = error_of(r#"{"rate_limits":[["a",["path"],5,"1s"]]}"#);
        assert_eq!(err, "rate_limits[0]: must be a JSON object");
        assert!(error_of("{} {}").contains("trailing characters"));
        assert!(error_of("{").contains("EOF"));
        assert!(Config::parse(b"\xff").unwrap_err().problem.contains("not UTF-8"));
    }
}
