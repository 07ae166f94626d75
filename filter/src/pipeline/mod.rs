//! The request pipeline: what floodgate does with a request, in pure code, stage by stage.
//!
//! ```text
//! endpoints → shed (→ queue) → cap → leased → rate_limit → delay → select
//! ```
//!
//! Each stage lets the request go on, possibly holding something (an in-flight [`Permit`](crate::primitives::inflight::Permit), a
//! [`KeyPermit`](crate::shedding::per_key::KeyPermit), units of a leased key, a [`ClusterPermit`](crate::selection::ClusterPermit)), or answers it; the host shell turns
//! the answer ([`Step`]) into host calls. The `leased` stage may make the request wait; the store's
//! answer resumes it on the same stream state ([`Stream`]); the `delay` stage parks
//! a request a token bucket let in to wait for its turn, and the root's tick resumes it;
//! with `load_shedding.queue`, a request the in-flight limit would shed
//! waits in the `queue` stage for a slot, which the root's tick gives it. A stream waits on one
//! thing at a time, holding what that wait holds; one [`resume`] and one [`abandon`] take every
//! kind of wait ([`Waiting`]).
//! Before all stages, a request whose estimate a rule reads in its JSON body
//! (`cost.estimate.body`) waits for its body, holding nothing; the body's callbacks decide it
//! once the estimate is read ([`request_body_estimates`]), or the root's tick, when none of the
//! body reached the filter ([`Waiting::Body`], [`body_wait`]).
//! The stream state also takes the
//! stream's later events (body, response, end). What the pipeline needs of the host is narrow: the
//! shared store, metrics and the VM's id ([`Env`]), the request's attributes ([`Request`]), the
//! response's ([`Attributes`], [`StreamEnd`]), and a random source.
//!
//! Invariant: everything a stage holds goes back exactly once: before the reply when a later stage
//! answers, otherwise when the stream ends, whatever ended it.
//!
//! Rationale: docs/design.md, section "A request's path".

pub mod body_wait;
pub mod decision;
pub mod delay;
pub mod headers;
pub mod asked;
pub mod leased;
pub mod queue;
pub mod stats;
mod filter;
mod stages;
mod stream;
mod wait;
mod walk;
#[cfg(test)]
mod tests;

use crate::config::GrpcStatus;
use crate::keys::Source;
use crate::primitives::store::SharedStore;
use crate::primitives::time::Now;
use crate::ratelimit::rules;
use crate::replies::grpc::GrpcReply;
use crate::replies::Reply;
pub use filter::{Due, Filter, Records, Schedule, Shadows, VmParts};
pub use rules::Attributes;
use stats::Metrics;
use std::borrow::Cow;
pub use stream::{SharedStream, Stream, StreamCell};
use wait::Wait;
pub use wait::{abandon, resume, Waiting};
pub use walk::{estimate_wants, request_body_estimates, request_headers, Stage};

/// The host's types the pipeline runs with: Envoy's in the module, fakes in the tests. The
/// pipeline is compiled for each, so its calls to the host are direct.
pub trait Host {
    /// The shared data.
    type Store: SharedStore;
    /// The stats.
    type Metrics: Metrics;
    /// The clocks.
    type Clock: Clock;
}

/// What the pipeline needs of its host besides the request.
pub struct Env<'a, H: Host> {
    /// Envoy's shared data (a map with Envoy's semantics in tests).
    pub store: &'a H::Store,
    /// Envoy's stats.
    pub metrics: &'a H::Metrics,
    /// The clocks, read only when a stage needs them (the host reads them at most once per
    /// callback).
    pub clock: &'a H::Clock,
    /// This VM's random id in the shared records.
    pub vm: u64,
}

impl<H: Host> Clone for Env<'_, H> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<H: Host> Copy for Env<'_, H> {}

/// The host's clocks.
pub trait Clock {
    /// Both clocks, now.
    fn now(&self) -> Now;
}

/// A request's attributes (its headers, and its source address), read from the host as the
/// pipeline asks for them.
pub trait Request: Attributes {
    /// The downstream address as Envoy settled it (`source_ip`), with its port.
    fn source_address(&self) -> Option<Cow<'_, [u8]>>;
    /// A key part's attribute.
    fn fetch(&self, source: Source<'_>) -> Option<Cow<'_, [u8]>> {
        match source {
            Source::Header(name) => self.get(name),
            Source::SourceAddress => self.source_address(),
        }
    }
}

/// What ended a stream, read only when the pipeline needs it (each is a host call).
pub trait StreamEnd {
    /// The response's status, if one was sent.
    fn status(&self) -> Option<u16>;
    /// Envoy's response flags (`UT`, `UF`, ...).
    fn flags(&self) -> u64;
}

/// A local reply, in the form the request's protocol needs.
#[derive(Clone, Debug, PartialEq)]
pub enum LocalReply {
    /// An HTTP reply.
    Http(Reply),
    /// A gRPC trailers-only reply, for a gRPC request.
    Grpc(GrpcReply),
}

/// What the host does next with a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// The request goes on; with `route`, the cluster (an index in `cluster_selection.clusters`)
    /// whose name the host sets in the route header first.
    Continue {
        /// The chosen cluster.
        route: Option<usize>,
    },
    /// The request is answered here.
    Reply(LocalReply),
    /// The request waits for the store: the host pauses it, and resumes it when the leased stage
    /// wakes it.
    Wait,
}

/// Whether a body or trailers callback lets the data through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flow {
    /// Let it through.
    Continue,
    /// Hold it: the request waits for the store.
    Pause,
}

/// What a stream knows of gRPC.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrpcCall {
    /// The request is gRPC (known for a refused request and for one routed by selection).
    pub request: bool,
    /// The `grpc-status` the response ended with, once read.
    pub status: Option<GrpcStatus>,
}

