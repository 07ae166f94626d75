//! `POST /v1/lease` against one real `redis-server`: grants never exceed the sliding window's
//! room, however many callers race; give-backs come before the grant; the previous bucket's
//! weight is exact at the extremes of windows and limits.
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

use bytes::Bytes;
use common::*;
use serde_json::{json, Value};

const A: &str = "00000001aaaaaaaaaaaaaaaaaaaaaaaa";

fn single() -> (Redis, Sync) {
    let redis = Redis::start(free_ports(1, false)[0], false);
    let sync = Sync::start(&["--redis", &redis.url(), "--redis-timeout", "500ms"]);
    (redis, sync)
}

fn lease_call(port: u16, entries: &[Value]) -> Answer {
    request(
        port,
        "POST",
        "/v1/lease",
        Some("application/json"),
        serde_json::to_vec(&json!({"version": 1, "leases": entries})).unwrap(),
        false,
    )
}

/// One entry: `key` in 60 s windows at `bucket`, `elapsed_ms` into it, under `limit`.
fn entry(key: &str, bucket: u64, elapsed_ms: u64, limit: u64, want: u64) -> Value {
    json!({"key": key, "window_ms": 60_000, "bucket": bucket, "elapsed_ms": elapsed_ms, "limit": limit, "want": want})
}

/// (granted, current, previous) of each entry.
fn grants(answer: &Answer) -> Vec<(u64, u64, u64)> {
    assert_eq!(answer.status, 200, "{}", answer.body);
    let body = answer.json();
    assert_eq!(body["version"], 1);
    body["leases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["granted"].as_u64().unwrap(),
                g["current"].as_u64().unwrap(),
                g["previous"].as_u64().unwrap(),
            )
        })
        .collect()
}

#[test]
fn grants_take_a_quarter_of_the_room_at_most_and_stop_at_the_limit() {
    let (redis, sync) = single();
    let bucket = now_ms() / 60_000;
    let mut seen = Vec::new();
    loop {
        let [(granted, current, previous)] = grants(&lease_call(sync.port, &[entry(A, bucket, 0, 10, 100)]))[..] else {
            panic!("one grant");
        };
        assert_eq!(previous, 0);
        seen.push((granted, current));
        if granted == 0 {
            break;
        }
    }
    // Room 10: 2, then 2 (room 8), 1 (6 → 1), 1 (5), 1, 1, 1, 1; then none.
    assert_eq!(
        seen,
        [(2, 2), (2, 4), (1, 5), (1, 6), (1, 7), (1, 8), (1, 9), (1, 10), (0, 10)]
    );
    let layout_key = format!("fg:{{1}}:{A}:60000:{bucket}");
    assert_eq!(redis.get(&layout_key), Some(10), "{:?}", redis.keys());
    let ttl = redis.pexpiretime(&layout_key);
    assert_eq!(ttl as u64, (bucket + 2) * 60_000 + 60_000, "the counter expires with the batched ones");
    // Want 0 only reads; a give-back frees room that the same call grants again.
    assert_eq!(grants(&lease_call(sync.port, &[entry(A, bucket, 0, 10, 0)])), [(0, 10, 0)]);
    let mut give_back = entry(A, bucket, 0, 10, 5);
    give_back["returned"] = json!(4);
    assert_eq!(grants(&lease_call(sync.port, &[give_back])), [(1, 7, 0)]);
    // Units admitted while the store was down are counted whatever the room.
    let mut consumed = entry(A, bucket, 0, 10, 5);
    consumed["consumed"] = json!(5);
    assert_eq!(grants(&lease_call(sync.port, &[consumed])), [(0, 12, 0)]);
    // A give-back never takes a counter below zero.
    let mut too_much = entry(A, bucket, 0, 10, 0);
    too_much["returned"] = json!(1000);
    assert_eq!(grants(&lease_call(sync.port, &[too_much])), [(0, 0, 0)]);
    let metrics = get(sync.port, "/metrics").body;
    assert_eq!(metric(&metrics, "floodgate_sync_lease_units_granted_total"), 11);
    assert_eq!(metric(&metrics, "floodgate_sync_leases_received_total"), 13);
    assert_eq!(metric(&metrics, "floodgate_sync_lease_duration_seconds_count"), 13);
}

/// A batched rule's ask (`exact`): the whole `want` while the room holds it, then nothing,
/// where a lease would take a quarter of the room.
#[test]
fn an_exact_ask_is_granted_whole_or_not_at_all() {
    let (_redis, sync) = single();
    let bucket = now_ms() / 60_000;
    let ask = |want: u64| {
        let mut e = entry(A, bucket, 0, 100, want);
        e["exact"] = json!(true);
        e["at_once"] = json!(want);
        grants(&lease_call(sync.port, &[e]))
    };
    assert_eq!(ask(80), [(80, 80, 0)]);
    assert_eq!(ask(19), [(19, 99, 0)]);
    assert_eq!(ask(2), [(0, 99, 0)], "room for 1, not 2: nothing");
    assert_eq!(ask(1), [(1, 100, 0)]);
    assert_eq!(ask(1), [(0, 100, 0)]);
}

#[test]
fn the_previous_bucket_weighs_as_in_the_filter_and_takes_its_give_backs() {
    let (redis, sync) = single();
    let bucket = now_ms() / 60_000;
    let previous_key = format!("fg:{{1}}:{A}:60000:{}", bucket - 1);
    redis.set(&previous_key, "10");
    // 15 s into the bucket, the previous one weighs 45/60: ceil(7.5) = 8 of a limit of 12.
    let mut seen = Vec::new();
    loop {
        let [(granted, current, previous)] = grants(&lease_call(sync.port, &[entry(A, bucket, 15_000, 12, 100)]))[..] else {
            panic!("one grant");
        };
        assert_eq!(previous, 10);
        if granted == 0 {
            break;
        }
        seen.push(current);
    }
    assert_eq!(seen.last(), Some(&4), "{seen:?}");
    // Half of the previous bucket given back: ceil(5 × 0.75) = 4, room 12 − 4 − 4 = 4.
    let mut give_back = entry(A, bucket, 15_000, 12, 100);
    give_back["returned_previous"] = json!(5);
    assert_eq!(grants(&lease_call(sync.port, &[give_back])), [(1, 5, 5)]);
}

/// The room is exact where a double would not be: 366-day windows, limits near 2³², and a
/// previous count times the remaining milliseconds far above 2⁵³.
#[test]
fn the_room_is_exact_at_the_extremes() {
    let (redis, sync) = single();
    let window: u64 = 31_622_400_000;
    let bucket = now_ms() / window;
    for (n, (previous, elapsed, limit)) in [
        (4_294_967_295u64, 1u64, 4_294_967_295u64),
        (4_294_967_294, window - 1, 4_294_967_295),
        (3_000_000_001, 12_345_678_901, 4_000_000_000),
        (1, window / 2, 2),
        (999_999_999, 31_622_399_999, 1_000_000_000),
    ]
    .into_iter()
    .enumerate()
    {
        let key = key_in_shard(3, n as u32 + 1);
        redis.set(&format!("fg:{{3}}:{key}:{window}:{}", bucket - 1), &previous.to_string());
        let remaining = window - elapsed;
        let weighted = (u128::from(previous) * u128::from(remaining)).div_ceil(u128::from(window)) as u64;
        let room = limit.saturating_sub(weighted);
        let want = 2_147_483_647u64;
        let expected = if room == 0 { 0 } else { want.min((room / 4).max(1)) };
        let body = json!({"key": key, "window_ms": window, "bucket": bucket, "elapsed_ms": elapsed, "limit": limit, "want": want});
        let got = grants(&lease_call(sync.port, &[body]));
        assert_eq!(got, [(expected, expected, previous)], "previous {previous}, elapsed {elapsed}, limit {limit}: weighted {weighted}");
    }
}

/// Many callers at once, each asking for a few units until refused: the fleet is granted the
/// limit exactly, never more.
#[test]
fn racing_callers_are_granted_the_limit_exactly() {
    let (redis, sync) = single();
    let bucket = now_ms() / 60_000;
    let port = sync.port;
    let callers: Vec<_> = (0..8)
        .map(|_| {
            std::thread::spawn(move || {
                let mut total = 0;
                loop {
                    let [(granted, ..)] = grants(&lease_call(port, &[entry(A, bucket, 0, 1000, 7)]))[..] else {
                        panic!("one grant");
                    };
                    if granted == 0 {
                        return total;
                    }
                    total += granted;
                }
            })
        })
        .collect();
    let granted: u64 = callers.into_iter().map(|c| c.join().unwrap()).sum();
    assert_eq!(granted, 1000);
    assert_eq!(redis.get(&format!("fg:{{1}}:{A}:60000:{bucket}")), Some(1000));
}

/// Asks of batched rules from many callers at once (`exact`, taken at once): they merge into
/// fewer script calls than asks (a shard's lane takes the asks that came while its last call ran),
/// and the callers are granted the sliding window's room exactly, each ask whole or not at all,
/// the previous bucket weighing as in the filter; the counter gets its expiry. A lease in the same
/// request as an ask is answered in its place.
#[test]
fn racing_asks_merge_and_are_granted_the_room_exactly() {
    let (redis, sync) = single();
    let bucket = now_ms() / 60_000;
    // 30 s into the bucket, a previous bucket of 400 weighs ceil(400 × 30/60) = 200: room 1 000.
    redis.set(&format!("fg:{{1}}:{A}:60000:{}", bucket - 1), "400");
    let scripts_before = redis.command_calls("evalsha") + redis.command_calls("eval");
    let port = sync.port;
    let ask = move || {
        let mut e = entry(A, bucket, 30_000, 1200, 3);
        e["exact"] = json!(true);
        e["at_once"] = json!(3);
        e
    };
    let callers: Vec<_> = (0..16)
        .map(|_| {
            std::thread::spawn(move || {
                let (mut total, mut asks) = (0, 0);
                loop {
                    let [(granted, current, previous)] = grants(&lease_call(port, &[ask()]))[..] else {
                        panic!("one grant");
                    };
                    assert!(granted == 0 || granted == 3, "whole or nothing: {granted}");
                    assert!(current <= 1000 && previous == 400, "({current}, {previous})");
                    asks += 1;
                    if granted == 0 {
                        return (total, asks);
                    }
                    total += granted;
                }
            })
        })
        .collect();
    let (granted, asks) = callers.into_iter().map(|c| c.join().unwrap()).fold((0, 0), |(g, a), (cg, ca)| (g + cg, a + ca));
    let scripts = redis.command_calls("evalsha") + redis.command_calls("eval") - scripts_before;
    println!("{asks} asks in {scripts} script calls");
    assert_eq!(granted, 999, "the room (1 000) in whole asks of 3");
    let counter = format!("fg:{{1}}:{A}:60000:{bucket}");
    assert_eq!(redis.get(&counter), Some(999));
    assert!(redis.pttl(&counter) > 0, "the counter expires");
    assert!(scripts < asks, "{asks} asks merged into {scripts} calls");
    // An ask for the last unit and a lease, in one request: each answered in its place.
    let mut last = entry(A, bucket, 30_000, 1200, 1);
    last["exact"] = json!(true);
    last["at_once"] = json!(1);
    let other = "00000002bbbbbbbbbbbbbbbbbbbbbbbb";
    assert_eq!(grants(&lease_call(port, &[entry(other, bucket, 0, 8, 100), last])), [(2, 2, 0), (1, 1000, 400)]);
}

/// An ask names the units of its key that travel in the proxy's batch on its way (`carried`),
/// which its `limit` leaves out: once the shard shows that batch applied, the counter holds them
/// and the ask's limit takes them back; while it does not (another seq, or a part kept in a
/// hash of a longer window than the ask says the batch has), the limit stays as sent.
#[test]
fn an_ask_takes_back_the_units_of_a_batch_the_store_has_applied() {
    let (_redis, sync) = single();
    let bucket = now_ms() / 60_000;
    let proxy = "00000000000000aa";
    // The proxy's batch 5 carried 30 units of A (and, in the same shard, a counter of an hour's
    // window, so that its part is kept with the hour's period).
    let hour_key = "00000001cccccccccccccccccccccccc";
    let hour_bucket = now_ms() / 3_600_000;
    let applied = post(sync.port, &batch(proxy, 5, &[(A, 60_000, bucket, 30), (hour_key, 3_600_000, hour_bucket, 1)]));
    assert_eq!(applied.status, 200, "{}", applied.body);
    let ask = |want: u64, carried: Option<(u64, u64, u64)>| {
        // The proxy's 30 units, not confirmed to it: the limit of 100 comes as 70.
        let mut e = entry(A, bucket, 0, 70, want);
        e["exact"] = json!(true);
        e["at_once"] = json!(want);
        if let Some((seq, units, longest)) = carried {
            e["carried"] = json!({"proxy": proxy, "seq": seq, "units": units, "longest_window_ms": longest});
        }
        grants(&lease_call(sync.port, &[e]))
    };
    assert_eq!(ask(41, None), [(0, 30, 0)], "70 less the 30 counted twice: room 40");
    assert_eq!(ask(41, Some((6, 30, 3_600_000))), [(0, 30, 0)], "batch 6 is not applied: as sent");
    assert_eq!(ask(41, Some((5, 30, 60_000))), [(0, 30, 0)], "the part is in the hour's hash, which a minute's batch would not use");
    assert_eq!(ask(41, Some((5, 30, 3_600_000))), [(41, 71, 0)], "batch 5 applied: the 30 go back to the limit");
    assert_eq!(ask(30, Some((4, 30, 3_600_000))), [(0, 71, 0)], "room 29");
    assert_eq!(ask(29, Some((4, 30, 3_600_000))), [(29, 100, 0)], "a seq older than the one applied counts as applied");
}

/// On a single node a batch goes whole, its seq under the proxy's field, whatever shards it spans:
/// an ask finds its proxy's batch applied there; and a batch too large for one call goes in
/// shard parts, its seq under `<proxy>:<shard>`, where an ask of a key of that shard finds it.
#[test]
fn an_ask_finds_its_batch_in_the_single_nodes_dedup_hash() {
    let (redis, sync) = single();
    let bucket = now_ms() / 60_000;
    let proxy = "00000000000000aa";
    let (b, c) = ("00000002bbbbbbbbbbbbbbbbbbbbbbbb", "0000001fcccccccccccccccccccccccc");
    // Batch 5 carried 30 units of A (shard 1), and units of B and C (shards 2 and 15).
    let applied = post(sync.port, &batch(proxy, 5, &[(c, 60_000, bucket, 1), (A, 60_000, bucket, 30), (b, 60_000, bucket, 1)]));
    assert_eq!(applied.status, 200, "{}", applied.body);
    let hashes: Vec<String> = redis.keys().into_iter().filter(|k| k.contains(":seen:")).collect();
    assert_eq!(hashes.len(), 1, "{hashes:?}");
    let ask = |seq: u64, units: u64, limit: u64, want: u64| {
        let mut e = entry(A, bucket, 0, limit, want);
        e["exact"] = json!(true);
        e["at_once"] = json!(want);
        e["carried"] = json!({"proxy": proxy, "seq": seq, "units": units, "longest_window_ms": 60_000});
        grants(&lease_call(sync.port, &[e]))
    };
    // The proxy's 30 units, not confirmed to it: the limit of 100 comes as 70.
    assert_eq!(ask(7, 30, 70, 41), [(0, 30, 0)], "batch 7 is not applied: as sent");
    assert_eq!(ask(5, 30, 70, 41), [(41, 71, 0)], "batch 5 applied: the 30 go back to the limit");
    // Batch 8: 10 more units of A and a thousand reads of shard 3, in shard parts.
    let mut counters = vec![(A, 60_000, bucket, 10)];
    let reads: Vec<String> = (0..1000).map(|n| key_in_shard(3, n)).collect();
    counters.extend(reads.iter().map(|k| (k.as_str(), 60_000, bucket, 0)));
    let large = post(sync.port, &batch(proxy, 8, &counters));
    assert_eq!(large.status, 200, "{}", large.body);
    // A holds 81; the proxy's 10 units come off the limit (90): room 19 once they go back.
    assert_eq!(ask(8, 10, 90, 19), [(19, 100, 0)], "batch 8 applied on A's shard's part");
}

#[test]
fn refusals_name_the_field_and_touch_nothing() {
    let (redis, sync) = single();
    for (body, expected) in [
        (json!({"version": 1, "leases": [{"key": A, "window_ms": 1000, "bucket": 1, "elapsed_ms": 1000, "limit": 1, "want": 1}]}),
         "leases[0].elapsed_ms: must be below window_ms (1000), got 1000"),
        (json!({"version": 1, "leases": [{"key": A, "window_ms": 1000, "bucket": 1, "elapsed_ms": 0, "limit": 0, "want": 1}]}),
         "leases[0].limit: must be within 1..=4294967295, got 0"),
        (json!({"version": 1, "leases": {}}), "leases: invalid type: map, expected a sequence"),
    ] {
        let answer = request(sync.port, "POST", "/v1/lease", Some("application/json"), serde_json::to_vec(&body).unwrap(), false);
        assert_eq!(answer.status, 400, "{}", answer.body);
        let error = answer.json()["error"].as_str().unwrap().to_owned();
        assert!(error.starts_with(expected), "{error}");
    }
    let answer = request(sync.port, "GET", "/v1/lease", None, Bytes::new(), false);
    assert_eq!(answer.status, 405);
    let answer = request(sync.port, "POST", "/v1/lease", Some("text/plain"), Bytes::from_static(b"{}"), false);
    assert_eq!(answer.status, 415);
    assert_eq!(redis.dbsize(), 0);
    // Redis down: 503 within the timeout.
    drop(redis);
    let started = std::time::Instant::now();
    let answer = lease_call(sync.port, &[entry(A, 5, 0, 10, 1)]);
    assert_eq!(answer.status, 503, "{}", answer.body);
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}

/// Holders (`lease.lua`, "Holders"): a tracked holder's give-backs come off the counter only up
/// to what it holds; once the next bucket is `grace_ms` old, what a stopped holder still holds
/// comes back, and its late settlement takes nothing more.
#[test]
fn a_stopped_holders_units_come_back_once_the_grace_passed() {
    let (redis, sync) = single();
    // Redis's clock must also see the bucket 250 ms old before anything is taken back.
    while now_ms() % 60_000 < 1_000 {
        std::thread::sleep(Duration::from_millis(50));
    }
    let bucket = now_ms() / 60_000;
    let (live, dead) = ("00000000000000aa", "00000000000000dd");
    let tracked = |holder: &str, bucket: u64, elapsed_ms: u64, want: u64, fields: Value| {
        let mut e = entry(A, bucket, elapsed_ms, 1000, want);
        e["holder"] = json!(holder);
        for (name, value) in fields.as_object().unwrap() {
            e[name] = value.clone();
        }
        e
    };
    let ended = bucket - 1;
    let counter = format!("fg:{{1}}:{A}:60000:{ended}");
    let holders = format!("{counter}:h");
    // Each takes 100 units of the bucket that is about to end.
    for holder in [live, dead] {
        assert_eq!(grants(&lease_call(sync.port, &[tracked(holder, ended, 0, 100, json!({}))]))[0].0, 100);
    }
    assert_eq!(redis.hgetall(&holders), [(live.to_owned(), 100), (dead.to_owned(), 100)]);
    assert_eq!(redis.pexpiretime(&holders), redis.pexpiretime(&counter), "the holders expire with their counter");
    // The live one reports 30 used; a give-back beyond what it holds takes only what it holds.
    grants(&lease_call(sync.port, &[tracked(live, ended, 10, 0, json!({"used": 30}))]));
    assert_eq!(redis.hgetall(&holders), [(live.to_owned(), 70), (dead.to_owned(), 100)]);
    // The next bucket, 100 ms in (grace 250 ms): the live one settles, 60 back and 10 used.
    let settle = tracked(live, bucket, 100, 0, json!({"returned_previous": 60, "used_previous": 10, "grace_ms": 250}));
    assert_eq!(grants(&lease_call(sync.port, &[settle])), [(0, 0, 140)]);
    assert_eq!(redis.hgetall(&holders), [(dead.to_owned(), 100)], "the dead one's still weigh");
    // 250 ms in, the dead one's 100 come back; the live one's 40 used stay.
    let ask = tracked(live, bucket, 250, 1, json!({"grace_ms": 250}));
    assert_eq!(grants(&lease_call(sync.port, &[ask])), [(1, 1, 40)]);
    assert!(redis.hgetall(&holders).is_empty());
    assert_eq!(redis.get(&counter), Some(40));
    // The dead one's settlement arriving late takes nothing off.
    let late = tracked(dead, bucket, 300, 0, json!({"returned_previous": 100}));
    assert_eq!(grants(&lease_call(sync.port, &[late])), [(0, 1, 40)]);
    // A caller without a holder is not tracked: its give-backs come off the counter as before.
    let mut untracked = entry(A, bucket, 300, 1000, 0);
    untracked["returned_previous"] = json!(5);
    assert_eq!(grants(&lease_call(sync.port, &[untracked])), [(0, 1, 35)]);
    // A caller whose clock runs a bucket ahead takes nothing back: Redis's clock says the
    // grace of its bucket has not passed.
    let current_holders = format!("fg:{{1}}:{A}:60000:{bucket}:h");
    assert_eq!(redis.hgetall(&current_holders), [(live.to_owned(), 1)]);
    let ahead = tracked(dead, bucket + 1, 30_000, 1, json!({"grace_ms": 250}));
    assert_eq!(grants(&lease_call(sync.port, &[ahead]))[0].2, 1);
    assert_eq!(redis.hgetall(&current_holders), [(live.to_owned(), 1)]);
    // Units its waiting requests take at once count as used: nothing outstanding for them.
    let at_once = tracked(live, bucket, 30_000, 3, json!({"at_once": 2}));
    assert_eq!(grants(&lease_call(sync.port, &[at_once]))[0].0, 3);
    assert_eq!(redis.hgetall(&current_holders), [(live.to_owned(), 2)]);
    let metrics = get(sync.port, "/metrics").body;
    assert_eq!(metric(&metrics, "floodgate_sync_lease_units_reclaimed_total"), 100);
}

#[test]
fn refunds_take_units_counted_as_used_off_the_counter_not_off_the_holder() {
    let (redis, sync) = single();
    let bucket = now_ms() / 60_000;
    let holder = "00000000000000aa";
    let with = |mut entry: Value, fields: &[(&str, u64)]| {
        entry["holder"] = json!(holder);
        for (name, value) in fields {
            entry[*name] = json!(value);
        }
        entry
    };
    // The holder is granted 200 (previous bucket) and 200 (current), 100 of each taken at once.
    let previous_key = format!("fg:{{1}}:{A}:60000:{}", bucket - 1);
    redis.set(&previous_key, "200");
    let grant = with(entry(A, bucket, 0, 100_000, 200), &[("at_once", 100)]);
    assert_eq!(grants(&lease_call(sync.port, &[grant]))[0].0, 200);
    let current_key = format!("fg:{{1}}:{A}:60000:{bucket}");
    assert_eq!(redis.hgetall(&format!("{current_key}:h")), vec![(holder.to_string(), 100)]);
    // Of the 100 counted as used, 70 were not used (a reservation settled at 30): refunded.
    // The holder's 100 outstanding units stay its own (returned later, up to what it holds).
    let refund = with(entry(A, bucket, 0, 100_000, 0), &[("refunded", 70), ("refunded_previous", 150)]);
    assert_eq!(grants(&lease_call(sync.port, &[refund])), [(0, 130, 50)]);
    assert_eq!(redis.hgetall(&format!("{current_key}:h")), vec![(holder.to_string(), 100)]);
    let returned = with(entry(A, bucket, 0, 100_000, 0), &[("returned", 100), ("refunded", 1_000), ("refunded_previous", 1_000)]);
    assert_eq!(grants(&lease_call(sync.port, &[returned])), [(0, 0, 0)], "never below zero");
    // A refund of a counter that does not exist creates nothing.
    let absent = "00000002bbbbbbbbbbbbbbbbbbbbbbbb";
    let nothing = with(entry(absent, bucket, 0, 10, 0), &[("refunded", 5)]);
    assert_eq!(grants(&lease_call(sync.port, &[nothing])), [(0, 0, 0)]);
    assert_eq!(redis.get(&format!("fg:{{2}}:{absent}:60000:{bucket}")), None);
}

/// `GET /v1/holders`: each proxy that holds units of a key, with its units outstanding and when
/// its entry expires, for the current bucket and the one before; by the key and its window or
/// by the counter's key in the store; behind the same bearer token as the other `/v1/` routes.
#[test]
fn the_holders_endpoint_shows_each_proxy_s_units_and_expiry_behind_the_token() {
    const TOKEN: &str = "holders-token-0123456789";
    let redis = Redis::start(free_ports(1, false)[0], false);
    let sync = Sync::start(&["--redis", &redis.url(), "--redis-timeout", "500ms", "--token", TOKEN]);
    let bearer = format!("Bearer {TOKEN}");
    let call = |method: &str, path: &str, body: Vec<u8>, token: Option<&str>| {
        let mut headers = vec![("content-type", "application/json")];
        if let Some(token) = token {
            headers.push(("authorization", token));
        }
        request_with(sync.port, method, path, &headers, body, false)
    };
    let bucket = now_ms() / 60_000;
    let holders = ["00000000000000a1", "00000000000000b2", "00000000000000c3"];
    for (at, holder) in holders.iter().enumerate() {
        let mut e = entry(A, bucket, 0, 1_000, 10 * (at as u64 + 1));
        e["holder"] = json!(holder);
        let body = serde_json::to_vec(&json!({"version": 1, "leases": [e]})).unwrap();
        let answer = call("POST", "/v1/lease", body, Some(&bearer));
        assert_eq!(answer.status, 200, "{}", answer.body);
    }
    let path = format!("/v1/holders?key={A}&window_ms=60000");
    assert_eq!(call("GET", &path, Vec::new(), None).status, 401, "the token is needed");
    assert_eq!(call("GET", &path, Vec::new(), Some("Bearer wrong")).status, 403);
    assert_eq!(call("POST", &path, Vec::new(), Some(&bearer)).status, 405);
    let answer = call("GET", &path, Vec::new(), Some(&bearer));
    assert_eq!(answer.status, 200, "{}", answer.body);
    let body = answer.json();
    println!("{body}");
    let counter = format!("fg:{{1}}:{A}:60000:{bucket}");
    assert_eq!(body["key"], A);
    assert_eq!(body["buckets"][0]["bucket"], bucket);
    assert_eq!(body["buckets"][0]["counter"], counter.as_str());
    assert_eq!(body["buckets"][0]["count"], redis.get(&counter).unwrap());
    let listed: Vec<(String, u64)> = body["buckets"][0]["holders"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| (h["holder"].as_str().unwrap().to_owned(), h["units"].as_u64().unwrap()))
        .collect();
    let mut stored = redis.hgetall(&format!("{counter}:h"));
    stored.sort_by_key(|h| std::cmp::Reverse(h.1));
    assert_eq!(listed.len(), 3, "one entry per holder: {body}");
    assert_eq!(listed, stored, "each holder's units, most first");
    let expiry = redis.pexpiretime(&format!("{counter}:h")) as u64;
    for h in body["buckets"][0]["holders"].as_array().unwrap() {
        let at = h["expires_at_ms"].as_u64().unwrap();
        assert!(at.abs_diff(expiry) < 2_000, "{at} vs PEXPIRETIME {expiry}");
    }
    assert_eq!(body["buckets"][1]["bucket"], bucket - 1);
    assert_eq!(body["buckets"][1]["holders"], json!([]), "nothing held in the bucket before");
    // The counter's key as the store lists it names the same.
    let by_counter = call("GET", &format!("/v1/holders?key={}", counter.replace('{', "%7B").replace('}', "%7D")), Vec::new(), Some(&bearer));
    let units = |body: &Value| -> Vec<(u64, String, u64)> {
        let buckets = body["buckets"].as_array().unwrap().iter();
        buckets
            .flat_map(|b| b["holders"].as_array().unwrap().iter().map(move |h| (b["bucket"].as_u64().unwrap(), h["holder"].to_string(), h["units"].as_u64().unwrap())))
            .collect()
    };
    assert_eq!(units(&by_counter.json()), units(&body));
    let bad = call("GET", "/v1/holders?key=tenant-a", Vec::new(), Some(&bearer));
    assert_eq!(bad.status, 400);
    assert!(bad.body.contains("key: expected 32 lowercase hex"), "{}", bad.body);
}

/// `--replica-acks 1`: a lease is answered once a replica has its writes (WAIT, in the script's
/// round trip), so a master that fails over cannot have granted units its replica never saw.
/// A replica that hangs makes the call fail (503, naming the flag) where a service without the
/// flag answers; once it wakes, the grant is on the replica as the answer arrives. The first
/// call finds no script cached (NOSCRIPT, then EVAL with its WAIT).
#[test]
fn with_replica_acks_a_lease_is_answered_once_a_replica_has_its_writes() {
    let ports = free_ports(2, false);
    let master = Redis::start(ports[0], false);
    let replica = Redis::start_with(ports[1], &["--replicaof".into(), "127.0.0.1".into(), ports[0].to_string()], &[]);
    wait_until("the replica in sync", Duration::from_secs(10), || {
        replica.cli(&["INFO", "replication"]).is_ok_and(|info| info.contains("master_link_status:up"))
    });
    let acked = Sync::start(&["--redis", &master.url(), "--redis-timeout", "400ms", "--replica-acks", "1"]);
    let plain = Sync::start(&["--redis", &master.url(), "--redis-timeout", "400ms"]);
    let bucket = now_ms() / 60_000;
    let counter = format!("fg:{{1}}:{A}:60000:{bucket}");
    let ask = |want: u64| [entry(A, bucket, 0, 1000, want)];

    master.cli(&["SCRIPT", "FLUSH"]).unwrap();
    assert_eq!(grants(&lease_call(acked.port, &ask(10)))[0].0, 10);
    assert_eq!(replica.get(&counter), Some(10), "the grant is on the replica as it is answered");

    replica.signal("-STOP");
    let started = std::time::Instant::now();
    let refused = lease_call(acked.port, &ask(5));
    let took = started.elapsed();
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert!(took < Duration::from_millis(1500), "answered within --redis-timeout: {took:?}");
    assert_eq!(grants(&lease_call(plain.port, &ask(5)))[0].0, 5, "without the flag, the master's answer is enough");
    replica.signal("-CONT");

    assert_eq!(grants(&lease_call(acked.port, &ask(5)))[0], (5, 25, 0), "the unacknowledged units stay counted");
    assert_eq!(replica.get(&counter), Some(25));
    let log = acked.log();
    assert!(log.contains("acknowledged by 0 of 1 replicas"), "{log}");
}
