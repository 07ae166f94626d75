//! What settling a token quota from a response body costs, in instructions of the Envoy process
//! counted by valgrind's callgrind (deterministic, whatever the machine's load): one Envoy
//! (1 worker) loading `floodgate-llm.wasm` with two rules, `plain` (cost 1) on `/plain` and
//! `tokens` (`response_body`, with an estimate) on `/v1`, in front of [`LlmUpstream`]. The same
//! answers go through each route; the difference is the reading and the settlement:
//!
//! * per request: `/v1` minus `/plain`, small answers (a ~250-byte JSON body; a 5-event stream);
//! * per MiB of body: the same difference with ~1 MiB more of content, less the per-request
//!   part, per MiB that went through.
//!
//! A measurement (slow under valgrind: minutes, more on a loaded machine): `cargo test -p floodgate-integration
//! --test llm_cost -- --ignored --nocapture`. docs/llm.md gives its figures.

use std::io::Write;
use std::process::Command;
use std::time::Duration;

use bytes::Bytes;
use floodgate_integration::*;

const REQUESTS: u64 = 20;
const PAD: usize = 1 << 20;

fn totals(dir: &std::path::Path) -> u64 {
    let mut dumps: Vec<_> = std::fs::read_dir(dir)
        .expect("the dump directory")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("callgrind.out."))
        .filter_map(|e| Some((e.metadata().ok()?.modified().ok()?, e.path())))
        .collect();
    dumps.sort();
    let newest = dumps.pop().expect("a callgrind dump").1;
    let text = std::fs::read_to_string(newest).expect("a dump");
    text.lines()
        .find_map(|l| l.strip_prefix("totals:")?.split_whitespace().next()?.parse().ok())
        .expect("totals in the dump")
}

fn callgrind_control(pid: u32, what: &str) {
    let ok = Command::new("callgrind_control").arg(what).arg(pid.to_string()).output().is_ok_and(|o| o.status.success());
    assert!(ok, "callgrind_control {what} {pid}");
}

/// Instructions for `REQUESTS` requests to `path` in `mode` with `pad` bytes of padding, and the
/// body bytes per request.
async fn measure(envoy: &Envoy, dumps: &std::path::Path, path: &str, mode: &str, pad: usize) -> (u64, usize) {
    let mut client = Client::connect(envoy.addr()).await.expect("connect");
    let pad = pad.to_string();
    let headers = [("x-api-key", "k"), ("x-max-tokens", "1"), ("x-test-usage", "3"), ("x-test-mode", mode), ("x-test-pad", pad.as_str())];
    // Warm up the connection and the key.
    for _ in 0..3 {
        assert_eq!(client.send("POST", path, &headers, Bytes::from_static(b"{}")).await.expect("response").status, 200);
    }
    callgrind_control(envoy.pid(), "-z");
    let mut bytes = 0;
    for _ in 0..REQUESTS {
        let response = client.send("POST", path, &headers, Bytes::from_static(b"{}")).await.expect("response");
        assert_eq!(response.status, 200);
        bytes = response.body.len();
    }
    callgrind_control(envoy.pid(), "-d");
    tokio::time::sleep(Duration::from_millis(500)).await;
    (totals(dumps), bytes)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement under valgrind (minutes): run it with --ignored"]
async fn settling_from_a_body_costs_so_many_instructions() {
    let dumps = tempfile::tempdir().expect("a directory");
    let wrapper = dumps.path().join("envoy-under-callgrind");
    {
        let mut file = std::fs::File::create(&wrapper).expect("the wrapper");
        let out = dumps.path().join("callgrind.out.%p");
        writeln!(
            file,
            "#!/bin/sh\nexec valgrind --tool=callgrind --smc-check=all-non-file --callgrind-out-file={} {} \"$@\"",
            out.display(),
            envoy_binary().display()
        )
        .expect("write the wrapper");
    }
    assert!(Command::new("chmod").arg("+x").arg(&wrapper).status().is_ok_and(|s| s.success()));
    std::env::set_var("ENVOY_BIN", &wrapper);
    if std::env::var_os("FLOODGATE_ENVOY_START_TIMEOUT_S").is_none() {
        std::env::set_var("FLOODGATE_ENVOY_START_TIMEOUT_S", "900");
    }
    let upstream = LlmUpstream::start();
    let config = json!({"rate_limits": [
        {"name": "plain", "key": [{"header": "x-api-key"}], "limit": 4_000_000_000u32, "window": "1h", "match": {"path": {"prefix": "/plain"}}},
        {"name": "tokens", "key": [{"header": "x-api-key"}], "limit": 4_000_000_000u32, "window": "1h", "match": {"path": {"prefix": "/v1"}},
         "cost": {"from": "response_body", "path": "usage.total_tokens", "max_body_bytes": 67_108_864,
                  "estimate": {"header": "x-max-tokens", "default": 1, "max": 1}}}
    ]});
    let envoy = Envoy::builder(config).module(llm_wasm_module()).upstream_at(upstream.addr()).concurrency(1).start();
    let mut rows = Vec::new();
    for mode in ["json", "sse"] {
        let (plain_small, small_bytes) = measure(&envoy, dumps.path(), "/plain", mode, 0).await;
        let (tokens_small, _) = measure(&envoy, dumps.path(), "/v1/chat/completions", mode, 0).await;
        let (plain_big, big_bytes) = measure(&envoy, dumps.path(), "/plain", mode, PAD).await;
        let (tokens_big, _) = measure(&envoy, dumps.path(), "/v1/chat/completions", mode, PAD).await;
        let per_request = tokens_small.saturating_sub(plain_small) / REQUESTS;
        let big_extra = tokens_big.saturating_sub(plain_big) / REQUESTS;
        let mib = (big_bytes - small_bytes) as f64 / f64::from(1u32 << 20);
        let per_mib = (big_extra.saturating_sub(per_request)) as f64 / mib;
        println!(
            "{mode}: {small_bytes} B answers: /plain {} /v1 {} instructions per request: settling costs {per_request}; \
             {big_bytes} B answers: {} more per request, {per_mib:.0} per MiB",
            plain_small / REQUESTS,
            tokens_small / REQUESTS,
            big_extra
        );
        rows.push((mode, per_request, per_mib));
    }
    assert_eq!(envoy.stat(&rule_stat("tokens", "unreported")), Some(0), "every answer was settled from its count");
    for (mode, per_request, per_mib) in rows {
        assert!(per_request < 200_000, "{mode}: {per_request} instructions per request");
        assert!(per_mib < 200_000_000.0, "{mode}: {per_mib} instructions per MiB");
    }
}
