//! floodgate-sync: the stateless ambassador between floodgate proxies and Redis.
//!
//! proxy-wasm filters can only make HTTP (or gRPC) calls to an Envoy cluster, so a proxy's
//! global-scope counters reach Redis through this service: a proxy POSTs a batch of counter
//! deltas (`/v1/sync`), the service applies them with one atomic Lua script per shard (one per
//! batch on a single node), exactly once per (proxy, seq) however often the batch is retried, and
//! answers with the fleet totals of the current and previous window buckets. Everything durable
//! is in Redis, so any number of instances may serve one fleet.
//!
//! - [`auth`]: the proxies' bearer token (`--token`), compared in constant time.
//! - [`protocol`]: the request and answer types, strict validation.
//! - [`layout`]: shards, key names, expiries, and a batch's [`layout::Plan`].
//! - [`fleet`]: the fleet size the sync answers give, its callers merged into one count per
//!   period.
//! - [`lease`]: `POST /v1/lease`, units of a key's quota granted ahead of use (leased rules),
//!   and the script `lease.lua`.
//! - [`store`]: Redis (single node or cluster) and the script `apply.lua`.
//! - [`http`]: the HTTP/1.1 + HTTP/2 server and its routes.
//! - [`metrics`]: counters and the latency histogram, as Prometheus text.
//! - [`config`]: flags and environment variables.
//!
//! Rationale: docs/design.md, section "Rate limiting across a fleet".

pub mod auth;
pub mod config;
pub mod fleet;
pub mod holders;
pub mod http;
pub mod layout;
pub mod lease;
pub mod metrics;
pub mod protocol;
pub mod store;

use std::sync::Arc;

use tokio::net::TcpListener;
use tracing::{info, warn};

use crate::auth::Tokens;
use crate::config::Args;
use crate::fleet::FleetSize;
use crate::http::App;
use crate::layout::Layout;
use crate::metrics::Metrics;
use crate::store::{is_tls, redact, Store, StoreConfig, StoreTls};

/// A PEM file of a flag.
fn read_pem(flag: &str, path: Option<&std::path::PathBuf>) -> Result<Option<Vec<u8>>, String> {
    path.map(|path| std::fs::read(path).map_err(|err| format!("{flag} {}: {err}", path.display())))
        .transpose()
}

/// Runs the service until SIGTERM or SIGINT, then shuts down gracefully.
pub async fn run(args: Args) -> Result<(), String> {
    // rediss:// goes through rustls; its crypto is ring's (already set: by an embedding program).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let tokens = args.all_tokens()?;
    let client = match (
        read_pem("--redis-cert", args.redis_cert.as_ref())?,
        read_pem("--redis-key", args.redis_key.as_ref())?,
    ) {
        (Some(cert), Some(key)) => Some((cert, key)),
        _ => None,
    };
    let tls = StoreTls {
        ca: read_pem("--redis-ca", args.redis_ca.as_ref())?,
        client,
    };
    let metrics = Arc::new(Metrics::default());
    let store = Store::connect(
        &StoreConfig {
            urls: args.redis.clone(),
            cluster: args.cluster,
            timeout: args.redis_timeout,
            batch_pace: args.batch_pace,
            batch_gather: args.batch_gather,
            ask_pace: args.ask_pace,
            replica_acks: args.replica_acks,
            tls: tls.clone(),
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
        layout: if args.cluster {
            Layout::new(args.prefix.clone(), args.shards)
        } else {
            Layout::new(args.prefix.clone(), args.shards).single_node()
        },
        store,
        metrics,
        max_counters: usize::try_from(args.max_counters).unwrap_or(usize::MAX),
        max_body_bytes: usize::try_from(args.max_body_bytes).unwrap_or(usize::MAX),
        tokens: Tokens::new(&tokens),
        fleet: FleetSize::default(),
    });
    let redis: Vec<String> = args.redis.iter().map(|url| redact(url)).collect();
    let tls_summary = if !args.redis.iter().any(|url| is_tls(url)) {
        "no TLS"
    } else if tls.ca.is_some() {
        "TLS, CA of --redis-ca"
    } else {
        "TLS, public roots"
    };
    info!(
        "floodgate-sync {} serving POST /v1/sync /v1/lease, GET /v1/holders /healthz /readyz /metrics on http://{local} \
         (HTTP/1.1 and h2c); calls {}; redis {} {} ({tls_summary}{}); shards {} prefix {:?}; max {} counters, \
         {} bytes per batch; redis timeout {:?}",
        env!("CARGO_PKG_VERSION"),
        match tokens.len() {
            0 => "not authenticated".to_string(),
            n => format!("need a bearer token ({n} accepted)"),
        },
        if args.cluster {
            "cluster, seeds"
        } else {
            "single node"
        },
        redis.join(","),
        if tls.client.is_some() { ", client certificate" } else { "" },
        args.shards,
        args.prefix,
        args.max_counters,
        args.max_body_bytes,
        args.redis_timeout,
    );
    if tokens.is_empty() {
        warn!("no --token: POST /v1/sync, POST /v1/lease and GET /v1/holders accept any caller that reaches {local}");
    }
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
