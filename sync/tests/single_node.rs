//! floodgate-sync against one real `redis-server` (single-node mode): totals, exactly-once
//! batches, TTLs, refusals that write nothing, Redis and floodgate-sync restarts, the HTTP
//! versions, and the Redis commands a batch costs.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

mod common;

use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

const P1: &str = "0123456789abcdef";
const P2: &str = "fedcba9876543210";
const A: &str = "00000001aaaaaaaaaaaaaaaaaaaaaaaa"; // shard 1 of 16
const B: &str = "00000002bbbbbbbbbbbbbbbbbbbbbbbb"; // shard 2
const C: &str = "0000001fcccccccccccccccccccccccc"; // shard 15
const D: &str = "ffffff13dddddddddddddddddddddddd"; // shard 3

/// The current bucket of 1 s windows: counters of buckets long past expire at once
/// (PEXPIREAT (bucket + 2) * window_ms + 60000), so the tests count in the present.
fn present() -> u64 {
    now_ms() / 1000
}

/// The dedup period of windows up to 5 min (`fg:seen:600000:<generation>`: on a single node
/// one hash per period and generation for every shard, a field per proxy, `<proxy>:<shard>` for
/// a batch too large to go whole).
const PERIOD: u64 = 600_000;

/// The dedup hashes that hold `field` (generations of every period).
fn seen_hashes(redis: &Redis, field: &str) -> Vec<String> {
    redis
        .keys()
        .into_iter()
        .filter(|k| k.starts_with("fg:seen:"))
        .filter(|k| redis::cmd("HEXISTS").arg(k).arg(field).query::<bool>(&mut redis.conn()).unwrap())
        .collect()
}

/// The last seq kept under `field` (a proxy, or `<proxy>:<shard>`): in the newest generation
/// that has it.
fn last_seq(redis: &Redis, field: &str) -> Option<u64> {
    let mut hashes = seen_hashes(redis, field);
    hashes.sort_by_key(|k| k.rsplit(':').next().and_then(|g| g.parse::<u64>().ok()));
    hashes.iter().rev().find_map(|hash| {
        redis::cmd("HGET").arg(hash).arg(field).query::<Option<u64>>(&mut redis.conn()).unwrap()
    })
}

/// Writes `seq` as the last under `field`, `back` generations of 10 min before the current.
fn set_seq(redis: &Redis, field: &str, seq: &str, at: u64, back: u64) {
    let hash = format!("fg:seen:{PERIOD}:{}", generation_of(at) - back);
    let _: () = redis::cmd("HSET").arg(&hash).arg(field).arg(seq).query(&mut redis.conn()).unwrap();
}

/// The dedup generation of a batch part whose latest bucket starts at second `at` (windows up to
/// 5 min): the generation is the part's, not the clock's.
fn generation_of(at: u64) -> u64 {
    at * 1000 / PERIOD
}

fn single() -> (Redis, Sync) {
    let redis = Redis::start(free_ports(1, false)[0], false);
    let sync = Sync::start(&["--redis", &redis.url(), "--redis-timeout", "500ms"]);
    (redis, sync)
}

#[test]
fn totals_come_in_request_order_and_sum_across_proxies() {
    let t = present();
    let m = now_ms() / 60_000;
    let (redis, sync) = single();
    // Proxy 1: A twice in one bucket (summed), B in 60 s windows, C read only, D in bucket 0
    // (which has no previous bucket).
    let first = post(
        sync.port,
        &batch(
            P1,
            1,
            &[
                (A, 1000, t + 10, 3),
                (B, 60000, m, 2),
                (A, 1000, t + 10, 4),
                (C, 1000, t + 10, 0),
                (D, 1000, 0, 0),
            ],
        ),
    );
    assert_eq!(first.content_type.as_deref(), Some("application/json"));
    assert_eq!(first.totals(), vec![(0, 7), (0, 2), (0, 7), (0, 0), (0, 0)]);
    // Proxy 2 adds to A's bucket t+10 and t+11, the later one first: A/t+11's previous is
    // A/t+10 after this batch.
    let second = post(
        sync.port,
        &batch(P2, 1, &[(A, 1000, t + 11, 1), (A, 1000, t + 10, 5)]),
    );
    assert_eq!(second.totals(), vec![(12, 1), (0, 12)]);
    // Proxy 1 reads everything (delta 0, next seq): no script, only a read.
    let scripts = redis.command_calls("evalsha") + redis.command_calls("eval");
    let read = post(
        sync.port,
        &batch(
            P1,
            2,
            &[
                (C, 1000, t + 10, 0),
                (B, 60000, m + 1, 0),
                (A, 1000, t + 11, 0),
                (A, 1000, t + 10, 0),
            ],
        ),
    );
    assert_eq!(read.totals(), vec![(0, 0), (2, 0), (12, 1), (0, 12)]);
    assert_eq!(redis.command_calls("evalsha") + redis.command_calls("eval"), scripts);
    // Only counters with a delta exist (C and D were never written), plus the node's dedup hash
    // of the present (two if the test straddled the start of a generation), with fields of
    // shards 1, 2 and 15.
    let mut expected = vec![
        format!("fg:{{1}}:{A}:1000:{}", t + 10),
        format!("fg:{{1}}:{A}:1000:{}", t + 11),
        format!("fg:{{2}}:{B}:60000:{m}"),
    ];
    expected.sort();
    // Besides, the HyperLogLogs of the proxies per second (the fleet size).
    let (fleet, rest): (Vec<String>, Vec<String>) = redis.keys().into_iter().partition(|k| k.starts_with("fg:{fleet}:"));
    let (dedup, keys): (Vec<String>, Vec<String>) = rest.into_iter().partition(|k| k.contains(":seen:"));
    assert_eq!(keys, expected);
    assert!(!fleet.is_empty() && fleet.len() <= 3, "{fleet:?}");
    // One dedup hash of the present (two if the test straddled the start of a generation) holds
    // every shard's seqs: a batch goes whole, its field the proxy. A batch that only reads keeps
    // no seq (it has nothing to keep exactly once).
    assert!((1..=2).contains(&dedup.len()), "{dedup:?}");
    assert!(dedup.iter().all(|h| h.starts_with(&format!("fg:seen:{PERIOD}:"))), "{dedup:?}");
    for hash in &dedup {
        let mut fields: Vec<String> = redis::cmd("HKEYS").arg(hash).query(&mut redis.conn()).unwrap();
        fields.sort();
        assert!(fields.iter().all(|f| ["-", P1, P2].contains(&f.as_str())), "{fields:?}");
    }
    assert_eq!(last_seq(&redis, P1), Some(1));
    assert_eq!(last_seq(&redis, P2), Some(1));
    // An empty batch is fine and touches no counter.
    let empty = post(sync.port, &batch(P1, 3, &[]));
    assert_eq!(empty.totals(), vec![]);
    assert_eq!(last_seq(&redis, P1), Some(1));
}

/// Every sync answer gives the fleet size: the distinct proxies that sent a batch in the last 3
/// seconds, an empty batch included (an idle proxy calls in once a second).
#[test]
fn sync_answers_give_the_number_of_proxies_that_called_in_lately() {
    let t = present();
    let (_redis, sync) = single();
    assert_eq!(post(sync.port, &batch(P1, 1, &[(A, 1000, t + 5, 1)])).proxies, Some(1));
    assert_eq!(post(sync.port, &batch(P1, 2, &[])).proxies, Some(1), "the same proxy again");
    // A count answers for 200 ms: a new proxy is in the first count read after.
    let mut seen = Vec::new();
    for seq in 1..=3 {
        seen.push(post(sync.port, &batch(P2, seq, &[])).proxies);
        std::thread::sleep(std::time::Duration::from_millis(150));
    }
    assert!(seen.contains(&Some(2)) && seen.iter().all(|p| matches!(p, Some(1 | 2))), "{seen:?}");
    assert_eq!(seen.last(), Some(&Some(2)));
    let metrics = get(sync.port, "/metrics").body;
    assert_eq!(metric(&metrics, "floodgate_sync_proxies"), 2);
}

/// A thousand proxies calling in one after the other cost Redis one count per 200 ms, and every
/// one of them that called in the last 2 seconds is counted (all of them, unless a loaded machine
/// took longer to send them).
#[test]
fn many_proxies_calling_at_once_share_one_count() {
    let (redis, sync) = single();
    let started = std::time::Instant::now();
    let proxies: Vec<String> = (0..1000u64).map(|n| format!("{:016x}", n * 7_919 + 1)).collect();
    let answers: Vec<_> = proxies.iter().map(|p| (post(sync.port, &batch(p, 1, &[])), std::time::Instant::now())).collect();
    let periods = started.elapsed().as_millis() as u64 / 200 + 1;
    assert!(answers.iter().all(|(a, _)| a.status == 200));
    let pfadds = redis.command_calls("pfadd");
    eprintln!("1000 proxies in {} ms: {pfadds} PFADD", started.elapsed().as_millis());
    assert!(pfadds <= 1 + periods, "{pfadds} counts in {periods} periods");
    std::thread::sleep(std::time::Duration::from_millis(250));
    let asked = std::time::Instant::now();
    let last = post(sync.port, &batch(&proxies[0], 2, &[])).proxies.unwrap();
    let recent = answers.iter().filter(|(_, at)| asked.duration_since(*at) < std::time::Duration::from_secs(2)).count() as u64;
    // HyperLogLog's estimate at 1000 (0.81 % standard error).
    assert!(last * 100 >= recent * 97 && last <= 1030, "{last} proxies counted, {recent} called in the last 2 s");
}

#[test]
fn a_retried_batch_counts_once_and_an_older_seq_only_reads() {
    let t = present();
    let (redis, sync) = single();
    let body = batch(P1, 42, &[(A, 1000, t + 5, 10), (B, 1000, t + 5, 1)]);
    assert_eq!(post(sync.port, &body).totals(), vec![(0, 10), (0, 1)]);
    // The same (proxy, seq) again, e.g. after a lost answer: nothing is added.
    for _ in 0..3 {
        assert_eq!(post(sync.port, &body).totals(), vec![(0, 10), (0, 1)]);
    }
    // An older seq only reads, whatever its deltas.
    let older = post(
        sync.port,
        &batch(P1, 41, &[(A, 1000, t + 5, 100), (B, 1000, t + 6, 100)]),
    );
    assert_eq!(older.totals(), vec![(0, 10), (1, 0)]);
    assert_eq!(redis.get(&format!("fg:{{2}}:{B}:1000:{}", t + 6)), None);
    // Another proxy's seq 42 is its own.
    assert_eq!(
        post(sync.port, &batch(P2, 42, &[(A, 1000, t + 5, 1)])).totals(),
        vec![(0, 11)]
    );
    // A newer seq of proxy 1 counts again.
    assert_eq!(
        post(sync.port, &batch(P1, 43, &[(A, 1000, t + 5, 1)])).totals(),
        vec![(0, 12)]
    );
    let metrics = get(sync.port, "/metrics").body;
    assert_eq!(metric(&metrics, "floodgate_sync_batches_received_total"), 7);
    assert_eq!(metric(&metrics, "floodgate_sync_batches_applied_total"), 3);
    assert_eq!(
        metric(&metrics, "floodgate_sync_batches_deduplicated_total"),
        4
    );
}

/// The node keeps each proxy's last seq in a hash per generation of 10 minutes, read in the
/// current generation and then the previous one: a retry is found in either, an older seq only
/// reads, and a seq two generations back (its hash expired by then) is forgotten.
#[test]
fn the_dedup_hash_keeps_each_proxys_last_seq_for_one_to_two_periods() {
    let t = present();
    let (redis, sync) = single();
    // Proxy 1's seq 7 was applied in the previous generation: a retry of it only reads, an
    // older one too, the next is applied and goes into the current generation.
    set_seq(&redis, P1, "7", t + 5, 1);
    assert_eq!(post(sync.port, &batch(P1, 7, &[(A, 1000, t + 5, 10)])).totals(), vec![(0, 0)]);
    assert_eq!(post(sync.port, &batch(P1, 6, &[(A, 1000, t + 5, 10)])).totals(), vec![(0, 0)]);
    assert_eq!(post(sync.port, &batch(P1, 8, &[(A, 1000, t + 5, 3)])).totals(), vec![(0, 3)]);
    let current = format!("fg:seen:{PERIOD}:{}", generation_of(t + 5));
    let held: Option<u64> = redis::cmd("HGET").arg(&current).arg(P1).query(&mut redis.conn()).unwrap();
    assert_eq!(held, Some(8));
    assert_eq!(last_seq(&redis, P1), Some(8));
    // The same batch again counts nothing.
    assert_eq!(post(sync.port, &batch(P1, 8, &[(A, 1000, t + 5, 3)])).totals(), vec![(0, 3)]);
    // Proxy 2's seq 50, two generations back, is past the dedup's life: a lower seq is
    // applied (that hash would have expired; it is not read).
    set_seq(&redis, P2, "50", t + 5, 2);
    assert_eq!(post(sync.port, &batch(P2, 40, &[(A, 1000, t + 5, 1)])).totals(), vec![(0, 4)]);
    assert_eq!(last_seq(&redis, P2), Some(40));
    // One hash per generation, whatever the number of proxies; it expires at the end of the next
    // generation.
    for n in 0..30u64 {
        let proxy = format!("{:016x}", n + 100);
        assert_eq!(post(sync.port, &batch(&proxy, 1, &[(A, 1000, t + 5, 1)])).status, 200);
    }
    assert_eq!(redis.get(&format!("fg:{{1}}:{A}:1000:{}", t + 5)), Some(34));
    let generation = generation_of(t + 5);
    let hash = format!("fg:seen:{PERIOD}:{generation}");
    let fields: u64 = redis::cmd("HLEN").arg(&hash).query(&mut redis.conn()).unwrap();
    assert!(fields >= 32, "proxies 1 and 2 and the 30 others: {fields}");
    assert_eq!(redis.pexpiretime(&hash), ((generation + 2) * PERIOD) as i64);
    assert!(redis.keys().iter().filter(|k| k.starts_with("fg:seen:")).count() <= 3, "{:?}", redis.keys());
}

#[test]
fn refunds_give_back_once_never_below_zero_and_create_nothing() {
    let t = present();
    let (redis, sync) = single();
    let with_refund = |proxy: &str, seq: u64, counters: &[(&str, u64, u64, u64, u64)]| {
        let mut body = batch(proxy, seq, &counters.iter().map(|c| (c.0, c.1, c.2, c.3)).collect::<Vec<_>>());
        for (i, c) in counters.iter().enumerate() {
            body["counters"][i]["refund"] = json!(c.4);
        }
        body
    };
    // Two proxies reserve 100 each in A's bucket t+10.
    post(sync.port, &batch(P1, 1, &[(A, 1000, t + 10, 100)]));
    post(sync.port, &batch(P2, 1, &[(A, 1000, t + 10, 100)]));
    // Proxy 1 settles at 30 (gives 70 back) while reserving 100 more in the same counter:
    // added first, then given back.
    let settled = with_refund(P1, 2, &[(A, 1000, t + 10, 100, 70)]);
    assert_eq!(post(sync.port, &settled).totals(), vec![(0, 230)]);
    // Sent again (a lost answer): nothing is given back twice.
    for _ in 0..2 {
        assert_eq!(post(sync.port, &settled).totals(), vec![(0, 230)]);
    }
    // An older seq only reads, its give-backs too.
    assert_eq!(post(sync.port, &with_refund(P1, 1, &[(A, 1000, t + 10, 0, 200)])).totals(), vec![(0, 230)]);
    // A give-back larger than the counter stops at 0; the counter keeps its expiry.
    let expiry = redis.pexpiretime(&format!("fg:{{1}}:{A}:1000:{}", t + 10));
    assert_eq!(post(sync.port, &with_refund(P2, 2, &[(A, 1000, t + 10, 0, 1000)])).totals(), vec![(0, 0)]);
    assert_eq!(redis.get(&format!("fg:{{1}}:{A}:1000:{}", t + 10)), Some(0));
    assert_eq!(redis.pexpiretime(&format!("fg:{{1}}:{A}:1000:{}", t + 10)), expiry);
    // A give-back of a counter that does not exist creates nothing (B's bucket was never
    // written, or expired).
    assert_eq!(post(sync.port, &with_refund(P2, 3, &[(B, 1000, t + 10, 0, 5)])).totals(), vec![(0, 0)]);
    assert_eq!(redis.get(&format!("fg:{{2}}:{B}:1000:{}", t + 10)), None);
    // Out of range, like a delta: refused, nothing written.
    let refused = post(sync.port, &with_refund(P2, 4, &[(A, 1000, t + 10, 7, 2_147_483_648)]));
    assert_eq!(refused.status, 400);
    assert!(refused.body.contains("counters[0].refund"), "{}", refused.body);
    assert_eq!(redis.get(&format!("fg:{{1}}:{A}:1000:{}", t + 10)), Some(0));
}

#[test]
fn a_batch_applied_in_some_shards_completes_in_the_others_only() {
    let t = present();
    // A batch larger than a call goes in shard parts, one script call after the other, each
    // part's seq under `<proxy>:<shard>`. When the call of one failed, the retry must add the
    // others' deltas only: here shard 1's part took seq 7, shard 2's did not (a thousand reads
    // on shard 3 make the batch that large).
    let (redis, sync) = single();
    redis.set(&format!("fg:{{1}}:{A}:1000:{}", t + 5), "10");
    set_seq(&redis, &format!("{P1}:1"), "7", t + 5, 0);
    let reads: Vec<String> = (0..1000).map(|n| key_in_shard(3, n)).collect();
    let mut counters = vec![(A, 1000, t + 5, 10), (B, 1000, t + 5, 20)];
    counters.extend(reads.iter().map(|k| (k.as_str(), 1000, t + 5, 0)));
    let retry = batch(P1, 7, &counters);
    for _ in 0..2 {
        assert_eq!(post(sync.port, &retry).totals()[..2], [(0, 10), (0, 20)]);
    }
    assert_eq!(last_seq(&redis, &format!("{P1}:2")), Some(7));
    assert_eq!(last_seq(&redis, P1), None);
    // seq comparisons are exact for every u64, not as doubles: 2^64-1 > 2^64-2.
    let big = u64::MAX;
    set_seq(&redis, P1, &(big - 1).to_string(), t + 5, 0);
    assert_eq!(
        post(sync.port, &batch(P1, big, &[(A, 1000, t + 5, 1)])).totals(),
        vec![(0, 11)]
    );
    assert_eq!(
        post(sync.port, &batch(P1, big, &[(A, 1000, t + 5, 1)])).totals(),
        vec![(0, 11)]
    );
    assert_eq!(last_seq(&redis, P1), Some(big));
}

#[test]
fn counters_and_dedup_keys_expire_as_specified() {
    let (redis, sync) = single();
    let now = now_ms();
    let (w1, w2) = (60_000u64, 3_600_000u64);
    let (b1, b2) = (now / w1, now / w2);
    post(
        sync.port,
        &batch(P1, 1, &[(A, w1, b1, 1), (A, w2, b2, 1), (B, w1, b1, 1)]),
    )
    .totals();
    // PEXPIREAT (bucket + 2) * window_ms + 60000, exactly.
    let a1 = format!("fg:{{1}}:{A}:{w1}:{b1}");
    let a2 = format!("fg:{{1}}:{A}:{w2}:{b2}");
    assert_eq!(redis.pexpiretime(&a1), ((b1 + 2) * w1 + 60_000) as i64);
    assert_eq!(redis.pexpiretime(&a2), ((b2 + 2) * w2 + 60_000) as i64);
    // Dedup hashes: the period covers max(2 * the longest window of the part's counters,
    // 600000) (10 min × 2^k: 9 600 000 for an hour); the generation is the one of the part's
    // latest bucket start, and its hash expires at the end of the next generation, so a seq
    // lives one to two periods past its counters' time.
    let (period, latest) = (9_600_000u64, (b1 * w1).max(b2 * w2));
    let hashes = seen_hashes(&redis, P1);
    let [hash] = hashes.as_slice() else { panic!("{hashes:?}") };
    let generation = latest / period;
    assert_eq!(hash, &format!("fg:seen:{period}:{generation}"));
    assert_eq!(redis.pexpiretime(hash), ((generation + 2) * period) as i64, "{hash}");
    assert!(redis.pttl(hash) >= period as i64 - 3_600_000 - 10_000, "{hash}");
    // A read (delta 0) of an existing counter leaves its expiry alone; an increment sets it to
    // the same instant again.
    post(sync.port, &batch(P1, 2, &[(A, w1, b1, 0), (A, w1, b1, 2)])).totals();
    assert_eq!(redis.pexpiretime(&a1), ((b1 + 2) * w1 + 60_000) as i64);
    assert_eq!(redis.get(&a1), Some(3));
    // A bucket long past expires at once: the increment is not kept.
    let stale = post(sync.port, &batch(P1, 3, &[(C, 1000, 5, 1)]));
    assert_eq!(stale.totals(), vec![(0, 0)]);
    assert_eq!(redis.get(&format!("fg:{{15}}:{C}:1000:5")), None);
    // The largest values of the protocol are safe: the expiry saturates at what Redis takes.
    let extreme = post(
        sync.port,
        &batch(P1, 4, &[(C, 31_622_400_000, 1 << 53, 2_147_483_647)]),
    );
    assert_eq!(extreme.totals(), vec![(0, 2_147_483_647)]);
    let key = format!("fg:{{15}}:{C}:31622400000:{}", 1u64 << 53);
    assert_eq!(redis.pexpiretime(&key), i64::MAX);
}

#[test]
fn every_refusal_writes_nothing() {
    let t = present();
    let redis = Redis::start(free_ports(1, false)[0], false);
    let sync = Sync::start(&[
        "--redis",
        &redis.url(),
        "--max-counters",
        "3",
        "--max-body-bytes",
        "2048",
    ]);
    let ok = |seq| batch(P1, seq, &[(A, 1000, t + 5, 1)]);
    let four = batch(
        P1,
        1,
        &[
            (A, 1000, t + 5, 1),
            (B, 1000, t + 5, 1),
            (C, 1000, t + 5, 1),
            (A, 1000, t + 6, 1),
        ],
    );
    let mut unknown = ok(1);
    unknown["counters"][0]["weight"] = json!(2);
    let mut version = ok(1);
    version["version"] = json!(2);
    let mut hex = ok(1);
    hex["counters"][0]["key"] = json!(A.to_uppercase());
    let mut proxy = ok(1);
    proxy["proxy"] = json!("0123456789abcdeg");
    let mut window = ok(1);
    window["counters"][0]["window_ms"] = json!(0);
    let mut delta = ok(1);
    delta["counters"][0]["delta"] = json!(2_147_483_648u64);
    let mut negative = ok(1);
    negative["counters"][0]["delta"] = json!(-1);
    let mut bucket = ok(1);
    bucket["counters"][0]["bucket"] = json!((1u64 << 53) + 1);
    let mut seq = ok(1);
    seq["seq"] = json!("1");
    let json_cases = [
        (serde_json::to_vec(&four).unwrap(), "counters: at most 3"),
        (serde_json::to_vec(&unknown).unwrap(), "counters[0]"),
        (
            serde_json::to_vec(&version).unwrap(),
            "version: unsupported version 2",
        ),
        (serde_json::to_vec(&hex).unwrap(), "counters[0].key"),
        (serde_json::to_vec(&proxy).unwrap(), "proxy"),
        (
            serde_json::to_vec(&window).unwrap(),
            "counters[0].window_ms",
        ),
        (serde_json::to_vec(&delta).unwrap(), "counters[0].delta"),
        (serde_json::to_vec(&negative).unwrap(), "counters[0].delta"),
        (serde_json::to_vec(&bucket).unwrap(), "counters[0].bucket"),
        (serde_json::to_vec(&seq).unwrap(), "seq"),
        (b"{\"version\": 1, \"proxy\": ".to_vec(), "EOF"),
        (b"not json".to_vec(), "expected"),
        (Vec::new(), "EOF"),
    ];
    for (body, field) in json_cases {
        let answer = request(
            sync.port,
            "POST",
            "/v1/sync",
            Some("application/json"),
            body.clone(),
            false,
        );
        assert_eq!(
            answer.status,
            400,
            "{}: {}",
            String::from_utf8_lossy(&body),
            answer.body
        );
        let error = answer.json()["error"].as_str().unwrap().to_string();
        assert!(error.contains(field), "{error} should name {field}");
        assert!(!error.contains('\n'));
    }
    // 413: larger than --max-body-bytes, over HTTP/1.1 and HTTP/2.
    let mut big = ok(1);
    big["padding"] = json!("x".repeat(4096));
    for http2 in [false, true] {
        let answer = request(
            sync.port,
            "POST",
            "/v1/sync",
            Some("application/json"),
            serde_json::to_vec(&big).unwrap(),
            http2,
        );
        assert_eq!(answer.status, 413, "{}", answer.body);
        assert!(answer.json()["error"]
            .as_str()
            .unwrap()
            .contains("2048 bytes"));
    }
    // 415: not JSON, or no content type at all.
    for content_type in [
        Some("text/plain"),
        Some("application/x-www-form-urlencoded"),
        None,
    ] {
        let answer = request(
            sync.port,
            "POST",
            "/v1/sync",
            content_type,
            serde_json::to_vec(&ok(1)).unwrap(),
            false,
        );
        assert_eq!(answer.status, 415, "{content_type:?}");
    }
    // 405 and 404.
    for method in ["GET", "PUT", "DELETE"] {
        let answer = request(
            sync.port,
            method,
            "/v1/sync",
            Some("application/json"),
            serde_json::to_vec(&ok(1)).unwrap(),
            false,
        );
        assert_eq!(answer.status, 405, "{method}");
    }
    assert_eq!(
        request(sync.port, "POST", "/healthz", None, "", false).status,
        405
    );
    for path in ["/", "/v1/sync/", "/v2/sync", "/v1/syncs"] {
        let answer = request(
            sync.port,
            "POST",
            path,
            Some("application/json"),
            serde_json::to_vec(&ok(1)).unwrap(),
            false,
        );
        assert_eq!(answer.status, 404, "{path}");
        assert!(answer.json()["error"].is_string());
    }
    assert_eq!(redis.dbsize(), 0, "{:?}", redis.keys());
    assert_eq!(
        redis.command_calls("evalsha") + redis.command_calls("eval"),
        0
    );
    // Parameters of the media type are fine.
    let answer = request(
        sync.port,
        "POST",
        "/v1/sync",
        Some("Application/JSON; charset=utf-8"),
        serde_json::to_vec(&ok(1)).unwrap(),
        false,
    );
    assert_eq!(answer.totals(), vec![(0, 1)]);
    let metrics = get(sync.port, "/metrics").body;
    assert_eq!(
        metric(
            &metrics,
            "floodgate_sync_errors_total{status=\"400\",kind=\"bad_request\"}"
        ),
        13
    );
    assert_eq!(
        metric(
            &metrics,
            "floodgate_sync_errors_total{status=\"413\",kind=\"payload_too_large\"}"
        ),
        2
    );
    assert_eq!(
        metric(
            &metrics,
            "floodgate_sync_errors_total{status=\"415\",kind=\"unsupported_media_type\"}"
        ),
        3
    );
    assert_eq!(
        metric(
            &metrics,
            "floodgate_sync_errors_total{status=\"405\",kind=\"method_not_allowed\"}"
        ),
        4
    );
    assert_eq!(
        metric(
            &metrics,
            "floodgate_sync_errors_total{status=\"404\",kind=\"not_found\"}"
        ),
        4
    );
    // Nothing per request at info: the startup line and the warning that calls are open.
    assert_eq!(sync.log().lines().count(), 2, "{}", sync.log());
    assert!(sync.log().contains("WARN no --token"), "{}", sync.log());
}

#[test]
fn redis_down_is_503_within_the_timeout_and_back_without_a_restart() {
    let t = present();
    let (mut redis, sync) = single();
    let body = |seq| batch(P1, seq, &[(A, 1000, t + 5, 1)]);
    assert_eq!(post(sync.port, &body(1)).totals(), vec![(0, 1)]);
    assert_eq!(get(sync.port, "/readyz").status, 200);
    redis.kill();
    for seq in 2..5 {
        let start = Instant::now();
        let answer = post(sync.port, &body(seq));
        let took = start.elapsed();
        assert_eq!(answer.status, 503, "{}", answer.body);
        assert!(
            answer.json()["error"]
                .as_str()
                .unwrap()
                .starts_with("store unavailable: "),
            "{}",
            answer.body
        );
        // --redis-timeout is 500ms.
        assert!(took < Duration::from_millis(1500), "{took:?}");
    }
    let ready = get(sync.port, "/readyz");
    assert_eq!(ready.status, 503, "{}", ready.body);
    assert_eq!(get(sync.port, "/healthz").status, 200);
    // Back: an empty Redis (nothing is persisted in this test), the same floodgate-sync.
    redis.restart();
    let start = Instant::now();
    let answer = loop {
        let answer = post(sync.port, &body(5));
        if answer.status == 200 || start.elapsed() > Duration::from_secs(10) {
            break answer;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(
        answer.totals(),
        vec![(0, 1)],
        "the batch counts once after a restart"
    );
    assert_eq!(get(sync.port, "/readyz").status, 200);
    let metrics = get(sync.port, "/metrics").body;
    assert!(
        metric(
            &metrics,
            "floodgate_sync_errors_total{status=\"503\",kind=\"store_error\"}"
        ) + metric(
            &metrics,
            "floodgate_sync_errors_total{status=\"503\",kind=\"store_timeout\"}"
        ) >= 3
    );
    // One log line per Redis error at most once a second, not one per failed request.
    let errors = sync.log().lines().filter(|l| l.contains("redis:")).count();
    assert!((1..=6).contains(&errors), "{}", sync.log());
}

#[test]
fn state_survives_a_restart_of_floodgate_sync() {
    let t = present();
    let redis = Redis::start(free_ports(1, false)[0], false);
    let mut sync = Sync::start(&["--redis", &redis.url()]);
    let body = batch(P1, 9, &[(A, 1000, t + 5, 4), (B, 1000, t + 5, 6)]);
    assert_eq!(post(sync.port, &body).totals(), vec![(0, 4), (0, 6)]);
    assert!(sync.terminate(), "graceful exit on SIGTERM");
    assert!(sync.log().contains("SIGTERM"), "{}", sync.log());
    let sync = Sync::start(&["--redis", &redis.url()]);
    // The retry of seq 9 through the new instance still counts nothing twice.
    assert_eq!(post(sync.port, &body).totals(), vec![(0, 4), (0, 6)]);
    assert_eq!(
        post(sync.port, &batch(P1, 10, &[(A, 1000, t + 5, 1)])).totals(),
        vec![(0, 5)]
    );
    // Two instances at once serve the same fleet.
    let other = Sync::start(&["--redis", &redis.url()]);
    assert_eq!(
        post(other.port, &batch(P2, 1, &[(A, 1000, t + 5, 1)])).totals(),
        vec![(0, 6)]
    );
}

#[test]
fn http1_and_http2_prior_knowledge_on_one_port() {
    let t = present();
    let (_redis, sync) = single();
    let body = |seq| serde_json::to_vec(&batch(P1, seq, &[(A, 1000, t + 5, 1)])).unwrap();
    let h1 = request(
        sync.port,
        "POST",
        "/v1/sync",
        Some("application/json"),
        body(1),
        false,
    );
    assert_eq!(h1.totals(), vec![(0, 1)]);
    let h2 = request(
        sync.port,
        "POST",
        "/v1/sync",
        Some("application/json"),
        body(2),
        true,
    );
    assert_eq!(h2.totals(), vec![(0, 2)]);
    for http2 in [false, true] {
        let health = request(sync.port, "GET", "/healthz", None, "", http2);
        assert_eq!(
            (health.status, health.body.as_str()),
            (200, "{\"status\":\"ok\"}")
        );
        assert_eq!(
            request(sync.port, "GET", "/readyz", None, "", http2).status,
            200
        );
        let metrics = request(sync.port, "GET", "/metrics", None, "", http2);
        assert_eq!(metrics.status, 200);
        assert!(metrics
            .content_type
            .unwrap()
            .starts_with("text/plain; version=0.0.4"));
    }
    let metrics = get(sync.port, "/metrics").body;
    assert_eq!(
        metric(&metrics, "floodgate_sync_request_duration_seconds_count"),
        2
    );
    assert_eq!(
        metric(&metrics, "floodgate_sync_counters_received_total"),
        2
    );
}

#[test]
fn a_batch_costs_one_redis_command_on_a_single_node() {
    let (redis, sync) = single();
    // 100 keys over all 16 shards, as one proxy's batch every sync interval.
    let keys: Vec<String> = (0..100).map(|n| key_in_shard(n % 16, n)).collect();
    let bucket = now_ms() / 60_000;
    let counters = |delta: u64| -> Vec<(&str, u64, u64, u64)> {
        keys.iter()
            .map(|k| (k.as_str(), 60_000, bucket, delta))
            .collect()
    };
    // The first call loads the script (EVALSHA, NOSCRIPT, EVAL); count the steady state after.
    post(sync.port, &batch(P1, 1, &counters(1))).totals();
    // What measuring costs in commands (INFO, and the CLIENT SETINFO of each new connection of
    // this test), to subtract from total_commands_processed.
    let measure = || {
        let total = redis.total_commands();
        (
            redis.command_calls("evalsha"),
            redis.command_calls("eval"),
            total,
        )
    };
    let (_, _, t0) = measure();
    let (evalsha, eval, total) = measure();
    let overhead = total - t0;
    assert_eq!((evalsha, eval), (1, 1), "NOSCRIPT once, then EVAL");
    let batches = 20u64;
    let started = std::time::Instant::now();
    for seq in 2..2 + batches {
        let totals = post(sync.port, &batch(P1, seq, &counters(1))).totals();
        assert!(totals.iter().all(|&(_, current)| current == seq));
    }
    let (evalsha_after, eval_after, total_after) = measure();
    let per_batch_evalsha = (evalsha_after - evalsha) as f64 / batches as f64;
    let per_batch_eval = (eval_after - eval) as f64 / batches as f64;
    let per_batch_total = (total_after - total - overhead) as f64 / batches as f64;
    let incrby = redis.command_calls("incrby");
    eprintln!(
        "single node, 100 keys over 16 shards: {per_batch_evalsha} EVALSHA + {per_batch_eval} EVAL \
         per batch (client round trips); total_commands_processed {per_batch_total:.1} per batch \
         (script calls included); INCRBY calls so far {incrby}"
    );
    assert_eq!(per_batch_evalsha, 1.0);
    assert_eq!(per_batch_eval, 0.0);
    let periods = started.elapsed().as_millis() as u64 / 200 + 1;
    let metrics = get(sync.port, "/metrics").body;
    // Besides the scripts, one pipelined round trip for the fleet size per 200 ms at most,
    // whatever the number of batches.
    let fleet = metric(&metrics, "floodgate_sync_redis_round_trips_total") - (2 + batches);
    eprintln!("fleet size: {fleet} round trips for {} batches in {periods} periods of 200 ms", batches + 1);
    assert!((1..=1 + periods).contains(&fleet), "{fleet} round trips for the fleet size");
    assert_eq!(redis.command_calls("pfadd"), fleet);
}

#[test]
fn it_starts_before_redis_and_serves_once_redis_is_up() {
    let t = present();
    let port = free_ports(1, false)[0];
    let sync = Sync::start(&[
        "--redis",
        &format!("redis://127.0.0.1:{port}"),
        "--redis-timeout",
        "300ms",
    ]);
    assert_eq!(get(sync.port, "/healthz").status, 200);
    assert_eq!(get(sync.port, "/readyz").status, 503);
    let body = batch(P1, 1, &[(A, 1000, t + 5, 1)]);
    assert_eq!(post(sync.port, &body).status, 503);
    let _redis = Redis::start(port, false);
    wait_until("/v1/sync to answer 200", Duration::from_secs(10), || {
        post(sync.port, &body).status == 200
    });
    assert_eq!(post(sync.port, &body).totals(), vec![(0, 1)]);
    assert_eq!(get(sync.port, "/readyz").status, 200);
}

#[test]
fn flags_come_from_environment_variables_too() {
    let t = present();
    let redis = Redis::start(free_ports(1, false)[0], false);
    let sync = Sync::start_with_env(
        &[],
        &[
            ("FLOODGATE_SYNC_REDIS", &redis.url()),
            ("FLOODGATE_SYNC_SHARDS", "4"),
            ("FLOODGATE_SYNC_PREFIX", "team-a:"),
            ("FLOODGATE_SYNC_MAX_COUNTERS", "1"),
        ],
    );
    assert!(
        sync.log().contains("shards 4 prefix \"team-a:\""),
        "{}",
        sync.log()
    );
    // 0x0000001f % 4 = 3.
    assert_eq!(
        post(sync.port, &batch(P1, 1, &[(C, 1000, t + 5, 2)])).totals(),
        vec![(0, 2)]
    );
    assert_eq!(
        redis.get(&format!("team-a:{{3}}:{C}:1000:{}", t + 5)),
        Some(2)
    );
    assert_eq!(
        post(
            sync.port,
            &batch(P1, 2, &[(C, 1000, t + 5, 2), (A, 1000, t + 5, 2)])
        )
        .status,
        400
    );
}

#[test]
fn help_explains_every_flag_and_bad_flags_exit_non_zero() {
    let help = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate-sync"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(help.status.success());
    let text = String::from_utf8(help.stdout).unwrap();
    for flag in [
        "--listen",
        "--redis ",
        "--cluster",
        "--shards",
        "--prefix",
        "--max-counters",
        "--max-body-bytes",
        "--redis-timeout",
        "FLOODGATE_SYNC_REDIS_TIMEOUT",
    ] {
        assert!(
            text.contains(flag),
            "--help does not mention {flag}:\n{text}"
        );
    }
    for bad in [
        &["--shards", "0"][..],
        &["--prefix", "a{b}"],
        &["--redis", "redis://a:1,redis://b:2"],
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_floodgate-sync"))
            .args(["--listen", "127.0.0.1:0"])
            .args(bad)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{bad:?}");
        assert!(!out.stderr.is_empty(), "{bad:?}: says why");
    }
}

#[test]
fn a_hung_redis_is_503_after_the_timeout() {
    let t = present();
    let redis = Redis::start(free_ports(1, false)[0], false);
    let sync = Sync::start(&["--redis", &redis.url(), "--redis-timeout", "300ms"]);
    assert_eq!(
        post(sync.port, &batch(P1, 1, &[(A, 1000, t + 5, 1)])).totals(),
        vec![(0, 1)]
    );
    redis.signal("-STOP");
    let start = Instant::now();
    let answer = post(sync.port, &batch(P1, 2, &[(A, 1000, t + 5, 1)]));
    let took = start.elapsed();
    redis.signal("-CONT");
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert!(answer.body.contains("within 300ms"), "{}", answer.body);
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_millis(1300),
        "{took:?}"
    );
    // Once Redis wakes, it may or may not have applied seq 2 (it had the script call in its
    // socket); the retry counts it exactly once either way.
    wait_until("/v1/sync to answer 200", Duration::from_secs(10), || {
        post(sync.port, &batch(P1, 2, &[(A, 1000, t + 5, 1)])).status == 200
    });
    assert_eq!(
        post(sync.port, &batch(P1, 2, &[(A, 1000, t + 5, 1)])).totals(),
        vec![(0, 2)]
    );
    let metrics = get(sync.port, "/metrics").body;
    assert_eq!(
        metric(
            &metrics,
            "floodgate_sync_errors_total{status=\"503\",kind=\"store_timeout\"}"
        ),
        1
    );
}

#[test]
fn the_largest_batch_goes_in_script_calls_of_whole_shards() {
    // --max-counters (10 000) distinct counters over 16 shards (625 each): script calls of
    // whole shards up to 1000 counters, so 16 calls here, one after the other.
    let t = present();
    let (redis, sync) = single_long_timeout();
    let keys: Vec<String> = (0..10_000).map(|n| key_in_shard(n % 16, n)).collect();
    let counters: Vec<(&str, u64, u64, u64)> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.as_str(), 1000, t + 5, i as u64 % 7))
        .collect();
    let body = batch(P1, 1, &counters);
    assert!(serde_json::to_vec(&body).unwrap().len() < 1 << 20);
    let totals = post(sync.port, &body).totals();
    assert_eq!(totals.len(), 10_000);
    for (i, &(previous, current)) in totals.iter().enumerate() {
        assert_eq!((previous, current), (0, i as u64 % 7));
    }
    // Counters with delta 0 were not written; one dedup hash holds the 16 shards' seqs.
    // (And the second's HyperLogLog of proxies.)
    assert_eq!(
        redis.dbsize(),
        1 + (0..10_000u64).filter(|i| i % 7 != 0).count() as u64 + 1
    );
    // The first call met NOSCRIPT (a fresh Redis) and went again as EVAL; the others found
    // the script loaded.
    assert_eq!(
        (redis.command_calls("evalsha"), redis.command_calls("eval")),
        (16, 1)
    );
}

/// Like [`single`], with a Redis timeout that a slow debug build on a busy machine cannot miss.
fn single_long_timeout() -> (Redis, Sync) {
    let redis = Redis::start(free_ports(1, false)[0], false);
    let sync = Sync::start(&["--redis", &redis.url(), "--redis-timeout", "10s"]);
    (redis, sync)
}

/// Batches that arrive while the previous script call runs go together in the next one:
/// 40 proxies at once, each sending 25 batches (and each retrying one), all with one shared
/// counter and one of their own: every batch counts exactly once, in fewer script calls than
/// batches.
#[test]
fn batches_arriving_together_merge_into_fewer_calls_and_count_exactly_once() {
    let t = present();
    let (redis, sync) = single();
    let port = sync.port;
    let threads: Vec<_> = (0..40u32)
        .map(|n| {
            std::thread::spawn(move || {
                let proxy = format!("{:016x}", u64::from(n) + 1);
                let own = key_in_shard(n % 16, n + 100);
                let counters = [(A, 1000, t + 5, 1), (own.as_str(), 1000, t + 5, 2)];
                for seq in 1..=25 {
                    assert_eq!(post(port, &batch(&proxy, seq, &counters)).status, 200);
                    if seq == 10 {
                        // A retry: only read.
                        assert_eq!(post(port, &batch(&proxy, seq, &counters)).status, 200);
                    }
                }
                own
            })
        })
        .collect();
    let owns: Vec<String> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(redis.get(&format!("fg:{{1}}:{A}:1000:{}", t + 5)), Some(40 * 25));
    for (n, own) in owns.iter().enumerate() {
        let shard = n % 16;
        assert_eq!(redis.get(&format!("fg:{{{shard}}}:{own}:1000:{}", t + 5)), Some(50), "{own}");
    }
    let metrics = get(port, "/metrics").body;
    let calls = metric(&metrics, "floodgate_sync_batch_calls_total");
    let applied = metric(&metrics, "floodgate_sync_shard_parts_total{result=\"applied\"}");
    let read = metric(&metrics, "floodgate_sync_shard_parts_total{result=\"deduplicated\"}");
    eprintln!("{applied} batches' parts applied and {read} only read in {calls} script calls");
    // A batch goes whole, one part over its two shards.
    assert_eq!((applied, read), (25 * 40, 40));
    assert!(calls < applied + read, "merged: {calls} calls for {} parts", applied + read);
    // The dedup: the node keeps every proxy's last seq in one hash (or two, in two generations),
    // and its commands come per call, not per part: an HSET per call at most, an HMGET per call
    // and one more for the fields a call does not find in the current generation (in the
    // previous one).
    assert!(seen_hashes(&redis, "0000000000000001").len() <= 2, "{:?}", redis.keys());
    for n in 0..40u64 {
        assert_eq!(last_seq(&redis, &format!("{:016x}", n + 1)), Some(25));
    }
    let (hmget, hset) = (redis.command_calls("hmget"), redis.command_calls("hset"));
    eprintln!("dedup: {hmget} HMGET and {hset} HSET for {} parts in {calls} calls", applied + read);
    assert!(hset < applied, "{hset} HSET for {applied} parts applied");
    assert!(hset <= calls && hmget <= 2 * calls, "{hmget} HMGET and {hset} HSET in {calls} calls");
}

/// On a single node one dedup hash holds every shard's seqs: a batch over several shards goes
/// whole, as one part whose field is the proxy, in one call that reads and writes that hash
/// once; sent again, to this instance or another one, it only reads; an older seq only reads, on
/// every shard; and a batch with an hour's counter and a second's goes whole in the hour's
/// period.
#[test]
fn a_batch_over_many_shards_is_applied_whole_and_once_with_one_dedup_hash() {
    let t = present();
    let (redis, sync) = single();
    let other = Sync::start(&["--redis", &redis.url(), "--redis-timeout", "500ms"]);
    let counters = [(A, 1000, t + 5, 1), (B, 1000, t + 5, 2), (C, 1000, t + 5, 3), (D, 1000, t + 5, 4)];
    assert_eq!(post(sync.port, &batch(P1, 1, &counters)).totals(), vec![(0, 1), (0, 2), (0, 3), (0, 4)]);
    // The next seq: applied whole, one HMGET (its field found in the current generation) and one
    // HSET.
    let (hmget, hset) = (redis.command_calls("hmget"), redis.command_calls("hset"));
    let next = post(sync.port, &batch(P1, 2, &counters));
    assert_eq!(next.totals(), vec![(0, 2), (0, 4), (0, 6), (0, 8)]);
    assert_eq!((redis.command_calls("hmget") - hmget, redis.command_calls("hset") - hset), (1, 1));
    let [hash] = seen_hashes(&redis, P1).try_into().unwrap();
    let fields: Vec<(String, u64)> = redis.hgetall(&hash).into_iter().filter(|(f, _)| f != "-").collect();
    assert_eq!(fields, [(P1.to_owned(), 2)]);
    // Sent again, here and to another instance (a retry after a lost answer): only read.
    for port in [sync.port, other.port, sync.port] {
        assert_eq!(post(port, &batch(P1, 2, &counters)).totals(), vec![(0, 2), (0, 4), (0, 6), (0, 8)]);
    }
    // An older seq only reads, on every shard.
    assert_eq!(post(other.port, &batch(P1, 1, &counters)).totals(), vec![(0, 2), (0, 4), (0, 6), (0, 8)]);
    // Seq 3 on shard 1 alone; then seq 2 again: older than 3, only read.
    assert_eq!(post(sync.port, &batch(P1, 3, &[(A, 1000, t + 5, 10)])).totals(), vec![(0, 12)]);
    assert_eq!(post(sync.port, &batch(P1, 2, &counters)).totals(), vec![(0, 12), (0, 4), (0, 6), (0, 8)]);
    assert_eq!(last_seq(&redis, P1), Some(3));
    // An hour's counter and a second's: applied whole, once, in the hour's period.
    let hour = now_ms() / 3_600_000;
    let spread = batch(P2, 7, &[(A, 3_600_000, hour, 5), (B, 1000, t + 5, 5)]);
    for port in [sync.port, other.port] {
        assert_eq!(post(port, &spread).totals(), vec![(0, 5), (0, 9)]);
    }
    assert_eq!(last_seq(&redis, P2), Some(7));
    let periods: Vec<String> = redis.keys().into_iter().filter(|k| k.starts_with("fg:seen:9600000:")).collect();
    assert_eq!(periods.len(), 1, "{periods:?}");
    let metrics = get(sync.port, "/metrics").body + &get(other.port, "/metrics").body;
    let parts = |result: &str| {
        metrics
            .lines()
            .filter(|l| l.starts_with(&format!("floodgate_sync_shard_parts_total{{result=\"{result}\"}}")))
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
            .sum::<u64>()
    };
    // Applied: seqs 1, 2 and 3 and the spread one; only read: seq 2 three times, seq 1, seq 2
    // again, and the spread one again.
    assert_eq!((parts("applied"), parts("deduplicated")), (4, 6));
}

/// A batch that finds its lane idle waits `--batch-gather` for the others: the batches of
/// proxies that send at the same moment (as the fleet does, on its shared grid) go in one call.
#[test]
fn batches_sent_together_are_gathered_into_one_call() {
    let t = present();
    let redis = Redis::start(free_ports(1, false)[0], false);
    let sync = Sync::start(&["--redis", &redis.url(), "--redis-timeout", "10s", "--batch-pace", "300ms", "--batch-gather", "300ms"]);
    // Load the script first (the first call meets NOSCRIPT).
    assert_eq!(post(sync.port, &batch(P2, 1, &[(B, 1000, t + 5, 1)])).status, 200);
    std::thread::sleep(Duration::from_millis(500)); // past its pace: the lane is idle again
    let port = sync.port;
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(8));
    let threads: Vec<_> = (0..8u64)
        .map(|n| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                let proxy = format!("{:016x}", n + 1);
                barrier.wait();
                // Within 140 ms of each other, as a fleet's batches come within a few ms.
                std::thread::sleep(Duration::from_millis(20 * n));
                let started = Instant::now();
                let answer = post(port, &batch(&proxy, 1, &[(A, 1000, t + 5, 1)]));
                (answer.status, started.elapsed())
            })
        })
        .collect();
    let answers: Vec<(u16, Duration)> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(answers.iter().all(|(status, _)| *status == 200), "{answers:?}");
    assert_eq!(redis.get(&format!("fg:{{1}}:{A}:1000:{}", t + 5)), Some(8));
    let metrics = get(port, "/metrics").body;
    assert_eq!(metric(&metrics, "floodgate_sync_batch_calls_total"), 2, "the first batch's call, then the 8 in one");
    // The first waited the gather.
    assert!(answers.iter().any(|(_, waited)| *waited >= Duration::from_millis(250)), "{answers:?}");
}

/// The same part twice in one script call (a batch sent again while its first copy waits in
/// the lane) counts once: the second copy is compared with the seq the first one just applied.
#[test]
fn copies_of_a_batch_in_one_call_count_once() {
    let t = present();
    let (redis, sync) = single_long_timeout();
    let port = sync.port;
    let counters = [(A, 1000, t + 5, 1), (B, 1000, t + 5, 1), (C, 1000, t + 5, 1)];
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(20));
    let threads: Vec<_> = (0..20)
        .map(|_| {
            let barrier = barrier.clone();
            std::thread::spawn(move || {
                barrier.wait();
                post(port, &batch(P1, 1, &counters)).totals()
            })
        })
        .collect();
    for thread in threads {
        assert_eq!(thread.join().unwrap(), vec![(0, 1), (0, 1), (0, 1)]);
    }
    for (key, shard) in [(A, 1), (B, 2), (C, 15)] {
        assert_eq!(redis.get(&format!("fg:{{{shard}}}:{key}:1000:{}", t + 5)), Some(1), "{key}");
    }
    assert_eq!(last_seq(&redis, P1), Some(1));
    let metrics = get(port, "/metrics").body;
    let calls = metric(&metrics, "floodgate_sync_batch_calls_total");
    let applied = metric(&metrics, "floodgate_sync_shard_parts_total{result=\"applied\"}");
    let read = metric(&metrics, "floodgate_sync_shard_parts_total{result=\"deduplicated\"}");
    assert_eq!((applied, read), (1, 19));
    // Fewer calls than copies: two copies of the part in some call.
    assert!(calls < 20, "copies merged into one call: {calls} calls for 20 copies");
}
