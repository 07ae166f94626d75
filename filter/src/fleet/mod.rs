//! The fleet: rules in global scope, whose quota holds across every proxy, through
//! `floodgate-sync` and Redis. Two consistencies: [`batched`] (every decision local, counts
//! sent in one batch per proxy and interval) and [`leased`] (units of a key's quota taken from
//! the store ahead of use, never over the limit).
//!
//! Rationale: docs/design.md, section "Rate limiting across a fleet".

pub mod batched;
pub mod leased;
pub mod protocol;

/// How a call to `floodgate-sync` ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Answer {
    /// `200` and this body.
    Ok(Vec<u8>),
    /// Another status (`None`: no response at all: reset, timeout, no such cluster).
    Failed(Option<u32>),
}

