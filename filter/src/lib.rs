//! floodgate: a proxy-wasm filter that protects a service behind Envoy from upstream pressure
//! (see `SPEC.md`): per-key sliding-window rate limits kept in Envoy shared data, exact across
//! worker threads and bounded in memory.
//!
//! Layout: a pure core that imports nothing from proxy-wasm and takes `now` as an argument —
//! [`config`] (parsed once, validated), [`ratelimit`] (window, bounded table, limiter), [`key`]
//! (key parts and the keyed hash), [`rules`] (conditions, tiers and costs of rules), [`reserve`]
//! (units counted ahead of use), [`shed`] and [`lag`] (load shedding on the in-flight count and
//! on the loop lag), [`bulkhead`] (partitions of the clusters and caps per key), [`select`]
//! (cluster selection), [`global`] (the fleet-wide scope), [`lease`] (its leased consistency: units of
//! a key's quota taken from the store ahead of use), [`headers`] (which request headers to
//! read and how, and the serialized header map), [`store`] (shared data behind a trait, CAS
//! discipline), [`response`] (the 429, the 503s and the `RateLimit` fields), [`grpc`] (the gRPC
//! form of refusals, the outcome of gRPC calls), [`time`] — and `host`, the thin proxy-wasm
//! shell, compiled for wasm only.
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

#[cfg(target_arch = "wasm32")]
mod host;
