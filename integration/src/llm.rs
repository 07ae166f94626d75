//! [`LlmUpstream`]: an HTTP/1.1 server that answers like an OpenAI-compatible chat completions
//! endpoint, with the token counts the test asks for in each request's headers, as one JSON
//! body or as a server-sent-event stream whose last event carries the usage
//! (`stream_options.include_usage`). It can hold requests until the test releases them (to have
//! some in flight), and answer badly on request: a 10 MiB body, a truncated JSON, a stream
//! without its usage event, a stream that never ends.
//!
//! Request headers it reads:
//! * `x-test-usage`: the `total_tokens` to report (default 0); `x-test-prompt`: its
//!   `prompt_tokens` (default 0; `completion_tokens` is the rest).
//! * `x-test-pad`: about this many more bytes of content before the usage (a JSON string, or
//!   content events of a stream, 64 bytes of content each): a long answer.
//! * `x-test-mode`: `json` (default), `sse`, `huge` (a 10 MiB JSON body, the usage at its end),
//!   `truncated` (a JSON body cut before its usage), `sse-no-usage` (a stream that ends without
//!   a usage event), `sse-hang` (a stream that sends two events and then nothing until the
//!   client goes away).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::channel::{Channel, Sender};
use hyper::body::Incoming;
use hyper::{Request, Response};
use tokio::sync::watch;

use crate::upstream::Server;

/// The size of the `huge` answer's body.
pub const HUGE_BODY_BYTES: usize = 10 << 20;

#[derive(Debug)]
struct State {
    /// Whether requests go on (false: they wait at arrival until it turns true).
    open: watch::Sender<bool>,
    arrived: AtomicU64,
    held: AtomicU64,
    most_held: AtomicU64,
    answered: AtomicU64,
    /// Total tokens reported in answers that carried a usage.
    reported: AtomicU64,
    /// The bytes of the last request body received whole.
    last_body: AtomicU64,
}

/// An OpenAI-like upstream on `127.0.0.1:<ephemeral>`, on its own thread and tokio runtime;
/// dropping it stops it.
pub struct LlmUpstream {
    state: Arc<State>,
    server: Server,
}

impl LlmUpstream {
    /// Starts it, open (requests are answered at once).
    pub fn start() -> LlmUpstream {
        let (open, _) = watch::channel(true);
        let state = Arc::new(State {
            open,
            arrived: AtomicU64::new(0),
            held: AtomicU64::new(0),
            most_held: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            reported: AtomicU64::new(0),
            last_body: AtomicU64::new(0),
        });
        let server_state = state.clone();
        let server = Server::start("llm-upstream", move |req| answer(server_state.clone(), req));
        LlmUpstream { state, server }
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    /// From now on, requests wait at arrival until [`LlmUpstream::release`].
    pub fn hold(&self) {
        self.state.open.send_replace(false);
        self.state.most_held.store(0, Ordering::SeqCst);
    }

    /// Lets every waiting request (and every later one) be answered.
    pub fn release(&self) {
        self.state.open.send_replace(true);
    }

    /// Requests waiting now.
    pub fn held(&self) -> u64 {
        self.state.held.load(Ordering::SeqCst)
    }

    /// The most requests that waited at once since [`LlmUpstream::hold`].
    pub fn most_held(&self) -> u64 {
        self.state.most_held.load(Ordering::SeqCst)
    }

    /// Requests that arrived.
    pub fn arrived(&self) -> u64 {
        self.state.arrived.load(Ordering::SeqCst)
    }

    /// Answers whose body was sent to its end.
    pub fn answered(&self) -> u64 {
        self.state.answered.load(Ordering::SeqCst)
    }

    /// The total tokens of every answer that carried a usage.
    pub fn reported(&self) -> u64 {
        self.state.reported.load(Ordering::SeqCst)
    }

    /// The bytes of the last request body it received whole.
    pub fn last_body_bytes(&self) -> u64 {
        self.state.last_body.load(Ordering::SeqCst)
    }

    /// Waits (at most `timeout`) until `n` requests wait; returns how many do.
    pub fn wait_held(&self, n: u64, timeout: Duration) -> u64 {
        let deadline = std::time::Instant::now() + timeout;
        while self.held() < n && std::time::Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        self.held()
    }
}

fn header_number(req: &Request<Incoming>, name: &str) -> u64 {
    req.headers().get(name).and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn usage(total: u64, prompt: u64) -> String {
    let prompt = prompt.min(total);
    format!(r#"{{"prompt_tokens":{prompt},"completion_tokens":{},"total_tokens":{total}}}"#, total - prompt)
}

fn chunk(content: &str) -> Bytes {
    Bytes::from(format!(
        "data: {{\"id\":\"chatcmpl-test\",\"object\":\"chat.completion.chunk\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{content}\"}}}}],\"usage\":null}}\n\n"
    ))
}

async fn answer(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Channel<Bytes>>, std::convert::Infallible> {
    state.arrived.fetch_add(1, Ordering::SeqCst);
    let total = header_number(&req, "x-test-usage");
    let prompt = header_number(&req, "x-test-prompt");
    let pad = usize::try_from(header_number(&req, "x-test-pad")).unwrap_or(0);
    let mode = req.headers().get("x-test-mode").and_then(|v| v.to_str().ok()).unwrap_or("json").to_owned();
    // Read the request body (the chat request) to its end.
    if let Ok(body) = http_body_util::BodyExt::collect(req.into_body()).await {
        state.last_body.store(u64::try_from(body.to_bytes().len()).unwrap_or(u64::MAX), Ordering::SeqCst);
    }
    let mut open = state.open.subscribe();
    if !*open.borrow() {
        let now = state.held.fetch_add(1, Ordering::SeqCst) + 1;
        state.most_held.fetch_max(now, Ordering::SeqCst);
        let _ = open.wait_for(|open| *open).await;
        state.held.fetch_sub(1, Ordering::SeqCst);
    }
    let (tx, body) = Channel::<Bytes>::new(4);
    let event_stream = mode.starts_with("sse");
    let content_type = if event_stream { "text/event-stream" } else { "application/json" };
    tokio::spawn(send_body(state, tx, mode, (total, prompt), pad));
    Ok(Response::builder().status(200).header("content-type", content_type).body(body).expect("a response"))
}

async fn send_body(state: Arc<State>, mut tx: Sender<Bytes>, mode: String, (total, prompt): (u64, u64), pad: usize) {
    let usage = usage(total, prompt);
    let message = r#"{"id":"chatcmpl-test","object":"chat.completion","model":"test","choices":[{"index":0,"message":{"role":"assistant","content":"Hello"},"finish_reason":"stop"}],"#;
    let sent = match mode.as_str() {
        "sse" | "sse-no-usage" | "sse-hang" => {
            let mut ok = true;
            let word = "w".repeat(64);
            for _ in 0..pad / 64 {
                ok &= tx.send_data(chunk(&word)).await.is_ok();
            }
            for word in ["Hel", "lo", " there"] {
                ok &= tx.send_data(chunk(word)).await.is_ok();
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if mode == "sse-hang" {
                // Nothing more until the client goes away (the sender is dropped then).
                while tx.send_data(Bytes::from_static(b": keep-alive\n\n")).await.is_ok() {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                return;
            }
            if mode == "sse" {
                let last = format!("data: {{\"id\":\"chatcmpl-test\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{usage}}}\n\n");
                ok &= tx.send_data(Bytes::from(last)).await.is_ok();
            }
            ok && tx.send_data(Bytes::from_static(b"data: [DONE]\n\n")).await.is_ok()
        }
        "huge" => {
            let mut ok = tx.send_data(Bytes::from(format!("{message}\"padding\":\""))).await.is_ok();
            let piece = Bytes::from(vec![b'x'; 64 << 10]);
            for _ in 0..HUGE_BODY_BYTES / piece.len() {
                ok &= tx.send_data(piece.clone()).await.is_ok();
            }
            ok && tx.send_data(Bytes::from(format!("\",\"usage\":{usage}}}"))).await.is_ok()
        }
        "truncated" => tx.send_data(Bytes::from(message.get(..message.len() / 2).unwrap_or(message).to_owned())).await.is_ok(),
        _ => {
            let padding = if pad == 0 { String::new() } else { format!("\"padding\":\"{}\",", "x".repeat(pad)) };
            tx.send_data(Bytes::from(format!("{message}{padding}\"usage\":{usage}}}"))).await.is_ok()
        }
    };
    if sent {
        state.answered.fetch_add(1, Ordering::SeqCst);
        if matches!(mode.as_str(), "json" | "sse" | "huge") {
            state.reported.fetch_add(total, Ordering::SeqCst);
        }
    }
}
