//! A variant of the measurements that compare filter chains (CPU, instructions, idle, the LLM
//! variants): its filter chain and its route; and the rule the floodgate variants enforce.

use crate::envoy::{Filter, Route};

/// One rule, per `x-api-key`, with a limit no benchmark reaches: every request is admitted,
/// so what is measured is the common path (read, decide, count).
pub fn rule(name: &str) -> String {
    format!(r#"{{"name": "{name}", "key": [{{"header": "x-api-key"}}], "limit": 1000000000, "window": "1m"}}"#)
}

/// The naive module's configuration for the same rule as [`rule`]: its key is `x-api-key`
/// (fixed in the module), a limit no benchmark reaches, a 1 min fixed window.
pub const NAIVE_RULE: &str = "limit=1000000000,window_ms=60000";

/// A variant of the comparison.
#[derive(Clone, Debug)]
pub struct Variant {
    /// Short id.
    pub id: &'static str,
    /// What it is.
    pub label: String,
    /// Filter chain.
    pub filter: Filter,
    /// Route.
    pub route: Route,
}
