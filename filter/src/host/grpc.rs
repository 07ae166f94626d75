//! The gRPC part of the shell ([`crate::replies::grpc`] decides): sends a refusal as a gRPC
//! trailers-only response.

use crate::config::GrpcStatus;
use crate::replies::grpc::GrpcReply;
use proxy_wasm::hostcalls;
use proxy_wasm::types::GrpcStatusCode;

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
