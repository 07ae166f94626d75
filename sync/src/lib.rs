//! floodgate-sync: the stateless ambassador between floodgate proxies and Redis.
//!
//! proxy-wasm filters can only make HTTP (or gRPC) calls to an Envoy cluster, so a proxy's
//! global-scope counters reach Redis through this service: a proxy POSTs a batch of counter
//! deltas (`/v1/sync`), the service applies them with one atomic Lua script per shard (one per
//! batch on a single node), exactly once per (proxy, seq) however often the batch is retried, and
//! answers with the fleet totals of the current and previous window buckets. Everything durable
//! is in Redis, so any number of instances may serve one fleet.
//!
//! - [`protocol`]: the request and answer types, strict validation.
//! - [`layout`]: shards, key names, expiries, and a batch's [`layout::Plan`].
//! - [`lease`]: `POST /v1/lease`, units of a key's quota granted ahead of use (leased rules),
//!   and the script `lease.lua`.
//! - [`store`]: Redis (single node or cluster) and the script `apply.lua`.
//! - [`http`]: the HTTP/1.1 + HTTP/2 server and its routes.
//! - [`metrics`]: counters and the latency histogram, as Prometheus text.
//! - [`config`]: flags and environment variables.
//!
//! Rationale: docs/design.md, section "Rate limiting across a fleet".

pub mod config;
pub mod http;
pub mod layout;
pub mod lease;
pub mod metrics;
pub mod protocol;
pub mod store;

use std::sync::Arc;

use tokio::net::TcpListener;
use tracing::info;

use crate::config::Args;
use crate::http::App;
use crate::layout::Layout;
use crate::metrics::Metrics;
use crate::store::{redact, Store, StoreConfig};

/// Runs the service until SIGTERM or SIGINT, then shuts down gracefully.
pub async fn run(args: Args) -> Result<(), String> {
    let metrics = Arc::new(Metrics::default());
    let store = Store::connect(
        &StoreConfig {
            urls: args.redis.clone(),
            cluster: args.cluster,
            timeout: args.redis_timeout,
        },
        metrics.clone(),
    )?;
    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|err| format!("--listen {}: {err}", args.listen))?;
    let local = listener
        .local_addr()
        .map_err(|err| format!("--listen {}: {err}", args.listen))?;
    let app = Arc::new(App {
        layout: Layout::new(args.prefix.clone(), args.shards),
        store,
        metrics,
        max_counters: usize::try_from(args.max_counters).unwrap_or(usize::MAX),
        max_body_bytes: usize::try_from(args.max_body_bytes).unwrap_or(usize::MAX),
    });
    let redis: Vec<String> = args.redis.iter().map(|url| redact(url)).collect();
    info!(
        "floodgate-sync {} serving POST /v1/sync /v1/lease, GET /healthz /readyz /metrics on http://{local} \
         (HTTP/1.1 and h2c); redis {} {}; shards {} prefix {:?}; max {} counters, {} bytes per \
         batch; redis timeout {:?}",
        env!("CARGO_PKG_VERSION"),
        if args.cluster {
            "cluster, seeds"
        } else {
            "single node"
        },
        redis.join(","),
        args.shards,
        args.prefix,
        args.max_counters,
        args.max_body_bytes,
        args.redis_timeout,
    );
    http::serve(listener, app, shutdown_signal(), args.shutdown_grace).await;
    info!("stopped");
    Ok(())
}

/// Completes on SIGTERM or SIGINT (Ctrl-C).
async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(err) => {
                tracing::warn!("cannot listen for SIGTERM: {err}");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => info!("SIGINT: shutting down"),
        () = terminate => info!("SIGTERM: shutting down"),
    }
}
