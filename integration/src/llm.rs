//! [`LlmUpstream`]: an HTTP/1.1 server that answers like an LLM API, with the token counts the
//! test asks for in each request's headers, as one JSON body or as a server-sent-event stream:
//! by path, OpenAI's Chat Completions (`/v1/chat/completions`: the usage in the last event of a
//! stream, as with `stream_options.include_usage`), OpenAI's Responses (`/v1/responses`: the
//! usage in the `response.completed` event) and Anthropic's Messages (`/v1/messages`: the input
//! tokens in `message_start`, the output tokens in `message_delta`). It can hold requests until
//! the test releases them (to have some in flight), answer badly on request (a 10 MiB body, a
//! truncated JSON, a stream without its usage event, a stream that never ends), and compress its
//! answers with gzip (as hosted APIs do) when the request accepts it.
//!
//! Request headers it reads:
//! * `x-test-usage`: the total tokens to report (default 0); `x-test-prompt`: the input
//!   (prompt) tokens among them (default 0; the output tokens are the rest).
//! * `x-test-pad`: about this many more bytes of content before the usage (a JSON string, or
//!   content events of a stream, 64 bytes of content each): a long answer.
//! * `x-test-mode`: `json`, `sse`, `huge` (a 10 MiB JSON body, the usage at its end),
//!   `truncated` (a JSON body cut before its usage), `sse-no-usage` (a stream that ends without
//!   a usage event), `sse-hang` (a stream that sends two events and then nothing until the
//!   client goes away); without it, `sse` when the request's JSON body says `"stream": true`
//!   (as the SDKs send it), else `json`. The bad modes are Chat Completions answers.
//! * `accept-encoding`: with `gzip` in it, and compression on ([`LlmUpstream::compress`]), the
//!   answer is gzip-compressed (`content-encoding: gzip`; a stream flushed at each event).

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
use crate::workspace_root;

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
    /// Whether answers are compressed for requests that accept gzip.
    compress: std::sync::atomic::AtomicBool,
    /// Answers sent compressed.
    compressed: AtomicU64,
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
            compress: std::sync::atomic::AtomicBool::new(false),
            compressed: AtomicU64::new(0),
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

    /// From now on, answers to requests that accept gzip are compressed (`on`), or not.
    pub fn compress(&self, on: bool) {
        self.state.compress.store(on, Ordering::SeqCst);
    }

    /// Answers sent compressed.
    pub fn compressed(&self) -> u64 {
        self.state.compressed.load(Ordering::SeqCst)
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

/// Which API a request calls, by its path.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    /// OpenAI's Chat Completions (and any other path).
    Chat,
    /// OpenAI's Responses.
    Responses,
    /// Anthropic's Messages.
    Messages,
}

/// An answer's token counts.
#[derive(Clone, Copy, Debug)]
struct Tokens {
    input: u64,
    output: u64,
}

fn chat_usage(tokens: Tokens) -> String {
    format!(r#"{{"prompt_tokens":{},"completion_tokens":{},"total_tokens":{}}}"#, tokens.input, tokens.output, tokens.input + tokens.output)
}

fn chunk(content: &str) -> Bytes {
    Bytes::from(format!(
        "data: {{\"id\":\"chatcmpl-test\",\"object\":\"chat.completion.chunk\",\"created\":1700000000,\"model\":\"test\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{content}\"}},\"finish_reason\":null}}],\"usage\":null}}\n\n"
    ))
}

async fn answer(state: Arc<State>, req: Request<Incoming>) -> Result<Response<Channel<Bytes>>, std::convert::Infallible> {
    state.arrived.fetch_add(1, Ordering::SeqCst);
    let total = header_number(&req, "x-test-usage");
    let prompt = header_number(&req, "x-test-prompt").min(total);
    let tokens = Tokens { input: prompt, output: total - prompt };
    let pad = usize::try_from(header_number(&req, "x-test-pad")).unwrap_or(0);
    let mode = req.headers().get("x-test-mode").and_then(|v| v.to_str().ok()).map(str::to_owned);
    let gzip = state.compress.load(Ordering::SeqCst)
        && req.headers().get_all("accept-encoding").iter().any(|v| v.to_str().is_ok_and(|v| v.split(',').any(|e| e.trim().eq_ignore_ascii_case("gzip"))));
    let api = match req.uri().path() {
        "/v1/responses" => Api::Responses,
        "/v1/messages" => Api::Messages,
        _ => Api::Chat,
    };
    // Read the request body (the chat request) to its end.
    let mut streamed = false;
    if let Ok(body) = http_body_util::BodyExt::collect(req.into_body()).await {
        let body = body.to_bytes();
        state.last_body.store(u64::try_from(body.len()).unwrap_or(u64::MAX), Ordering::SeqCst);
        streamed = serde_json::from_slice::<serde_json::Value>(&body).is_ok_and(|v| v["stream"] == serde_json::Value::Bool(true));
    }
    let mode = mode.unwrap_or_else(|| if streamed { "sse".into() } else { "json".into() });
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
    let mut response = Response::builder().status(200).header("content-type", content_type);
    if gzip {
        response = response.header("content-encoding", "gzip");
        state.compressed.fetch_add(1, Ordering::SeqCst);
    }
    let sink = Sink { tx, gzip: gzip.then(|| flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default())) };
    tokio::spawn(send_body(state, sink, api, mode, tokens, pad));
    Ok(response.body(body).expect("a response"))
}

/// Where an answer's bytes go: to the client, gzip-compressed or not (a compressed stream is
/// flushed at each piece, so that every event reaches the client when sent).
struct Sink {
    tx: Sender<Bytes>,
    gzip: Option<flate2::write::GzEncoder<Vec<u8>>>,
}

impl Sink {
    async fn send(&mut self, piece: Bytes) -> bool {
        let bytes = match &mut self.gzip {
            None => piece,
            Some(encoder) => {
                use std::io::Write;
                if encoder.write_all(&piece).and_then(|()| encoder.flush()).is_err() {
                    return false;
                }
                Bytes::from(std::mem::take(encoder.get_mut()))
            }
        };
        self.tx.send_data(bytes).await.is_ok()
    }

    /// The end of the answer (a compressed one's trailer).
    async fn finish(mut self) -> bool {
        match self.gzip.take().map(flate2::write::GzEncoder::finish) {
            None => true,
            Some(Ok(trailer)) => self.tx.send_data(Bytes::from(trailer)).await.is_ok(),
            Some(Err(_)) => false,
        }
    }
}

/// An event of a stream: its `event:` line (if any) and its data.
fn event(name: &str, data: &str) -> Bytes {
    if name.is_empty() {
        Bytes::from(format!("data: {data}\n\n"))
    } else {
        Bytes::from(format!("event: {name}\ndata: {data}\n\n"))
    }
}

fn responses_object(tokens: Tokens, done: bool) -> String {
    let (status, output, usage) = if done {
        let usage = format!(
            r#"{{"input_tokens":{},"input_tokens_details":{{"cached_tokens":0}},"output_tokens":{},"output_tokens_details":{{"reasoning_tokens":0}},"total_tokens":{}}}"#,
            tokens.input,
            tokens.output,
            tokens.input + tokens.output
        );
        let output = r#"[{"type":"message","id":"msg_test","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Hello there","annotations":[]}]}]"#;
        ("completed", output, usage)
    } else {
        ("in_progress", "[]", "null".to_owned())
    };
    format!(r#"{{"id":"resp_test","object":"response","created_at":1700000000,"status":"{status}","model":"test","output":{output},"usage":{usage}}}"#)
}

fn anthropic_message(tokens: Tokens) -> String {
    format!(
        r#"{{"id":"msg_test","type":"message","role":"assistant","model":"claude-test","content":[{{"type":"text","text":"Hello there"}}],"stop_reason":"end_turn","stop_sequence":null,"usage":{{"input_tokens":{},"output_tokens":{}}}}}"#,
        tokens.input, tokens.output
    )
}

async fn send_body(state: Arc<State>, mut sink: Sink, api: Api, mode: String, tokens: Tokens, pad: usize) {
    let usage = chat_usage(tokens);
    let message = r#"{"id":"chatcmpl-test","object":"chat.completion","created":1700000000,"model":"test","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there"},"finish_reason":"stop"}],"#;
    let mut ok = true;
    match (api, mode.as_str()) {
        (Api::Responses, "json") => ok &= sink.send(Bytes::from(responses_object(tokens, true))).await,
        (Api::Responses, _) => {
            let created = format!(r#"{{"type":"response.created","sequence_number":0,"response":{}}}"#, responses_object(tokens, false));
            ok &= sink.send(event("response.created", &created)).await;
            for (i, word) in ["Hello", " there"].iter().enumerate() {
                let delta = format!(
                    r#"{{"type":"response.output_text.delta","sequence_number":{},"item_id":"msg_test","output_index":0,"content_index":0,"delta":"{word}","logprobs":[]}}"#,
                    i + 1
                );
                ok &= sink.send(event("response.output_text.delta", &delta)).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let completed = format!(r#"{{"type":"response.completed","sequence_number":3,"response":{}}}"#, responses_object(tokens, true));
            ok &= sink.send(event("response.completed", &completed)).await;
        }
        (Api::Messages, "json") => ok &= sink.send(Bytes::from(anthropic_message(tokens))).await,
        (Api::Messages, _) => {
            let start = format!(
                r#"{{"type":"message_start","message":{{"id":"msg_test","type":"message","role":"assistant","model":"claude-test","content":[],"stop_reason":null,"stop_sequence":null,"usage":{{"input_tokens":{},"output_tokens":1}}}}}}"#,
                tokens.input
            );
            ok &= sink.send(event("message_start", &start)).await;
            ok &= sink.send(event("content_block_start", r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#)).await;
            ok &= sink.send(event("ping", r#"{"type": "ping"}"#)).await;
            for word in ["Hello", " there"] {
                let delta = format!(r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":"{word}"}}}}"#);
                ok &= sink.send(event("content_block_delta", &delta)).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            ok &= sink.send(event("content_block_stop", r#"{"type":"content_block_stop","index":0}"#)).await;
            let delta = format!(r#"{{"type":"message_delta","delta":{{"stop_reason":"end_turn","stop_sequence":null}},"usage":{{"output_tokens":{}}}}}"#, tokens.output);
            ok &= sink.send(event("message_delta", &delta)).await;
            ok &= sink.send(event("message_stop", r#"{"type":"message_stop"}"#)).await;
        }
        (Api::Chat, "sse" | "sse-no-usage" | "sse-hang") => {
            let word = "w".repeat(64);
            for _ in 0..pad / 64 {
                ok &= sink.send(chunk(&word)).await;
            }
            for word in ["Hel", "lo", " there"] {
                ok &= sink.send(chunk(word)).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if mode == "sse-hang" {
                // Nothing more until the client goes away (the sender is dropped then).
                while sink.send(Bytes::from_static(b": keep-alive\n\n")).await {
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
                return;
            }
            if mode == "sse" {
                let last = format!(r#"{{"id":"chatcmpl-test","object":"chat.completion.chunk","created":1700000000,"model":"test","choices":[],"usage":{usage}}}"#);
                ok &= sink.send(event("", &last)).await;
            }
            ok &= sink.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
        }
        (Api::Chat, "huge") => {
            ok &= sink.send(Bytes::from(format!("{message}\"padding\":\""))).await;
            let piece = Bytes::from(vec![b'x'; 64 << 10]);
            for _ in 0..HUGE_BODY_BYTES / piece.len() {
                ok &= sink.send(piece.clone()).await;
            }
            ok &= sink.send(Bytes::from(format!("\",\"usage\":{usage}}}"))).await;
        }
        (Api::Chat, "truncated") => ok &= sink.send(Bytes::from(message.get(..message.len() / 2).unwrap_or(message).to_owned())).await,
        (Api::Chat, _) => {
            let padding = if pad == 0 { String::new() } else { format!("\"padding\":\"{}\",", "x".repeat(pad)) };
            ok &= sink.send(Bytes::from(format!("{message}{padding}\"usage\":{usage}}}"))).await;
        }
    }
    if ok && sink.finish().await {
        state.answered.fetch_add(1, Ordering::SeqCst);
        if matches!(mode.as_str(), "json" | "sse" | "huge") {
            state.reported.fetch_add(tokens.input + tokens.output, Ordering::SeqCst);
        }
    }
}

/// The Python that has the `openai` and `anthropic` SDKs: `$LLM_PYTHON`, else
/// `<workspace>/.venv/bin/python` (where `scripts/llm-sdks.sh`, run by `./test.sh`, installs
/// them). A Python without them fails the test, saying how to get them.
pub fn sdk_python() -> std::path::PathBuf {
    static PYTHON: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    PYTHON
        .get_or_init(|| crate::artifacts::venv_python("LLM_PYTHON", "openai, anthropic", "scripts/llm-sdks.sh"))
        .clone()
}

/// Runs `integration/llm/sdk.py` with `args` (its calls through an SDK, see its doc) and
/// returns what it printed. Bounded: a run longer than `limit` is killed and fails the test.
pub fn run_sdk(args: &[&str], limit: Duration) -> serde_json::Value {
    let child = std::process::Command::new(sdk_python())
        .arg(workspace_root().join("integration/llm/sdk.py"))
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start sdk.py");
    let (output, finished) = crate::grpc::wait_bounded(child, limit);
    assert!(finished, "sdk.py {args:?} ran longer than {limit:?}");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "sdk.py {args:?} failed: {}\n{stdout}", String::from_utf8_lossy(&output.stderr));
    serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("sdk.py {args:?} printed no JSON ({e}): {stdout}"))
}
