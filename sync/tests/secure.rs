//! The store path secured, against real `redis-server` processes: the proxies' bearer token
//! (`--token`: a call without it is refused with 401, with another one with 403, and nothing
//! reaches Redis), and Redis over TLS (`rediss://`, the test's own CA, a client certificate)
//! with an ACL user, through a Redis restart.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

mod common;

use std::time::Duration;

use common::tls::Pki;
use common::*;
use serde_json::{json, Value};

const OLD: &str = "old-fleet-token-0123456789";
const NEW: &str = "new-fleet-token-9876543210";
const PROXY: &str = "0123456789abcdef";

/// `POST path` with a JSON body and, if any, an `authorization` header.
fn call(port: u16, path: &str, authorization: Option<&str>, body: &Value) -> Answer {
    let mut headers = vec![("content-type", "application/json")];
    if let Some(value) = authorization {
        headers.push(("authorization", value));
    }
    request_with(port, "POST", path, &headers, serde_json::to_vec(body).unwrap(), false)
}

fn lease_body(key: &str, bucket: u64) -> Value {
    json!({"version": 1, "leases": [
        {"key": key, "window_ms": 60_000, "bucket": bucket, "elapsed_ms": 0, "limit": 100, "want": 5}
    ]})
}

#[test]
fn calls_without_the_right_token_are_refused_counted_and_write_nothing() {
    let redis = Redis::start(free_ports(1, false)[0], false);
    // Two tokens at once (a rotation), from the environment.
    let sync = Sync::start_with_env(
        &["--redis", &redis.url(), "--redis-timeout", "500ms"],
        &[("FLOODGATE_SYNC_TOKEN", &format!("{OLD},{NEW}"))],
    );
    let key = key_in_shard(1, 0);
    let bucket = now_ms() / 60_000;
    let mut seq = 1;
    let batch_body = |seq: u64| batch(PROXY, seq, &[(&key, 60_000, bucket, 5)]);
    let wrong = format!("Bearer {}", OLD.replace('0', "1"));
    let mut refusals = Vec::new();
    for (path, body) in [("/v1/sync", batch_body(seq)), ("/v1/lease", lease_body(&key, bucket))] {
        for authorization in [None, Some(OLD.to_string()), Some(format!("Basic {OLD}")), Some(wrong.clone()), Some(format!("Bearer {OLD}x"))] {
            let answer = call(sync.port, path, authorization.as_deref(), &body);
            refusals.push((path, authorization.clone(), answer.status));
            assert!(answer.json()["error"].as_str().unwrap().starts_with("authorization: "), "{}", answer.body);
            assert_eq!(redis.dbsize(), 0, "{path} with {authorization:?} wrote to Redis");
        }
    }
    let statuses: Vec<u16> = refusals.iter().map(|r| r.2).collect();
    assert_eq!(statuses, [401, 401, 401, 403, 403, 401, 401, 401, 403, 403], "{refusals:?}");
    let metrics = get(sync.port, "/metrics");
    assert_eq!(metrics.status, 200, "/metrics needs no token");
    assert_eq!(metric(&metrics.body, "floodgate_sync_errors_total{status=\"401\",kind=\"unauthorized\"}"), 6);
    assert_eq!(metric(&metrics.body, "floodgate_sync_errors_total{status=\"403\",kind=\"forbidden\"}"), 4);
    assert_eq!(metric(&metrics.body, "floodgate_sync_batches_received_total"), 0);
    assert_eq!(metric(&metrics.body, "floodgate_sync_leases_received_total"), 0);
    assert_eq!(get(sync.port, "/healthz").status, 200);
    assert_eq!(get(sync.port, "/readyz").status, 200);

    // Either token of the rotation is accepted.
    let old = call(sync.port, "/v1/sync", Some(&format!("Bearer {OLD}")), &batch_body(seq));
    assert_eq!(old.totals(), [(0, 5)]);
    seq += 1;
    let new = call(sync.port, "/v1/sync", Some(&format!("bearer {NEW}")), &batch_body(seq));
    assert_eq!(new.totals(), [(0, 10)]);
    let lease = call(sync.port, "/v1/lease", Some(&format!("Bearer {NEW}")), &lease_body(&key, bucket));
    assert_eq!(lease.status, 200, "{}", lease.body);
    assert_eq!(lease.json()["leases"][0]["current"], 10 + 5);
    assert_eq!(redis.get(&format!("fg:{{1}}:{key}:60000:{bucket}")), Some(15));
    let log = sync.log();
    assert!(log.contains("calls need a bearer token (2 accepted)"), "{log}");
    assert!(!log.contains(OLD) && !log.contains(NEW), "the log shows no token:\n{log}");
    println!("refused: {refusals:?}");
}

#[test]
fn without_a_token_calls_are_open_and_the_log_says_so() {
    let redis = Redis::start(free_ports(1, false)[0], false);
    let sync = Sync::start(&["--redis", &redis.url()]);
    let key = key_in_shard(2, 0);
    let answer = call(sync.port, "/v1/sync", None, &batch(PROXY, 1, &[(&key, 60_000, now_ms() / 60_000, 3)]));
    assert_eq!(answer.totals(), [(0, 3)]);
    assert!(sync.log().contains("no --token: POST /v1/sync, POST /v1/lease and GET /v1/holders accept any caller"), "{}", sync.log());
}

/// A TLS-only `redis-server` requiring client certificates, with an ACL user for floodgate-sync
/// (keys under `fg:` only) and a password for the default user (the test's `redis-cli`).
fn tls_redis(pki: &Pki) -> Redis {
    let port = free_ports(1, false)[0];
    let mut args = pki.redis_args(port);
    args.extend(
        ["--requirepass", "admin-password-0", "--user", "floodgate", "on", ">sync-password-0", "~fg:*", "+@all", "-@dangerous"]
            .map(String::from),
    );
    let mut cli = pki.cli_args();
    cli.extend(["-a", "admin-password-0", "--no-auth-warning"].map(String::from));
    Redis::start_with(port, &args, &cli)
}

#[test]
fn redis_over_tls_with_an_acl_user_serves_batches_and_leases_through_a_restart() {
    let pki = Pki::new();
    let mut redis = tls_redis(&pki);
    let url = format!("rediss://floodgate:sync-password-0@127.0.0.1:{}", redis.port);
    let mut args = vec!["--redis".to_string(), url.clone(), "--redis-timeout".into(), "500ms".into()];
    args.extend(pki.sync_args());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let sync = Sync::start(&args);
    let log = sync.log();
    assert!(log.contains("TLS, CA of --redis-ca, client certificate"), "{log}");
    assert!(!log.contains("sync-password-0"), "the log shows no password:\n{log}");
    wait_until("ready over TLS", Duration::from_secs(10), || get(sync.port, "/readyz").status == 200);

    let key = key_in_shard(3, 0);
    let bucket = now_ms() / 60_000;
    let counter = format!("fg:{{3}}:{key}:60000:{bucket}");
    let answer = post(sync.port, &batch(PROXY, 1, &[(&key, 60_000, bucket, 4)]));
    assert_eq!(answer.totals(), [(0, 4)]);
    let lease = call(sync.port, "/v1/lease", None, &lease_body(&key, bucket));
    assert_eq!(lease.status, 200, "{}", lease.body);
    assert_eq!(redis.cli(&["GET", &counter]).unwrap(), (4 + 5).to_string());
    // The ACL user cannot touch keys outside fg:, the default user's password is not its own.
    assert!(redis.cli(&["ACL", "DRYRUN", "floodgate", "GET", "other"]).unwrap().contains("no permissions"));

    // A restart of Redis (empty: no persistence): 503 while it is down, then the same
    // connection settings reconnect over TLS by themselves.
    redis.kill();
    let down = post(sync.port, &batch(PROXY, 2, &[(&key, 60_000, bucket, 1)]));
    assert_eq!(down.status, 503, "{}", down.body);
    redis.restart();
    let mut back = None;
    wait_until("batches over TLS again", Duration::from_secs(10), || {
        let answer = post(sync.port, &batch(PROXY, 2, &[(&key, 60_000, bucket, 1)]));
        let ok = answer.status == 200;
        back = Some(answer);
        ok
    });
    assert_eq!(back.unwrap().totals(), [(0, 1)], "the restarted Redis starts from 0");
    assert_eq!(redis.cli(&["GET", &counter]).unwrap(), "1");
}

#[test]
fn redis_over_tls_refuses_a_wrong_password_an_unknown_ca_and_no_client_certificate() {
    let pki = Pki::new();
    let redis = tls_redis(&pki);
    let port = redis.port;
    let with_ca = |extra: &[&str]| {
        let mut args = vec!["--redis-ca".to_string(), pki.file("ca.pem")];
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let client = ["--redis-cert", &pki.file("client.pem"), "--redis-key", &pki.file("client.key")].map(String::from);
    for (what, url, extra) in [
        ("a wrong password", format!("rediss://floodgate:wrong-password@127.0.0.1:{port}"), {
            let mut a = with_ca(&[]);
            a.extend(client.clone());
            a
        }),
        ("no CA: the public roots do not know the test's CA", format!("rediss://floodgate:sync-password-0@127.0.0.1:{port}"), client.to_vec()),
        ("no client certificate", format!("rediss://floodgate:sync-password-0@127.0.0.1:{port}"), with_ca(&[])),
    ] {
        let mut args = vec!["--redis".to_string(), url, "--redis-timeout".into(), "500ms".into()];
        args.extend(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let sync = Sync::start(&args);
        assert_eq!(get(sync.port, "/readyz").status, 503, "{what}");
        let answer = post(sync.port, &batch(PROXY, 1, &[(&key_in_shard(4, 0), 60_000, 9, 1)]));
        assert_eq!(answer.status, 503, "{what}: {}", answer.body);
        println!("{what}: {}", answer.body);
    }
    assert_eq!(redis.cli(&["DBSIZE"]).unwrap(), "0");
    // A CA without rediss:// is refused at startup.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate-sync"))
        .args(["--redis", "redis://127.0.0.1:1", "--redis-ca", &pki.file("ca.pem"), "--listen", "127.0.0.1:0"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("need rediss:// URLs"));
}

/// A wrong CA (another CA than the one that signed Redis's certificate) and no proxy calling,
/// only readiness probes: the log says, within seconds, that TLS refused the server.
#[test]
fn a_wrong_ca_shows_in_the_log_from_readiness_probes_alone() {
    let pki = Pki::new();
    let other = Pki::new();
    let redis = tls_redis(&pki);
    let url = format!("rediss://floodgate:sync-password-0@127.0.0.1:{}", redis.port);
    let args = [
        "--redis".to_string(),
        url,
        "--redis-timeout".into(),
        "500ms".into(),
        "--redis-ca".into(),
        other.file("ca.pem"),
        "--redis-cert".into(),
        pki.file("client.pem"),
        "--redis-key".into(),
        pki.file("client.key"),
    ];
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let sync = Sync::start(&args);
    let started = std::time::Instant::now();
    let mut readiness = None;
    wait_until("a log line naming TLS", Duration::from_secs(10), || {
        readiness = Some(get(sync.port, "/readyz"));
        std::thread::sleep(Duration::from_millis(200));
        sync.log().lines().any(|line| line.contains("readiness") && line.contains("TLS"))
    });
    let log = sync.log();
    let line = log.lines().find(|line| line.contains("readiness") && line.contains("TLS")).unwrap();
    println!("after {:?}: {line}", started.elapsed());
    assert!(line.contains("invalid peer certificate") && line.contains("--redis-ca"), "{line}");
    let readiness = readiness.unwrap();
    assert_eq!(readiness.status, 503, "{}", readiness.body);
    // Rate-limited: probes several times a second, at most a line a second.
    for _ in 0..10 {
        get(sync.port, "/readyz");
    }
    let lines = sync.log().lines().filter(|line| line.contains("readiness (PING)")).count();
    assert!(lines <= 1 + started.elapsed().as_secs() as usize, "{lines} lines in {:?}", started.elapsed());
}
