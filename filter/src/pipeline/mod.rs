//! The request pipeline: what floodgate does with a request, in pure code, stage by stage.
//!
//! ```text
//! body → endpoints → shed → queue → cap → leased → rate_limit → delay → select
//! ```
//!
//! The order is data ([`Stage::ORDER`], which `floodgate explain` reads too), and one walk runs
//! it (`walk`): each stage takes what it needs and lets the request go on, possibly holding
//! something (an in-flight [`Permit`](crate::primitives::inflight::Permit), a
//! [`KeyPermit`](crate::shedding::per_key::KeyPermit), units of a leased key, a
//! [`ClusterPermit`](crate::selection::ClusterPermit)), answers it, or makes it wait; the host
//! shell turns the answer ([`Step`]) into host calls. Some stages make a request wait, holding
//! what that wait holds: `body` for its body, when a rule reads its cost's estimate in it
//! (`cost.estimate.body`), holding nothing; `queue` for a slot, when the in-flight limit would
//! shed it (`load_shedding.queue`); `leased` for the store's units; `rate_limit` for the answer
//! to a batched global rule's ask ([`asked`]); `delay` for its turn, when a token bucket let it
//! in to wait. A waiting stream is parked in one place, by what it waits for ([`Waiting`]); one
//! [`resume`] re-enters the walk after the stage it waited in (or at that stage, for one that
//! decides again with what came: the store's answer, an ask's), and one [`abandon`] gives back
//! what a stream whose context is gone holds. A stream waits on one thing at a time.
//!
//! The modules: `filter` (a configuration as its streams share it), `stream` (a request's
//! state and its events after the request headers: body, response, end), `stages` (the
//! stages' decisions), `walk` (the order and the walk), `wait` (waits, resumption,
//! abandonment), one per stage that keeps requests waiting or state of its own, and
//! [`batched`] (the root's side of the batched global rules the `rate_limit` stage decides: its
//! tick, its batch and the answer, as the host carries them out). What the pipeline needs of
//! the host is narrow: the shared store, metrics and the VM's id ([`Env`]), the request's
//! attributes ([`Request`]), the response's ([`Attributes`], [`StreamEnd`]), and a random
//! source.
//!
//! Invariant: everything a stage holds goes back exactly once: before the reply when a later
//! stage answers (at the walk's end), otherwise when the stream ends, whatever ended it.
//!
//! Rationale: docs/design.md, section "A request's path".

pub mod batched;
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
pub use filter::{Due, Filter, Fleet, Limits, Records, Schedule, Selection, Shadows, Shedding, VmParts, Waits};
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

