//! The LLM variants of measurement 1b: what `floodgate-llm.wasm` costs beside `floodgate.wasm`,
//! and what settling a token quota from an answer's body costs, per request and per MiB.
//!
//! Their upstream answers like an OpenAI-compatible chat completions endpoint, over HTTP/2 (the
//! `h2` crate) so that the frames Envoy hands the module are the ones it sends, whatever the
//! timing: `GET /v1/json/<bytes>` is a JSON answer of about that many bytes with its `usage` at
//! the end, in 16 KiB frames (how a proxy reads a body written at once); `GET /v1/sse/<bytes>` is
//! a `text/event-stream` of about that many bytes, one frame per event as a model writes them
//! (one event per token, [`EVENT_BYTES`] each), the usage in the last event before
//! `data: [DONE]`. Every answer has a `content-length`, so the load generator reads it as any
//! other.
//!
//! Variants (none in the default set: the large answers are slow under valgrind), each of
//! `<kind>-<size>` (`json-1k`, `json-1m`, `sse-1k`, `sse-1m`) over that traffic:
//! * `none-<kind>-<size>`: no filter, the base of the ratios;
//! * `fg-rl-<kind>-<size>`: `floodgate.wasm` with `fg-rl`'s rule (no body callback);
//! * `llm-plain-<kind>-<size>`: `floodgate-llm.wasm` with the same rule: the callback, which
//!   returns at once;
//! * `llm-<kind>-<size>`: `floodgate-llm.wasm` with the token rule ([`token_config`]): each frame
//!   read, the count settled.
//!
//! and `llm-plain`: `floodgate-llm.wasm` with `fg-rl`'s rule on `fg-rl`'s traffic (`GET /`, 12
//! bytes).

use crate::envoy::{Filter, Route};
use crate::load::{self, UpstreamCount};
use crate::table::{count, Table};
use crate::variant::{self, Variant};
use crate::Settings;
use bytes::Bytes;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

/// What an LLM variant's upstream answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// One JSON document, usage at the end.
    Json,
    /// A server-sent-event stream, usage in the last event.
    Sse,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Json => "json",
            Kind::Sse => "sse",
        }
    }
}

/// The answer sizes: about 1 KiB and about 1 MiB.
pub const SIZES: [(&str, usize); 2] = [("1k", 1 << 10), ("1m", 1 << 20)];

/// The bytes of one content event of a stream (OpenAI-compatible `chat.completion.chunk`s are
/// 150 to 250 bytes with one token of content each; this one is the smallest such event with
/// the fields a client reads).
pub const EVENT_BYTES: usize = 194;

/// A JSON answer's frame size: Envoy's default HTTP/2 `SETTINGS_MAX_FRAME_SIZE`.
const JSON_FRAME: usize = 16 << 10;

/// The kind and size of answer a variant's traffic asks for (from its id, `…-json-1m`), if it is
/// an LLM variant with its own traffic.
pub fn answer_of(variant: &Variant) -> Option<(Kind, usize)> {
    let (rest, size) = variant.id.rsplit_once('-')?;
    let size = SIZES.iter().find(|(name, _)| *name == size)?.1;
    let kind = match rest.rsplit_once('-').map_or(rest, |(_, k)| k) {
        "json" => Kind::Json,
        "sse" => Kind::Sse,
        _ => return None,
    };
    Some((kind, size))
}

/// The `none-…` variant with the same traffic as `variant`.
pub fn base_of(variant: &Variant) -> Option<&'static str> {
    let (kind, size) = answer_of(variant)?;
    let size = SIZES.iter().find(|s| s.1 == size)?.0;
    Some(leak(format!("none-{}-{size}", kind.name())))
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

/// The token-quota rule: `fg-rl`'s key, a limit no run reaches, the cost read from the answer's
/// `usage.total_tokens` after reserving the request's `x-max-tokens` (the load sends 256). The
/// bound on the bytes read is above the largest answer.
pub fn token_config() -> String {
    r#"{"rate_limits": [{"name": "tokens", "key": [{"header": "x-api-key"}], "limit": 1000000000, "window": "1m",
        "cost": {"from": "response_body", "path": "usage.total_tokens", "max_body_bytes": 4194304,
                 "estimate": {"header": "x-max-tokens", "default": 100, "max": 4096}}}]}"#
        .into()
}

/// The LLM variants (see the module's documentation).
pub fn variants(s: &Settings) -> Vec<Variant> {
    let plain = format!(r#"{{"rate_limits": [{}]}}"#, variant::rule("per-key"));
    let fg = || Filter::Wasm { module: s.floodgate_wasm.clone(), config: plain.clone() };
    let llm = |config: String| Filter::Wasm { module: s.llm_wasm.clone(), config };
    let mut v = vec![Variant {
        id: "llm-plain",
        label: "floodgate-llm.wasm: fg-rl's rule (the body callback returns at once)".into(),
        filter: llm(plain.clone()),
        route: Route::Fixed,
    }];
    for kind in [Kind::Json, Kind::Sse] {
        for (size_name, size) in SIZES {
            let what = match kind {
                Kind::Json => format!("{} B JSON answer", body(kind, size).iter().map(Bytes::len).sum::<usize>()),
                Kind::Sse => format!("{}-event stream", events(size)),
            };
            let id = |prefix: &str| leak(format!("{prefix}-{}-{size_name}", kind.name()));
            v.push(Variant { id: id("none"), label: format!("{what}, no filter"), filter: Filter::None, route: Route::Fixed });
            v.push(Variant { id: id("fg-rl"), label: format!("{what}, floodgate.wasm: fg-rl's rule"), filter: fg(), route: Route::Fixed });
            v.push(Variant { id: id("llm-plain"), label: format!("{what}, floodgate-llm.wasm: fg-rl's rule"), filter: llm(plain.clone()), route: Route::Fixed });
            v.push(Variant { id: id("llm"), label: format!("{what}, floodgate-llm.wasm: the token rule"), filter: llm(token_config()), route: Route::Fixed });
        }
    }
    v
}

/// Content events in a stream of about `size` bytes.
fn events(size: usize) -> usize {
    (size.saturating_sub(2 * EVENT_BYTES) / EVENT_BYTES).max(1)
}

/// The usage object of an answer with `completion` tokens.
fn usage(completion: usize) -> String {
    format!(r#"{{"prompt_tokens":50,"completion_tokens":{completion},"total_tokens":{}}}"#, completion + 50)
}

/// One content event of [`EVENT_BYTES`] bytes.
fn content_event() -> String {
    let head = r#"data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","created":1764000000,"model":"bench-model","choices":[{"index":0,"delta":{"content":""#;
    let tail = "\"},\"finish_reason\":null}],\"usage\":null}\n\n";
    let word = " token";
    let pad = EVENT_BYTES.saturating_sub(head.len() + tail.len() + word.len());
    format!("{head}{word}{}{tail}", "s".repeat(pad))
}

/// The frames of an answer of `kind` of about `size` bytes.
pub fn body(kind: Kind, size: usize) -> Vec<Bytes> {
    match kind {
        Kind::Json => {
            let head = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1764000000,"model":"bench-model","choices":[{"index":0,"message":{"role":"assistant","content":""#;
            let middle = r#""},"finish_reason":"stop"}],"usage":"#;
            let fixed = head.len() + middle.len() + usage(size).len() + 1;
            let words = size.saturating_sub(fixed) / 6;
            let text = format!("{head}{}{middle}{}}}", " token".repeat(words), usage(words));
            text.as_bytes().chunks(JSON_FRAME).map(Bytes::copy_from_slice).collect()
        }
        Kind::Sse => {
            let n = events(size);
            let event = Bytes::from(content_event());
            let mut frames = vec![event; n];
            frames.push(Bytes::from(format!(
                "data: {{\"id\":\"chatcmpl-bench\",\"object\":\"chat.completion.chunk\",\"created\":1764000000,\"model\":\"bench-model\",\"choices\":[],\"usage\":{}}}\n\n",
                usage(n)
            )));
            frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
            frames
        }
    }
}

/// The requests of an LLM variant's traffic: `GET /v1/<kind>/<size>` with `x-api-key` cycling
/// over `keys` values and `x-max-tokens: 256`.
pub fn requests(prefix: &str, keys: usize, kind: Kind, size: usize) -> Arc<Vec<Vec<u8>>> {
    let path = format!("/v1/{}/{size}", kind.name());
    Arc::new((0..keys).map(|i| load::request(&path, &[("x-api-key", format!("{prefix}{i}")), ("x-max-tokens", "256".into())])).collect())
}

/// The answers served so far, by kind and size (each built once).
type Bodies = Arc<Mutex<HashMap<(Kind, usize), Arc<Vec<Bytes>>>>>;

/// Starts the OpenAI-like upstream (HTTP/2 without TLS) on `127.0.0.1:<ephemeral>`; it runs until
/// the runtime stops.
pub async fn start_upstream() -> SocketAddr {
    let bodies: Bodies = Arc::default();
    load::serve_on_loopback(move |stream, served| serve(stream, served, Arc::clone(&bodies))).await.0
}

async fn serve(stream: tokio::net::TcpStream, served: Arc<UpstreamCount>, bodies: Bodies) {
    let Ok(mut conn) = h2::server::handshake(stream).await else { return };
    while let Some(Ok((request, respond))) = conn.accept().await {
        let frames = parse_path(request.uri().path()).map(|key| {
            let mut bodies = bodies.lock().expect("bodies");
            Arc::clone(bodies.entry(key).or_insert_with(|| Arc::new(body(key.0, key.1))))
        });
        tokio::spawn(answer(frames, respond, Arc::clone(&served)));
    }
}

/// `/v1/<kind>/<size>`.
fn parse_path(path: &str) -> Option<(Kind, usize)> {
    let mut parts = path.strip_prefix("/v1/")?.split('/');
    let kind = match parts.next()? {
        "json" => Kind::Json,
        "sse" => Kind::Sse,
        _ => return None,
    };
    let size = parts.next()?.parse().ok().filter(|s| *s <= 64 << 20)?;
    Some((kind, size))
}

async fn answer(frames: Option<Arc<Vec<Bytes>>>, mut respond: h2::server::SendResponse<Bytes>, served: Arc<UpstreamCount>) -> Result<(), h2::Error> {
    let Some(frames) = frames else {
        let response = http::Response::builder().status(404).header("content-length", "0").body(()).expect("a response head");
        respond.send_response(response, true)?;
        return Ok(());
    };
    let kind = if frames.first().is_some_and(|f| f.starts_with(b"data:")) { "text/event-stream" } else { "application/json" };
    let length: usize = frames.iter().map(Bytes::len).sum();
    let response = http::Response::builder()
        .status(200)
        .header("content-type", kind)
        .header("content-length", length.to_string())
        .body(())
        .expect("a response head");
    let mut send = respond.send_response(response, false)?;
    let last = frames.len().saturating_sub(1);
    for (i, frame) in frames.iter().enumerate() {
        send.send_data(frame.clone(), i == last)?;
    }
    served.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// A line through two points: instructions per request at answers of `b1` and `b2` bytes. Its
/// intercept (instructions per request at an empty answer) and slope (per MiB).
fn line((b1, i1): (usize, f64), (b2, i2): (usize, f64)) -> (f64, f64) {
    let per_byte = (i2 - i1) / (b2 as f64 - b1 as f64);
    (i1 - per_byte * b1 as f64, per_byte * f64::from(1u32 << 20))
}

/// The tables of the LLM variants measured in `results` (variant, instructions per request,
/// requests): each configuration's cost per request and per MiB of answer from its two sizes,
/// and what each step adds.
pub fn report(results: &[(Variant, f64, u64)]) {
    let of = |id: &str| results.iter().find(|(v, _, _)| v.id == id).map(|r| r.1);
    let bytes = |kind: Kind, size: usize| body(kind, size).iter().map(Bytes::len).sum::<usize>();
    let fit = |prefix: &str, kind: Kind| -> Option<(f64, f64)> {
        let [(small, s1), (large, s2)] = SIZES;
        let i1 = of(&format!("{prefix}-{}-{small}", kind.name()))?;
        let i2 = of(&format!("{prefix}-{}-{large}", kind.name()))?;
        Some(line((bytes(kind, s1), i1), (bytes(kind, s2), i2)))
    };
    let configs = [("none", "no filter"), ("fg-rl", "floodgate.wasm, fg-rl's rule"), ("llm-plain", "floodgate-llm.wasm, fg-rl's rule"), ("llm", "floodgate-llm.wasm, the token rule")];
    let mut t = Table::new(&["answer", "configuration", "per request (intercept)", "per MiB of answer (slope)"]);
    let mut any = false;
    for kind in [Kind::Json, Kind::Sse] {
        for (prefix, what) in configs {
            if let Some((intercept, slope)) = fit(prefix, kind) {
                any = true;
                t.row(vec![kind.name().to_uppercase(), format!("`{prefix}-{}-*`, {what}", kind.name()), count(intercept.max(0.0) as u64), count(slope.max(0.0) as u64)]);
            }
        }
    }
    if !any {
        return;
    }
    let sizes = [Kind::Json, Kind::Sse].map(|k| format!("{} {} and {} B", k.name().to_uppercase(), bytes(k, SIZES[0].1), bytes(k, SIZES[1].1)));
    println!(
        "LLM answers, each configuration's line through its two sizes ({}; a stream of {} and {} events of {EVENT_BYTES} B, one frame each; JSON in 16 KiB frames):\n\n{}\n",
        sizes.join(", "),
        events(SIZES[0].1),
        events(SIZES[1].1),
        t.render()
    );
    let mut t = Table::new(&["answer", "what it adds", "per request", "per MiB", "per frame"]);
    let signed = |x: f64| format!("{:+}", x.round() as i64);
    if let (Some(fg), Some(llm)) = (of("fg-rl"), of("llm-plain")) {
        t.row(vec!["`GET /`, 12 B".into(), "the body callback, returning at once (`llm-plain` − `fg-rl`)".into(), signed(llm - fg), "".into(), "".into()]);
    }
    for kind in [Kind::Json, Kind::Sse] {
        let frames_per_mib = match kind {
            Kind::Json => f64::from(1u32 << 20) / JSON_FRAME as f64,
            Kind::Sse => f64::from(1u32 << 20) / EVENT_BYTES as f64,
        };
        for (hi, lo, what) in [
            ("llm-plain", "fg-rl", "the body callback, returning at once"),
            ("llm", "llm-plain", "reading the body and settling"),
            ("llm", "fg-rl", "both: the token rule in floodgate-llm.wasm over fg-rl's rule in floodgate.wasm"),
        ] {
            if let (Some((a1, s1)), Some((a0, s0))) = (fit(hi, kind), fit(lo, kind)) {
                t.row(vec![kind.name().to_uppercase(), format!("{what} (`{hi}` − `{lo}`)"), signed(a1 - a0), signed(s1 - s0), signed((s1 - s0) / frames_per_mib)]);
            }
        }
    }
    println!("What each step adds (differences of the lines above; per frame: the per-MiB figure over the frames in a MiB):\n\n{}\n", t.render());
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn text(frames: &[Bytes]) -> String {
        frames.iter().map(|f| String::from_utf8(f.to_vec()).unwrap()).collect()
    }

    #[test]
    fn answers_are_about_their_size_with_the_usage_where_a_model_puts_it() {
        for (_, size) in SIZES {
            let json = body(Kind::Json, size);
            let whole = text(&json);
            assert!(whole.len() <= size && whole.len() + 16 > size, "{} for {size}", whole.len());
            let value: serde_json::Value = serde_json::from_str(&whole).unwrap();
            assert!(value["usage"]["total_tokens"].as_u64().unwrap() > 50);
            assert!(whole.ends_with("}}"), "the usage is last");
            assert!(json.iter().all(|f| f.len() <= JSON_FRAME));

            let sse = body(Kind::Sse, size);
            let whole = text(&sse);
            assert!(whole.len() <= size + EVENT_BYTES && whole.len() + 2 * EVENT_BYTES > size, "{} for {size}", whole.len());
            assert_eq!(sse.len(), events(size) + 2, "one frame per event");
            assert_eq!(sse[0].len(), EVENT_BYTES);
            assert_eq!(content_event().len(), EVENT_BYTES);
            for frame in &sse[..sse.len() - 1] {
                let data: serde_json::Value = serde_json::from_str(text(std::slice::from_ref(frame)).strip_prefix("data: ").unwrap().trim_end()).unwrap();
                assert_eq!(data["object"], "chat.completion.chunk");
            }
            assert!(text(&sse[sse.len() - 2..sse.len() - 1]).contains(&format!("\"total_tokens\":{}", events(size) + 50)));
            assert_eq!(text(&sse[sse.len() - 1..]), "data: [DONE]\n\n");
        }
    }

    #[test]
    fn a_line_through_two_sizes_gives_the_cost_per_request_and_per_mib() {
        let (intercept, slope) = line((1024, 200_000.0 + 1024.0 * 97.0), (1 << 20, 200_000.0 + f64::from(1u32 << 20) * 97.0));
        assert!((intercept - 200_000.0).abs() < 1e-6, "{intercept}");
        assert!((slope - 97.0 * f64::from(1u32 << 20)).abs() < 1e-3, "{slope}");
    }

    #[test]
    fn variant_ids_name_their_traffic_and_paths_parse_back() {
        let v = |id: &'static str| Variant { id, label: String::new(), filter: Filter::None, route: Route::Fixed };
        assert_eq!(answer_of(&v("llm-json-1k")), Some((Kind::Json, 1 << 10)));
        assert_eq!(answer_of(&v("llm-plain-sse-1m")), Some((Kind::Sse, 1 << 20)));
        assert_eq!(answer_of(&v("fg-rl")), None);
        assert_eq!(answer_of(&v("llm-plain")), None);
        assert_eq!(base_of(&v("fg-rl-sse-1m")), Some("none-sse-1m"));
        assert_eq!(parse_path("/v1/sse/1048576"), Some((Kind::Sse, 1 << 20)));
        assert_eq!(parse_path("/v1/xml/1"), None);
        assert_eq!(parse_path("/v1/json/99999999999"), None);
    }
}
