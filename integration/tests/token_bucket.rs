//! Token-bucket rules, end to end: the built module in a real Envoy (2 workers) in front of a
//! real upstream that notes when each request arrives. Each test starts its own Envoy, so
//! shared data starts empty.
//!
//! Run with `--test-threads=1`: the tests measure timing.

use std::time::{Duration, Instant};

use floodgate_integration::*;

const KEY: &str = "bucket-key";

fn bucket(name: &str, extra: Value) -> Value {
    let mut rule = json!({"name": name, "key": [{"header": "x-api-key"}], "limit": 10, "window": "1s",
        "algorithm": "token_bucket", "burst": 5});
    if let (Some(rule), Some(extra)) = (rule.as_object_mut(), extra.as_object()) {
        rule.extend(extra.clone());
    }
    rule
}

fn header_u64(r: &Response, name: &str) -> u64 {
    r.header(name)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no integer `{name}`; headers: {:?}", r.headers))
}

/// `n` requests of `KEY` at once, each on its own connection (so both workers take some). The
/// connections are open before the first request goes, so the requests reach Envoy within a few
/// milliseconds of each other even on a loaded machine: connection setup is not part of the burst.
async fn burst_of(addr: std::net::SocketAddr, n: usize) -> Vec<(Response, Instant)> {
    let mut clients = Vec::with_capacity(n);
    for _ in 0..n {
        clients.push(Client::connect(addr).await.unwrap_or_else(|e| panic!("connect {addr}: {e}")));
    }
    let tasks: Vec<_> = clients
        .into_iter()
        .map(|mut client| {
            tokio::spawn(async move {
                let response = client.get("/", &[("x-api-key", KEY)]).await.expect("request");
                (response, Instant::now())
            })
        })
        .collect();
    let mut answers = Vec::with_capacity(n);
    for task in tasks {
        answers.push(task.await.expect("request task"));
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_burst_goes_at_once_then_the_rate_holds_across_workers() {
    let upstream = Upstream::counting_header("x-api-key");
    let envoy = Envoy::builder(json!({"rate_limits": [bucket("tb", json!({}))], "ratelimit_headers": "always"}))
        .upstream(&upstream)
        .start();
    let answers = burst_of(envoy.addr(), 40).await;
    let admitted = answers.iter().filter(|(r, _)| r.status == 200).count();
    let refused = answers.iter().filter(|(r, _)| r.status == 429).count();
    let per_worker = envoy.connections_per_worker();
    println!("40 at once: {admitted} admitted, {refused} refused; connections per worker {per_worker:?}");
    assert_eq!((admitted, refused), (5, 35));
    assert!(per_worker.len() >= 2 && per_worker.iter().all(|&c| c > 0), "both workers took requests: {per_worker:?}");
    let (admitted_fields, _) = answers.iter().find(|(r, _)| r.status == 200).expect("an admitted one");
    let (name, policy) = parse_ratelimit_item(admitted_fields.header("ratelimit-policy").expect("ratelimit-policy"));
    assert_eq!((name.as_str(), policy["q"].as_str(), policy["w"].as_str()), ("tb", "5", "1"));

    // Then 10 per second: a request every 20 ms from two connections for 5 s.
    let mut clients = [Client::connect(envoy.addr()).await.expect("connect"), Client::connect(envoy.addr()).await.expect("connect")];
    let start = Instant::now();
    let mut per_second = [0u64; 5];
    // Every admission, a last one answered after the 5 s included.
    let mut admitted_after = 0u64;
    let mut sent = 0u32;
    while start.elapsed() < Duration::from_secs(5) {
        let at = start + Duration::from_millis(20) * sent;
        tokio::time::sleep_until(at.into()).await;
        let client = &mut clients[(sent % 2) as usize];
        let response = client.get("/", &[("x-api-key", KEY)]).await.expect("request");
        let second = start.elapsed().as_secs() as usize;
        if response.status == 200 {
            admitted_after += 1;
            if let Some(count) = per_second.get_mut(second) {
                *count += 1;
            }
        }
        sent += 1;
    }
    println!("admitted per second after the burst: {per_second:?} ({sent} sent)");
    for (second, count) in per_second.iter().enumerate() {
        assert!((9..=11).contains(count), "second {second}: {count} admitted, expected 10 ± 1: {per_second:?}");
    }
    let total: u64 = per_second.iter().sum();
    assert!((49..=51).contains(&total), "{total} admitted in 5 s");
    assert!(admitted_after - total <= 1, "{admitted_after} admitted, {total} of them within 5 s");
    assert_eq!(upstream.count_for(KEY), 5 + admitted_after);
    let allowed = envoy.wait_for_stat(&rule_stat("tb", "allowed"), 5 + admitted_after, Duration::from_secs(5));
    assert_eq!(allowed, Some(5 + admitted_after));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_tight() {
    // One unit every 3 s, a bucket of 2.
    let rule = json!({"name": "slow", "key": [{"header": "x-api-key"}], "limit": 1, "window": "3s",
        "algorithm": "token_bucket", "burst": 2});
    let upstream = Upstream::counting_header("x-api-key");
    let envoy = Envoy::builder(json!({"rate_limits": [rule]})).upstream(&upstream).start();
    let mut client = Client::connect(envoy.addr()).await.expect("connect");
    for i in 0..2 {
        let r = client.get("/", &[("x-api-key", KEY)]).await.expect("request");
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
    }
    let refused = client.get("/", &[("x-api-key", KEY)]).await.expect("request");
    let refused_at = Instant::now();
    assert_eq!(refused.status, 429, "{}", refused.text());
    let retry_after = header_u64(&refused, "retry-after");
    let body = refused.json();
    let retry_after_ms = body["retry_after_ms"].as_u64().expect("retry_after_ms");
    println!("refused: retry-after {retry_after} s, retry_after_ms {retry_after_ms}; {body}");
    assert!((2900..=3000).contains(&retry_after_ms), "the next unit in 3 s: {retry_after_ms}");
    assert_eq!(retry_after, retry_after_ms.div_ceil(1000));
    assert_eq!((body["algorithm"].as_str(), body["burst"].as_u64(), body["limit"].as_u64()), (Some("token_bucket"), Some(2), Some(1)));
    let (_, policy) = parse_ratelimit_item(refused.header("ratelimit-policy").expect("ratelimit-policy"));
    assert_eq!((policy["q"].as_str(), policy["w"].as_str()), ("2", "6"), "q = burst, w = burst / rate");
    let (_, fields) = parse_ratelimit_item(refused.header("ratelimit").expect("ratelimit"));
    assert_eq!((fields["r"].as_str(), fields["t"].parse::<u64>().ok()), ("0", Some(retry_after)));
    // gRPC: the same refusal as RESOURCE_EXHAUSTED.
    let grpc = client.get("/", &[("x-api-key", KEY), ("content-type", "application/grpc")]).await.expect("request");
    assert_eq!(grpc.header("grpc-status"), Some("8"), "{:?}", grpc.headers);

    let retry = Duration::from_secs(retry_after);
    tokio::time::sleep_until((refused_at + retry - Duration::from_secs(1)).into()).await;
    let early = client.get("/", &[("x-api-key", KEY)]).await.expect("request");
    println!("at retry-after − 1 s: {}", early.status);
    assert_eq!(early.status, 429, "one second before retry-after must still be refused");
    tokio::time::sleep_until((refused_at + retry).into()).await;
    let on_time = client.get("/", &[("x-api-key", KEY)]).await.expect("request");
    println!("at retry-after: {}", on_time.status);
    assert_eq!(on_time.status, 200, "at retry-after must be admitted: {}", on_time.text());
    assert_eq!(upstream.count_for(KEY), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_over_the_rate_wait_for_their_turn_and_reach_the_upstream_at_the_rate() {
    let upstream = Upstream::counting_header("x-api-key");
    let envoy = Envoy::builder(json!({"rate_limits": [bucket("smooth", json!({"max_delay": "3s"}))]}))
        .upstream(&upstream)
        .start();
    let sent_at = Instant::now();
    let answers = burst_of(envoy.addr(), 30).await;
    let statuses: Vec<u16> = answers.iter().map(|(r, _)| r.status).collect();
    assert!(statuses.iter().all(|&s| s == 200), "none refused: {statuses:?}");
    let arrivals = upstream.arrivals();
    assert_eq!(arrivals.len(), 30);
    let offsets: Vec<u64> = arrivals.iter().map(|a| a.saturating_duration_since(sent_at).as_millis() as u64).collect();
    println!("upstream arrivals (ms after sending): {offsets:?}");
    let first = arrivals[0];
    // The burst at once, then one every 100 ms: the k-th request (k ≥ 5) not before
    // (k − 4) × 100 ms after the burst was decided (a few ms of clock reading slack), which is
    // after it was sent and before the first request reached the upstream, and never more than
    // 5 + 10 in any second.
    assert!(offsets[4] < offsets[0] + 90, "the burst goes at once: {offsets:?}");
    for (k, at) in arrivals.iter().enumerate().skip(5) {
        let after = at.saturating_duration_since(first).as_millis() as u64;
        let since_sent = offsets[k];
        let turn = (k as u64 - 4) * 100;
        assert!(since_sent + 5 >= turn, "request {k} reached the upstream {since_sent} ms after the burst was sent, before its turn at {turn} ms");
        assert!(after <= turn + 150, "request {k} went {after} ms after the first, long after its turn at {turn} ms");
    }
    for (i, start) in arrivals.iter().enumerate() {
        let within = arrivals[i..].iter().take_while(|a| a.saturating_duration_since(*start) < Duration::from_secs(1)).count();
        assert!(within <= 15, "{within} requests within a second from request {i}: {offsets:?}");
    }
    let spacing: Vec<u64> = arrivals.windows(2).skip(4).map(|w| w[1].saturating_duration_since(w[0]).as_millis() as u64).collect();
    println!("spacing after the burst (ms): {spacing:?}");
    assert_eq!(envoy.wait_for_stat(&rule_stat("smooth", "delayed"), 25, Duration::from_secs(5)), Some(25));
    assert_eq!(envoy.stat(&rule_stat("smooth", "rejected")), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_turn_is_past_max_delay_is_refused_at_once_with_a_truthful_retry_after() {
    let upstream = Upstream::counting_header("x-api-key");
    let envoy = Envoy::builder(json!({"rate_limits": [bucket("short", json!({"max_delay": "500ms"}))]}))
        .upstream(&upstream)
        .start();
    let answers = burst_of(envoy.addr(), 30).await;
    let sent_at = answers.iter().map(|(_, at)| *at).min().expect("answers");
    let admitted: Vec<Instant> = answers.iter().filter(|(r, _)| r.status == 200).map(|(_, at)| *at).collect();
    let refused: Vec<&(Response, Instant)> = answers.iter().filter(|(r, _)| r.status == 429).collect();
    let last_admitted = admitted.iter().max().copied().expect("admitted ones");
    let mut latest_refusal = sent_at;
    for (r, at) in &refused {
        // At once: the last admitted request waited for its turn about 500 ms after the burst;
        // a refusal that waited for anything would come about as late.
        assert!(*at + Duration::from_millis(250) <= last_admitted, "refused at once, not after a wait: {:?} after the first answer, the last admitted after {:?}", at.saturating_duration_since(sent_at), last_admitted.saturating_duration_since(sent_at));
        assert_eq!(header_u64(r, "retry-after"), 1);
        let ms = r.json()["retry_after_ms"].as_u64().expect("retry_after_ms");
        assert!(ms <= 100, "let in to wait once the sixth slot is 500 ms away: {ms}");
        latest_refusal = latest_refusal.max(*at);
    }
    // 5 at once and 5 waiting for turns 100 to 500 ms away; one more for each 100 ms (a token)
    // the burst's decisions took to span, which the answers given at once bound.
    let spread = latest_refusal.saturating_duration_since(sent_at).as_millis() as usize;
    println!("30 at once, max_delay 500 ms: {} admitted, {} refused, answered at once within {spread} ms", admitted.len(), refused.len());
    assert_eq!(admitted.len() + refused.len(), 30);
    assert!((10..=10 + spread / 100).contains(&admitted.len()), "5 at once, 5 waiting, the rest refused: {} admitted, the burst decided within {spread} ms", admitted.len());
    // Truthful: at retry-after, the same request is let in (to wait for its turn).
    tokio::time::sleep_until((latest_refusal + Duration::from_secs(1)).into()).await;
    let later = get(envoy.addr(), "/", &[("x-api-key", KEY)]).await;
    assert_eq!(later.status, 200, "{}", later.text());
    assert_eq!(upstream.count_for(KEY), admitted.len() as u64 + 1);
    let rejected = refused.len() as u64;
    assert_eq!(envoy.wait_for_stat(&rule_stat("short", "rejected"), rejected, Duration::from_secs(5)), Some(rejected));
}

#[test]
fn bad_token_bucket_fields_are_refused_naming_the_field() {
    let schema: Value = serde_json::from_str(floodgate_cli::SCHEMA).expect("the schema is JSON");
    let validator = jsonschema::draft202012::new(&schema).expect("the schema compiles");
    let dir = tempfile::tempdir().expect("tempdir");
    let cases = [
        (json!({"algorithm": "token_bucket", "burst": 0}), "rate_limits[0].burst: "),
        (json!({"algorithm": "token_bucket"}), "rate_limits[0].burst: is required with \"algorithm\": \"token_bucket\""),
        (json!({"burst": 5}), "rate_limits[0].burst: needs \"algorithm\": \"token_bucket\""),
        (json!({"max_delay": "1s"}), "rate_limits[0].max_delay: needs \"algorithm\": \"token_bucket\""),
        (json!({"algorithm": "token_bucket", "burst": 5, "max_delay": "0s"}), "rate_limits[0].max_delay: "),
        (json!({"algorithm": "token_bucket", "burst": 5, "scope": "global"}), "rate_limits[0].scope: a token bucket holds in proxy scope only"),
    ];
    for (index, (extra, expected)) in cases.iter().enumerate() {
        let mut rule = json!({"name": "b", "key": ["path"], "limit": 10, "window": "1s"});
        if let (Some(rule), Some(extra)) = (rule.as_object_mut(), extra.as_object()) {
            rule.extend(extra.clone());
        }
        let mut config = json!({"rate_limits": [rule]});
        if extra["scope"] == "global" {
            config["global"] = json!({"cluster": "sync"});
        }
        // The module's parser, and `floodgate validate`, which runs it.
        let error = floodgate::config::Config::parse(config.to_string().as_bytes()).expect_err("refused").to_string();
        assert!(error.starts_with(expected), "{config}: {error}");
        let file = dir.path().join(format!("bad-{index}.json"));
        std::fs::write(&file, config.to_string()).expect("write");
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let code = floodgate_cli::run(&["validate".into(), file.display().to_string()], &mut out, &mut err);
        let err = String::from_utf8_lossy(&err);
        assert_eq!(code, 1, "{err}");
        assert!(err.contains(expected), "floodgate validate: {err}");
        // The schema.
        assert!(!validator.is_valid(&config), "the schema accepts {config}");
    }
    // And a module in Envoy logs the same words.
    let config = json!({"rate_limits": [{"name": "b", "key": ["path"], "limit": 10, "window": "1s", "max_delay": "1s"}]});
    let line = config_error_line(&Envoy::start_expecting_failure(config)).expect("an invalid configuration line");
    assert!(line.contains("rate_limits[0].max_delay: needs \"algorithm\": \"token_bucket\""), "{line}");
}
