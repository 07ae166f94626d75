//! `global`: how the rules with `"scope": "global"` reach the fleet-wide store, through the
//! `floodgate-sync` ambassador (an Envoy cluster the filter calls over HTTP).

use super::selection::ClusterName;
use super::values::{DurationMs, Positive};
use super::ConfigError;
use serde::Deserialize;

/// The shortest accepted `sync_interval`.
pub const MIN_SYNC_INTERVAL_MS: u64 = 10;
/// The longest accepted `sync_interval`.
pub const MAX_SYNC_INTERVAL_MS: u64 = 60_000;
/// The most keys per rule a proxy may keep fleet-wide counts of.
pub const MAX_GLOBAL_KEYS: u32 = 65_536;
/// The path of `floodgate-sync`'s batch endpoint.
pub const SYNC_PATH: &str = "/v1/sync";

/// `global`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Global {
    /// The Envoy cluster of `floodgate-sync` (in Istio, `outbound|PORT||HOST`).
    pub cluster: ClusterName,
    /// The `:authority` of the calls (default: the cluster name).
    #[serde(default)]
    pub authority: Option<String>,
    /// Each proxy sends at most one batch per interval (default 100 ms).
    #[serde(default = "default_sync_interval")]
    pub sync_interval: DurationMs,
    /// How long a batch call may take before it counts as failed and is sent again (default 1 s).
    #[serde(default = "default_timeout")]
    pub timeout: DurationMs,
    /// Keys per global rule whose fleet-wide counts a proxy keeps (default 4096).
    #[serde(default = "default_max_keys")]
    pub max_keys: Positive,
    /// A secret mixed into the fleet-wide key hashes, the same on every proxy of the fleet, so
    /// that the store's key names do not reveal client keys to whoever can read the store.
    #[serde(default)]
    pub key_secret: Option<String>,
    /// The bearer token of every call to floodgate-sync (`authorization: Bearer <token>`): one
    /// of the tokens it accepts (its `--token`).
    #[serde(default)]
    pub token: Option<String>,
    /// The longest a request waits for the store (default 50 ms): a leased rule's call, a
    /// batched rule's ask.
    #[serde(default = "default_lease_timeout")]
    pub lease_timeout: DurationMs,
    /// Leased rules: what a request that needs the store does when the store fails.
    #[serde(default)]
    pub on_store_failure: OnStoreFailure,
    /// Leased rules: the most units a proxy asks for at a time beyond what its waiting
    /// requests need (default: no cap but the limit); 1 = every request asks the store and no
    /// unit is held between requests.
    #[serde(default)]
    pub max_lease: Option<Positive>,
}

/// What a store failure does to a request of a leased rule that needs the store
/// (`global.on_store_failure`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnStoreFailure {
    /// Decide on the last counts read from the store, plus this proxy's admissions since (keep
    /// serving on the last state read, as *Understanding Distributed Systems* advises).
    #[default]
    LastState,
    /// Refuse (`503`).
    Refuse,
}

/// The longest accepted `lease_timeout`.
pub const MAX_LEASE_TIMEOUT_MS: u64 = 10_000;

fn default_lease_timeout() -> DurationMs {
    DurationMs::from_ms(50).unwrap_or(DurationMs::MIN)
}

fn default_sync_interval() -> DurationMs {
    DurationMs::from_ms(100).unwrap_or(DurationMs::MIN)
}

fn default_timeout() -> DurationMs {
    DurationMs::from_ms(1000).unwrap_or(DurationMs::MIN)
}

fn default_max_keys() -> Positive {
    Positive::new(4096).unwrap_or(Positive::ONE)
}

/// Where and how the calls to floodgate-sync go, batches and leases alike.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreRoute {
    /// The Envoy cluster.
    pub cluster: String,
    /// The calls' `:authority`.
    pub authority: String,
    /// The calls' `authorization` header (`Bearer <token>`), if `global.token` is set.
    pub authorization: Option<String>,
}

/// The shortest accepted `token`.
pub const MIN_TOKEN_LEN: usize = 16;
/// The longest accepted `token`.
pub const MAX_TOKEN_LEN: usize = 512;

/// Whether `token` is a bearer token floodgate-sync accepts: 16 to 512 characters of RFC 6750's
/// `b64token` (`A-Z a-z 0-9 - . _ ~ + /` and `=`).
fn is_token(token: &str) -> bool {
    (MIN_TOKEN_LEN..=MAX_TOKEN_LEN).contains(&token.len())
        && token.chars().all(|c| c.is_ascii_alphanumeric() || "-._~+/=".contains(c))
}

impl Global {
    /// The `:authority` of the batch calls.
    pub fn authority(&self) -> &str {
        self.authority.as_deref().unwrap_or(self.cluster.as_str())
    }

    /// Where and how the calls go.
    pub fn route(&self) -> StoreRoute {
        StoreRoute {
            cluster: self.cluster.as_str().to_owned(),
            authority: self.authority().to_owned(),
            authorization: self.token.as_ref().map(|token| format!("Bearer {token}")),
        }
    }

    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        let error = |field: &str, problem: String| ConfigError {
            path: format!("global.{field}"),
            problem,
        };
        let interval = self.sync_interval.get().get();
        if !(MIN_SYNC_INTERVAL_MS..=MAX_SYNC_INTERVAL_MS).contains(&interval) {
            return Err(error(
                "sync_interval",
                format!(
                    "must be between {MIN_SYNC_INTERVAL_MS}ms and {}s, got {}",
                    MAX_SYNC_INTERVAL_MS / 1000,
                    self.sync_interval
                ),
            ));
        }
        if self.timeout.get().get() > MAX_SYNC_INTERVAL_MS {
            return Err(error(
                "timeout",
                format!("must be at most {}s, got {}", MAX_SYNC_INTERVAL_MS / 1000, self.timeout),
            ));
        }
        if self.lease_timeout.get().get() > MAX_LEASE_TIMEOUT_MS {
            return Err(error(
                "lease_timeout",
                format!("must be at most {}s, got {}", MAX_LEASE_TIMEOUT_MS / 1000, self.lease_timeout),
            ));
        }
        if self.max_keys.get().get() > MAX_GLOBAL_KEYS {
            return Err(error(
                "max_keys",
                format!("must be at most {MAX_GLOBAL_KEYS}, got {}", self.max_keys.get()),
            ));
        }
        if let Some(authority) = &self.authority {
            let host_char = |c: char| c.is_ascii_alphanumeric() || "-._~:[]%".contains(c);
            if authority.is_empty() || authority.len() > 255 || !authority.chars().all(host_char) {
                return Err(error(
                    "authority",
                    format!("{authority:?} is not a host (letters, digits, '-', '.', '_', '~', ':', '[', ']')"),
                ));
            }
        }
        if let Some(secret) = &self.key_secret {
            if secret.len() < 16 {
                return Err(error(
                    "key_secret",
                    "must be at least 16 characters (it keeps key values private from the store's readers)".into(),
                ));
            }
        }
        if let Some(token) = &self.token {
            if !is_token(token) {
                return Err(error(
                    "token",
                    format!(
                        "must be {MIN_TOKEN_LEN} to {MAX_TOKEN_LEN} characters among A-Z a-z 0-9 - . _ ~ + / = (a bearer token floodgate-sync accepts), got {} characters",
                        token.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A one-line summary for the configure-time log.
    pub fn summary(&self) -> String {
        format!(
            "global store via cluster {} every {} (timeout {}, {} keys per rule{}{}; leases wait {} at most, on store failure {})",
            self.cluster,
            self.sync_interval,
            self.timeout,
            self.max_keys.get(),
            if self.key_secret.is_some() { ", keyed" } else { "" },
            if self.token.is_some() { ", with a token" } else { "" },
            self.lease_timeout,
            match self.on_store_failure {
                OnStoreFailure::LastState => "last_state",
                OnStoreFailure::Refuse => "refuse",
            }
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use crate::config::{Config, Scope};

    fn error_of(json: &str) -> String {
        Config::parse(json.as_bytes()).unwrap_err().to_string()
    }

    const RULE: &str = r#"{"name":"r","key":["path"],"limit":5,"window":"1m","scope":"global"}"#;

    #[test]
    fn the_global_section_parses_with_defaults() {
        let config = Config::parse(format!(r#"{{"rate_limits":[{RULE}],"global":{{"cluster":"floodgate-sync"}}}}"#).as_bytes()).unwrap();
        assert_eq!(config.rate_limits[0].scope, Scope::Global);
        let global = config.global.unwrap();
        assert_eq!(global.authority(), "floodgate-sync");
        assert_eq!(global.sync_interval.get().get(), 100);
        assert_eq!(global.timeout.get().get(), 1000);
        assert_eq!(global.max_keys.get().get(), 4096);
        assert_eq!(global.key_secret, None);
        assert_eq!(global.token, None);
        assert_eq!(global.route().authorization, None);
        assert_eq!(global.lease_timeout.get().get(), 50);
        assert_eq!(global.on_store_failure, super::OnStoreFailure::LastState);
        assert_eq!(global.max_lease, None);
        let proxy = Config::parse(br#"{"rate_limits":[{"name":"r","key":["path"],"limit":5,"window":"1m"}]}"#).unwrap();
        assert_eq!(proxy.rate_limits[0].scope, Scope::Proxy);
    }

    #[test]
    fn the_token_becomes_the_calls_authorization() {
        let config = Config::parse(
            format!(r#"{{"rate_limits":[{RULE}],"global":{{"cluster":"c","authority":"sync.local","token":"Ab0-._~+/=Ab0-._~+/="}}}}"#).as_bytes(),
        )
        .unwrap();
        let global = config.global.unwrap();
        assert_eq!(
            global.route(),
            super::StoreRoute {
                cluster: "c".into(),
                authority: "sync.local".into(),
                authorization: Some("Bearer Ab0-._~+/=Ab0-._~+/=".into()),
            }
        );
        assert!(global.summary().contains(", with a token"));
        assert!(!global.summary().contains("Ab0"), "the log line shows no token");
    }

    #[test]
    fn reservations_are_taken_in_either_consistency() {
        for consistency in ["batched", "leased"] {
            let json = format!(
                r#"{{"rate_limits":[{{"name":"r","key":["path"],"limit":5,"window":"1m","scope":"global","consistency":"{consistency}",
                    "cost":{{"from":"response_header","header":"x-units","estimate":{{"default":2,"max":4}}}}}}],"global":{{"cluster":"s"}}}}"#
            );
            let config = Config::parse(json.as_bytes()).unwrap();
            assert!(config.rate_limits[0].cost.as_ref().unwrap().estimate.is_some(), "{consistency}");
        }
    }

    #[test]
    fn global_errors_are_named() {
        let with = |global: &str| format!(r#"{{"rate_limits":[{RULE}],"global":{global}}}"#);
        for (json, expected) in [
            (format!(r#"{{"rate_limits":[{RULE}]}}"#), r#"rate_limits[0].scope: "global" needs the top-level "global" section"#),
            (r#"{"rate_limits":[{"name":"r","key":["path"],"limit":5,"window":"1m","scope":"fleet"}]}"#.into(), "rate_limits[0].scope: unknown variant `fleet`"),
            (with("{}"), "global: missing field `cluster`"),
            (with(r#"{"cluster":""}"#), r#"global.cluster: "" is not a valid cluster name"#),
            (with(r#"{"cluster":"s","sync_interval":"5ms"}"#), "global.sync_interval: must be between 10ms and 60s, got 5ms"),
            (with(r#"{"cluster":"s","sync_interval":"2m"}"#), "global.sync_interval: must be between 10ms and 60s, got 2m"),
            (with(r#"{"cluster":"s","timeout":"61s"}"#), "global.timeout: must be at most 60s, got 61s"),
            (with(r#"{"cluster":"s","max_keys":0}"#), "global.max_keys: must be a positive integer"),
            (with(r#"{"cluster":"s","max_keys":70000}"#), "global.max_keys: must be at most 65536, got 70000"),
            (with(r#"{"cluster":"s","authority":"a b"}"#), r#"global.authority: "a b" is not a host"#),
            (with(r#"{"cluster":"s","key_secret":"short"}"#), "global.key_secret: must be at least 16 characters"),
            (with(r#"{"cluster":"s","token":"short"}"#), "global.token: must be 16 to 512 characters among A-Z a-z 0-9 - . _ ~ + / = (a bearer token floodgate-sync accepts), got 5 characters"),
            (with(r#"{"cluster":"s","token":"sixteen chars or more"}"#), "global.token: must be 16 to 512 characters"),
            (with(r#"{"cluster":"s","token":"line\nbreak-0123456789"}"#), "global.token: must be 16 to 512 characters"),
            (with(r#"{"cluster":"s","token":1234567890123456}"#), "global.token: invalid type"),
            (with(r#"{"cluster":"s","interval":"1s"}"#), "global.interval: unknown field `interval`"),
            (with(r#"{"cluster":"s","lease_timeout":"11s"}"#), "global.lease_timeout: must be at most 10s, got 11s"),
            (with(r#"{"cluster":"s","max_lease":0}"#), "global.max_lease: must be a positive integer"),
            (with(r#"{"cluster":"s","on_store_failure":"open"}"#), "global.on_store_failure: unknown variant `open`, expected `last_state` or `refuse`"),
            (r#"{"rate_limits":[{"name":"r","key":["path"],"limit":5,"window":"1m","consistency":"leased"}]}"#.into(),
             r#"rate_limits[0].consistency: "leased" needs "scope": "global""#),
            (r#"{"rate_limits":[{"name":"r","key":["path"],"limit":5,"window":"1m","scope":"global","consistency":"leased","cost":{"from":"request_body"}}],"global":{"cluster":"s"}}"#.into(),
             "rate_limits[0].cost.from: a leased rule takes its units before the request goes on"),
            (r#"{"rate_limits":[{"name":"r","key":["path"],"limit":5,"window":"1m","scope":"global","consistency":"leased","cost":{"from":"response_header","header":"x-units"}}],"global":{"cluster":"s"}}"#.into(),
             "rate_limits[0].cost.from: a leased rule takes its units before the request goes on: its cost must come from a request header, or be reserved (\"estimate\")"),
            (r#"{"rate_limits":[{"name":"r","key":["path"],"limit":5,"window":"1m","scope":"global","consistency":"exact"}],"global":{"cluster":"s"}}"#.into(),
             "rate_limits[0].consistency: unknown variant `exact`, expected `batched` or `leased`"),
            (with(r#"["s"]"#), "global: must be a JSON object"),
        ] {
            let err = error_of(&json);
            assert!(err.starts_with(expected), "{json}\n  got: {err}\n want: {expected}");
        }
    }
}
