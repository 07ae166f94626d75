//! The HTTP side: HTTP/1.1 and HTTP/2 (h2c with prior knowledge) on one port, six routes.
//!
//! | route | answer |
//! | --- | --- |
//! | `POST /v1/sync` | 200 with the batch's totals; 400, 413, 415, 503 with `{"error": ...}` |
//! | `POST /v1/lease` | 200 with the grants; the same errors |
//! | `GET /healthz` | 200 `{"status":"ok"}` while the process runs |
//! | `GET /v1/holders?key=...` | 200 with a leased key's holders (see [`crate::holders`]); 400, 503 |
//! | `GET /readyz` | 200 when Redis answers PING (every node of a cluster), else 503 |
//! | `GET /metrics` | Prometheus text |
//!
//! Anything else is 404, or 405 (with `allow`) for a known path. With tokens configured, the
//! `/v1/` routes need one (`authorization: Bearer ...`): 401 without, 403 with another one,
//! before the body is read; the other `GET` routes stay open (probes, scraping).

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::header::{HeaderValue, ALLOW, CONTENT_LENGTH, CONTENT_TYPE, WWW_AUTHENTICATE};
use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use crate::auth::{Tokens, Verdict};
use crate::holders::{buckets, parse_holders_query, HoldersAnswer};
use crate::fleet::FleetSize;
use crate::layout::{plan, Layout};
use crate::lease::{parse_lease_request, plan_lease, LeaseResponse};
use crate::metrics::{ErrorKind, Metrics};
use crate::protocol::{parse_batch, ErrorBody, SyncResponse, Totals, VERSION};
use crate::store::Store;

/// What the handlers share.
pub struct App {
    /// The key layout.
    pub layout: Layout,
    /// Redis.
    pub store: Store,
    /// The metrics.
    pub metrics: Arc<Metrics>,
    /// `--max-counters`.
    pub max_counters: usize,
    /// `--max-body-bytes`.
    pub max_body_bytes: usize,
    /// `--token`, `--token-file`: the tokens the `POST` routes need (none: open).
    pub tokens: Tokens,
    /// The fleet size the sync answers give.
    pub fleet: FleetSize,
}

type Answer = Response<Full<Bytes>>;

/// The header of a sync answer that gives the fleet size: the distinct proxies that sent a
/// batch in the last [`crate::layout::FLEET_SECONDS`] seconds, this one included ([`crate::fleet`]).
pub const PROXIES_HEADER: &str = "floodgate-proxies";

fn json(status: StatusCode, body: Vec<u8>) -> Answer {
    let mut answer = Response::new(Full::new(Bytes::from(body)));
    *answer.status_mut() = status;
    answer
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    answer
}

fn error(app: &App, kind: ErrorKind, message: impl Into<String>) -> Answer {
    app.metrics.error(kind);
    let body = serde_json::to_vec(&ErrorBody {
        error: message.into(),
    })
    .unwrap_or_else(|_| b"{\"error\":\"?\"}".to_vec());
    let status = StatusCode::from_u16(kind.status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    json(status, body)
}

fn method_not_allowed(app: &App, allow: &'static str) -> Answer {
    let mut answer = error(
        app,
        ErrorKind::MethodNotAllowed,
        format!("method not allowed (allow: {allow})"),
    );
    answer
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    answer
}

/// The refusal of a call without the right token (nothing read beyond its headers), if it is
/// one.
fn refused(app: &App, request: &Request<Incoming>) -> Option<Answer> {
    match app.tokens.check(request.headers()) {
        Verdict::Allowed => None,
        Verdict::Missing => {
            debug!("401: {} without a bearer token", request.uri().path());
            let mut answer = error(app, ErrorKind::Unauthorized, "authorization: a bearer token is required");
            answer
                .headers_mut()
                .insert(WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            Some(answer)
        }
        Verdict::Wrong => {
            debug!("403: {} with a token that is not one of --token's", request.uri().path());
            Some(error(app, ErrorKind::Forbidden, "authorization: the bearer token is not accepted"))
        }
    }
}

/// Routes one request.
pub async fn handle(app: Arc<App>, request: Request<Incoming>) -> Result<Answer, Infallible> {
    let path = request.uri().path();
    let method = request.method();
    let answer = match path {
        "/v1/sync" if method == Method::POST => {
            let started = Instant::now();
            let answer = match refused(&app, &request) {
                Some(answer) => answer,
                None => sync(&app, request).await,
            };
            app.metrics.sync_latency(started.elapsed());
            answer
        }
        "/v1/sync" => method_not_allowed(&app, "POST"),
        "/v1/lease" if method == Method::POST => {
            let started = Instant::now();
            let answer = match refused(&app, &request) {
                Some(answer) => answer,
                None => lease(&app, request).await,
            };
            app.metrics.lease_latency(started.elapsed());
            answer
        }
        "/v1/lease" => method_not_allowed(&app, "POST"),
        "/v1/holders" if method == Method::GET || method == Method::HEAD => match refused(&app, &request) {
            Some(answer) => answer,
            None => holders(&app, request.uri().query()).await,
        },
        "/v1/holders" => method_not_allowed(&app, "GET, HEAD"),
        "/healthz" | "/readyz" | "/metrics" if method != Method::GET && method != Method::HEAD => {
            method_not_allowed(&app, "GET, HEAD")
        }
        "/healthz" => json(StatusCode::OK, b"{\"status\":\"ok\"}".to_vec()),
        "/readyz" => match app.store.ping().await {
            Ok(()) => json(StatusCode::OK, b"{\"status\":\"ready\"}".to_vec()),
            Err(err) => {
                let body = serde_json::json!({"status": "unavailable", "error": format!("store unavailable: {err}")});
                json(
                    StatusCode::SERVICE_UNAVAILABLE,
                    body.to_string().into_bytes(),
                )
            }
        },
        "/metrics" => {
            let mut answer = Response::new(Full::new(Bytes::from(app.metrics.render())));
            answer.headers_mut().insert(
                CONTENT_TYPE,
                HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            answer
        }
        _ => error(&app, ErrorKind::NotFound, format!("no such path: {path}")),
    };
    Ok(answer)
}

/// `application/json`, whatever the case, with or without parameters (`; charset=utf-8`).
fn is_json(request: &Request<Incoming>) -> bool {
    request
        .headers()
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.split(';').next())
        .is_some_and(|media| media.trim().eq_ignore_ascii_case("application/json"))
}

/// A request's JSON body, within `--max-body-bytes`, or the error answer.
async fn json_body(app: &App, request: Request<Incoming>) -> Result<Bytes, Answer> {
    if !is_json(&request) {
        return Err(error(
            app,
            ErrorKind::UnsupportedMediaType,
            "content-type: expected application/json",
        ));
    }
    let too_large = || {
        error(
            app,
            ErrorKind::PayloadTooLarge,
            format!("body: larger than {} bytes", app.max_body_bytes),
        )
    };
    let declared = request
        .headers()
        .get(CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > u64::try_from(app.max_body_bytes).unwrap_or(u64::MAX))
    {
        return Err(too_large());
    }
    match Limited::new(request.into_body(), app.max_body_bytes)
        .collect()
        .await
    {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => Err(too_large()),
        Err(err) => Err(error(
            app,
            ErrorKind::BadRequest,
            format!("body: could not be read: {err}"),
        )),
    }
}

async fn sync(app: &App, request: Request<Incoming>) -> Answer {
    let body = match json_body(app, request).await {
        Ok(body) => body,
        Err(answer) => return answer,
    };
    let batch = match parse_batch(&body, app.max_counters) {
        Ok(batch) => batch,
        Err(message) => {
            debug!("400: {message}");
            return error(app, ErrorKind::BadRequest, message);
        }
    };
    app.metrics.batch_received(batch.counters.len());
    let plan = plan(&app.layout, &batch);
    let (outcome, proxies) = tokio::join!(
        app.store.apply(&plan),
        app.fleet.called(&app.store, &app.layout, batch.proxy.as_str())
    );
    let outcome = match outcome {
        Ok(outcome) => outcome,
        Err(err) => {
            return error(app, err.kind(), format!("store unavailable: {err}"));
        }
    };
    app.metrics
        .batch_done(outcome.applied, outcome.deduplicated);
    let counters: Vec<Totals> = plan
        .index
        .iter()
        .map(|&at| {
            outcome.totals.get(at).copied().unwrap_or(Totals {
                previous: 0,
                current: 0,
            })
        })
        .collect();
    match serde_json::to_vec(&SyncResponse {
        version: VERSION,
        counters,
    }) {
        Ok(body) => {
            let mut answer = json(StatusCode::OK, body);
            // The fleet size is advice: a batch is confirmed without it.
            if let Some(proxies) = proxies {
                app.metrics.set_proxies(proxies);
                answer
                    .headers_mut()
                    .insert(PROXIES_HEADER, HeaderValue::from(proxies));
            }
            answer
        }
        Err(err) => error(
            app,
            ErrorKind::StoreError,
            format!("store unavailable: {err}"),
        ),
    }
}

async fn holders(app: &App, query: Option<&str>) -> Answer {
    let query = match parse_holders_query(query, &app.layout) {
        Ok(query) => query,
        Err(message) => return error(app, ErrorKind::BadRequest, message),
    };
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    let counters = buckets(&query, &app.layout, now_ms);
    match app.store.holders(&counters, now_ms).await {
        Ok(buckets) => {
            let answer = HoldersAnswer { key: query.key.as_str().to_owned(), window_ms: query.window_ms, buckets };
            match serde_json::to_vec(&answer) {
                Ok(body) => json(StatusCode::OK, body),
                Err(err) => error(app, ErrorKind::StoreError, format!("store unavailable: {err}")),
            }
        }
        Err(err) => error(app, err.kind(), format!("store unavailable: {err}")),
    }
}

async fn lease(app: &App, request: Request<Incoming>) -> Answer {
    let body = match json_body(app, request).await {
        Ok(body) => body,
        Err(answer) => return answer,
    };
    let request = match parse_lease_request(&body, app.max_counters) {
        Ok(request) => request,
        Err(message) => {
            debug!("400: {message}");
            return error(app, ErrorKind::BadRequest, message);
        }
    };
    let planned: Vec<_> = request
        .leases
        .iter()
        .map(|entry| plan_lease(&app.layout, entry))
        .collect();
    let grants = match app.store.lease(&planned).await {
        Ok(grants) => grants,
        Err(err) => return error(app, err.kind(), format!("store unavailable: {err}")),
    };
    app.metrics.leases_granted(
        grants.len(),
        grants.iter().map(|grant| grant.granted).sum(),
        grants.iter().map(|grant| grant.reclaimed).sum(),
    );
    match serde_json::to_vec(&LeaseResponse {
        version: VERSION,
        leases: grants,
    }) {
        Ok(body) => json(StatusCode::OK, body),
        Err(err) => error(
            app,
            ErrorKind::StoreError,
            format!("store unavailable: {err}"),
        ),
    }
}

/// Serves HTTP/1.1 and HTTP/2 on `listener` until `shutdown` completes, then lets the open
/// connections finish their requests (at most `grace`).
pub async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    shutdown: impl Future<Output = ()>,
    grace: Duration,
) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(Duration::from_secs(30));
    builder
        .http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)));
    let graceful = GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (stream, peer): (_, SocketAddr) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(err) => {
                    // Out of file descriptors and the like: pause rather than spin.
                    warn!("accept failed: {err}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let service = service_fn(move |request| handle(app.clone(), request));
        let connection = builder
            .serve_connection(TokioIo::new(stream), service)
            .into_owned();
        let connection = graceful.watch(connection);
        tokio::spawn(async move {
            if let Err(err) = connection.await {
                debug!("connection from {peer}: {err}");
            }
        });
    }
    info!("shutting down: no new connections; waiting up to {grace:?} for open ones");
    drop(listener);
    match tokio::time::timeout(grace, graceful.shutdown()).await {
        Ok(()) => info!("every connection closed"),
        Err(_) => warn!("connections still open after {grace:?}; closing them"),
    }
}
