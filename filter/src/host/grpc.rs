//! The gRPC part of the shell ([`crate::replies::grpc`] decides): sends a refusal as a gRPC
//! trailers-only response, and reads the `grpc-status` a gRPC call ended with.

use crate::config::GrpcStatus;
use crate::replies::grpc::{self, GrpcReply};
use proxy_wasm::hostcalls;
use proxy_wasm::types::{GrpcStatusCode, MapType};

/// What a stream knows of gRPC.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Call {
    /// The request is gRPC (known for a refused request and for one with a cluster lease).
    pub(super) request: bool,
    /// The `grpc-status` the response ended with, once read.
    pub(super) status: Option<GrpcStatus>,
}

impl Call {
    /// Reads `grpc-status` from the response headers, if they end the stream (a trailers-only
    /// response); otherwise it comes with the trailers.
    pub(super) fn headers(&mut self, end_of_stream: bool) {
        if self.request && end_of_stream {
            self.status = status_in(MapType::HttpResponseHeaders);
        }
    }

    /// Reads `grpc-status` from the response trailers.
    pub(super) fn trailers(&mut self) {
        if self.request {
            self.status = status_in(MapType::HttpResponseTrailers);
        }
    }
}

/// The `grpc-status` of a response header map (read in its own callback, where the map exists).
fn status_in(map: MapType) -> Option<GrpcStatus> {
    let value = hostcalls::get_map_value_bytes(map, "grpc-status").ok().flatten()?;
    Some(grpc::parse_status(&value))
}

/// Sends `reply`; Envoy makes it a trailers-only response, since the request is gRPC.
pub(super) fn send(reply: &GrpcReply) {
    let metadata: Vec<(&str, &[u8])> = reply.metadata.iter().map(|(name, value)| (*name, value.as_bytes())).collect();
    if let Err(status) = hostcalls::send_grpc_response(code(reply.status), Some(&reply.message), metadata) {
        log::warn!("floodgate: gRPC local reply failed: {status:?}");
    }
}

/// The SDK's name for a status.
fn code(status: GrpcStatus) -> GrpcStatusCode {
    match status.code() {
        0 => GrpcStatusCode::Ok,
        1 => GrpcStatusCode::Cancelled,
        3 => GrpcStatusCode::InvalidArgument,
        4 => GrpcStatusCode::DeadlineExceeded,
        5 => GrpcStatusCode::NotFound,
        6 => GrpcStatusCode::AlreadyExists,
        7 => GrpcStatusCode::PermissionDenied,
        8 => GrpcStatusCode::ResourceExhausted,
        9 => GrpcStatusCode::FailedPrecondition,
        10 => GrpcStatusCode::Aborted,
        11 => GrpcStatusCode::OutOfRange,
        12 => GrpcStatusCode::Unimplemented,
        13 => GrpcStatusCode::Internal,
        14 => GrpcStatusCode::Unavailable,
        15 => GrpcStatusCode::DataLoss,
        16 => GrpcStatusCode::Unauthenticated,
        _ => GrpcStatusCode::Unknown,
    }
}
