//! `grpc`: the gRPC status codes of the filter's refusals of gRPC requests, and the gRPC status
//! code type the configuration uses (`cluster_selection.failure_grpc_statuses` too).
//!
//! The codes and their names are gRPC's (`doc/statuscodes.md` of grpc/grpc, `google.rpc.Code`).

use serde::de::{self, Deserializer, Visitor};
use serde::Deserialize;
use std::fmt;

/// The names of the gRPC status codes, indexed by code.
const NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// A gRPC status code, 0 (`OK`) to 16 (`UNAUTHENTICATED`).
///
/// In a configuration it is written as its name (`"UNAVAILABLE"`) or its number (`14`); `OK`
/// is refused there, since no configuration field can mean it (it is neither a refusal nor a
/// failure).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GrpcStatus(u8);

impl GrpcStatus {
    /// 0: not an error.
    pub const OK: GrpcStatus = GrpcStatus(0);
    /// 1: the call was cancelled, typically by the caller.
    pub const CANCELLED: GrpcStatus = GrpcStatus(1);
    /// 2: an unknown error.
    pub const UNKNOWN: GrpcStatus = GrpcStatus(2);
    /// 4: the deadline expired before the call completed.
    pub const DEADLINE_EXCEEDED: GrpcStatus = GrpcStatus(4);
    /// 7: the caller may not do this.
    pub const PERMISSION_DENIED: GrpcStatus = GrpcStatus(7);
    /// 8: a resource, such as a per-user quota, is exhausted.
    pub const RESOURCE_EXHAUSTED: GrpcStatus = GrpcStatus(8);
    /// 12: not implemented or not supported.
    pub const UNIMPLEMENTED: GrpcStatus = GrpcStatus(12);
    /// 13: an internal error.
    pub const INTERNAL: GrpcStatus = GrpcStatus(13);
    /// 14: the service is currently unavailable (transient: retrying may succeed).
    pub const UNAVAILABLE: GrpcStatus = GrpcStatus(14);
    /// 15: unrecoverable data loss or corruption.
    pub const DATA_LOSS: GrpcStatus = GrpcStatus(15);
    /// 16: no valid authentication credentials.
    pub const UNAUTHENTICATED: GrpcStatus = GrpcStatus(16);

    /// The status of code `code`, if it is one of the 17.
    pub fn new(code: u32) -> Option<GrpcStatus> {
        u8::try_from(code).ok().filter(|c| usize::from(*c) < NAMES.len()).map(GrpcStatus)
    }

    /// The status named `name` (upper case, as gRPC writes them).
    pub fn from_name(name: &str) -> Option<GrpcStatus> {
        NAMES.iter().position(|n| *n == name).and_then(|code| u8::try_from(code).ok()).map(GrpcStatus)
    }

    /// The code.
    pub fn code(self) -> u8 {
        self.0
    }

    /// The name, e.g. `"RESOURCE_EXHAUSTED"`.
    pub fn name(self) -> &'static str {
        NAMES.get(usize::from(self.0)).copied().unwrap_or("UNKNOWN")
    }
}

impl fmt::Display for GrpcStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl<'de> Deserialize<'de> for GrpcStatus {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct StatusVisitor;
        impl Visitor<'_> for StatusVisitor {
            type Value = GrpcStatus;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a gRPC status code: a name such as \"UNAVAILABLE\" or a number from 1 to 16")
            }
            fn visit_u64<E: de::Error>(self, value: u64) -> Result<GrpcStatus, E> {
                match u32::try_from(value).ok().and_then(GrpcStatus::new) {
                    Some(GrpcStatus::OK) => Err(E::custom(not_ok())),
                    Some(status) => Ok(status),
                    None => Err(E::custom(format!("{value} is not a gRPC status code (1 to 16)"))),
                }
            }
            fn visit_i64<E: de::Error>(self, value: i64) -> Result<GrpcStatus, E> {
                match u64::try_from(value) {
                    Ok(value) => self.visit_u64(value),
                    Err(_) => Err(E::custom(format!("{value} is not a gRPC status code (1 to 16)"))),
                }
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<GrpcStatus, E> {
                match GrpcStatus::from_name(text) {
                    Some(GrpcStatus::OK) => Err(E::custom(not_ok())),
                    Some(status) => Ok(status),
                    None => Err(E::custom(format!(
                        "{text:?} is not a gRPC status code name (\"CANCELLED\", \"UNKNOWN\", …, \"UNAUTHENTICATED\", upper case)"
                    ))),
                }
            }
        }
        deserializer.deserialize_any(StatusVisitor)
    }
}

fn not_ok() -> String {
    "OK is not a refusal or a failure: use a code from 1 (CANCELLED) to 16 (UNAUTHENTICATED)".into()
}

/// `grpc`: the status codes of the filter's refusals of gRPC requests. Like Envoy's
/// `rate_limited_as_resource_exhausted`, but per kind of refusal and with any code.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Grpc {
    /// A rate-limited call (default `RESOURCE_EXHAUSTED`, the code gRPC documents for an
    /// exhausted per-user quota; `UNAVAILABLE` is what Envoy answers by default, and what gRPC
    /// clients retry).
    #[serde(default = "resource_exhausted")]
    pub rate_limited_status: GrpcStatus,
    /// A call shed by load shedding (default `UNAVAILABLE`).
    #[serde(default = "unavailable")]
    pub shed_status: GrpcStatus,
    /// A call refused because no cluster had room (default `UNAVAILABLE`).
    #[serde(default = "unavailable")]
    pub no_capacity_status: GrpcStatus,
}

impl Default for Grpc {
    fn default() -> Grpc {
        Grpc {
            rate_limited_status: resource_exhausted(),
            shed_status: unavailable(),
            no_capacity_status: unavailable(),
        }
    }
}

impl Grpc {
    /// One line for the configure-time log.
    pub fn summary(&self) -> String {
        format!(
            "gRPC refusals: rate limited {}, shed {}, no cluster room {}",
            self.rate_limited_status, self.shed_status, self.no_capacity_status
        )
    }
}

fn resource_exhausted() -> GrpcStatus {
    GrpcStatus::RESOURCE_EXHAUSTED
}

fn unavailable() -> GrpcStatus {
    GrpcStatus::UNAVAILABLE
}

/// The gRPC statuses that count as failures when `failure_grpc_statuses` is not given.
pub fn default_failure_grpc_statuses() -> Vec<GrpcStatus> {
    vec![GrpcStatus::UNAVAILABLE, GrpcStatus::INTERNAL, GrpcStatus::UNKNOWN, GrpcStatus::DATA_LOSS]
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn error_of(json: &str) -> String {
        Config::parse(json.as_bytes()).unwrap_err().to_string()
    }

    #[test]
    fn names_and_numbers_agree() {
        for code in 0..=16u32 {
            let status = GrpcStatus::new(code).unwrap();
            assert_eq!(u32::from(status.code()), code);
            assert_eq!(GrpcStatus::from_name(status.name()), Some(status));
        }
        assert_eq!(GrpcStatus::new(17), None);
        assert_eq!(GrpcStatus::from_name("unavailable"), None);
        assert_eq!(GrpcStatus::RESOURCE_EXHAUSTED.to_string(), "RESOURCE_EXHAUSTED");
        assert_eq!(GrpcStatus::DEADLINE_EXCEEDED.code(), 4);
        assert_eq!(GrpcStatus::UNAVAILABLE.code(), 14);
    }

    #[test]
    fn defaults_and_every_field() {
        let config = Config::parse(b"{}").unwrap();
        assert_eq!(config.grpc, Grpc::default());
        assert_eq!(config.grpc.rate_limited_status, GrpcStatus::RESOURCE_EXHAUSTED);
        assert_eq!(config.grpc.shed_status, GrpcStatus::UNAVAILABLE);
        assert_eq!(config.grpc.no_capacity_status, GrpcStatus::UNAVAILABLE);
        let config = Config::parse(
            br#"{"grpc":{"rate_limited_status":"UNAVAILABLE","shed_status":8,"no_capacity_status":"ABORTED"}}"#,
        )
        .unwrap();
        assert_eq!(config.grpc.rate_limited_status, GrpcStatus::UNAVAILABLE);
        assert_eq!(config.grpc.shed_status, GrpcStatus::RESOURCE_EXHAUSTED);
        assert_eq!(config.grpc.no_capacity_status.code(), 10);
        assert!(config.summary().contains("gRPC refusals: rate limited UNAVAILABLE, shed RESOURCE_EXHAUSTED"));
    }

    #[test]
    fn errors_are_named() {
        for (json, expected) in [
            (r#"{"grpc":{"rate_limited_status":"OK"}}"#, "grpc.rate_limited_status: OK is not a refusal or a failure"),
            (r#"{"grpc":{"shed_status":0}}"#, "grpc.shed_status: OK is not a refusal or a failure"),
            (r#"{"grpc":{"shed_status":17}}"#, "grpc.shed_status: 17 is not a gRPC status code (1 to 16)"),
            (r#"{"grpc":{"shed_status":-1}}"#, "grpc.shed_status: -1 is not a gRPC status code"),
            (r#"{"grpc":{"no_capacity_status":"unavailable"}}"#, r#"grpc.no_capacity_status: "unavailable" is not a gRPC status code name"#),
            (r#"{"grpc":{"no_capacity_status":1.5}}"#, "grpc.no_capacity_status: invalid type: floating point `1.5`, expected a gRPC status code"),
            (r#"{"grpc":{"retry_pushback":true}}"#, "grpc.retry_pushback: unknown field `retry_pushback`"),
            (r#"{"grpc":[8]}"#, "grpc: must be a JSON object"),
        ] {
            let err = error_of(json);
            assert!(err.starts_with(expected), "{json}\n  got: {err}\n want: {expected}");
        }
    }
}
