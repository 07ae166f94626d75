//! floodgate: a proxy-wasm filter that protects a service behind Envoy from upstream pressure:
//! rate limits per key (in one proxy or across a fleet), load shedding, cluster selection and a
//! health endpoint, tuned by one JSON configuration. `docs/design.md` explains how a request
//! flows and why each mechanism holds its invariants.
//!
//! Layout, in the order dependencies point (each module uses only those before it):
//!
//! | module | what it is |
//! |---|---|
//! | [`primitives`] | time, the shared store and its compare-and-swap discipline, the proxy-wide in-flight record |
//! | [`config`] | the configuration, parsed once into typed, validated values |
//! | [`keys`] | key parts, the keyed hash of a key, a key's fleet-wide id |
//! | [`ratelimit`] | the local limiters: the sliding window, the token bucket (GCRA), the bounded key table, quota reserves, the rules' conditions, tiers and costs |
//! | [`fleet`] | global scope across proxies: batched and leased |
//! | [`shedding`] | load shedding on the in-flight count and on the loop lag, load leveling (the queue for a slot), the per-key cap, fair shares among a class's flows |
//! | [`watchdog`] | the liveness answer: every worker's heartbeat in a shared record, and what fails it |
//! | [`selection`] | cluster selection and the partitions of the clusters |
//! | [`replies`] | the `429`, the `503`s, the health and liveness answers, the `RateLimit` fields, the gRPC form |
//! | [`pipeline`] | the request pipeline: the stages in order on one stream state |
//! | `host` | the thin proxy-wasm shell (wasm only) |
//!
//! Everything but `host` imports nothing from proxy-wasm, takes `now` as an argument (or a
//! clock from the pipeline's environment), and is unit-tested natively.
#![cfg_attr(test, allow(clippy::arithmetic_side_effects))]

pub mod config;

pub mod keys;
pub mod fleet;
pub mod pipeline;
pub mod primitives;
pub mod ratelimit;
pub mod replies;
pub mod selection;
pub mod shedding;
pub mod watchdog;

#[cfg(target_arch = "wasm32")]
mod host;
