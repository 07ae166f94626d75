//! floodgate-sync against a real Redis Cluster: 3 masters and 3 replicas on 127.0.0.1, made
//! with `redis-cli --cluster create`. Counters spread over the masters; a master killed with
//! SIGKILL mid-run: the batch is retried until its replica takes over, and the totals afterwards
//! count every batch exactly once.
#![allow(
    missing_docs,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing,
    clippy::arithmetic_side_effects
)]

mod common;

use std::collections::HashMap;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const P1: &str = "0123456789abcdef";

/// Six cluster-enabled nodes joined into 3 masters with one replica each, every node agreeing
/// that the cluster is ok.
fn cluster() -> Vec<Redis> {
    let ports = free_ports(6, true);
    let nodes: Vec<Redis> = ports.iter().map(|&port| Redis::start(port, true)).collect();
    let addresses: Vec<String> = ports
        .iter()
        .map(|port| format!("127.0.0.1:{port}"))
        .collect();
    let output = Command::new(redis_cli_bin())
        .args(["--cluster", "create"])
        .args(&addresses)
        .args(["--cluster-replicas", "1", "--cluster-yes"])
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "redis-cli --cluster create: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    wait_until(
        "every node to see cluster_state:ok and 3 replicas in sync",
        Duration::from_secs(30),
        || nodes.iter().all(|node| node.info_cluster_ok()) && replicas_in_sync(&nodes),
    );
    nodes
}

trait ClusterNode {
    fn info_cluster_ok(&self) -> bool;
    fn role(&self) -> Option<String>;
}

impl ClusterNode for Redis {
    fn info_cluster_ok(&self) -> bool {
        self.cli(&["CLUSTER", "INFO"])
            .map(|out| out.contains("cluster_state:ok"))
            .unwrap_or(false)
    }

    fn role(&self) -> Option<String> {
        self.cli(&["ROLE"])
            .ok()
            .and_then(|out| out.lines().next().map(str::to_string))
    }
}

/// Every live master's replication offset is reached by a connected replica.
fn replicas_in_sync(nodes: &[Redis]) -> bool {
    let masters: Vec<&Redis> = nodes
        .iter()
        .filter(|n| n.role().as_deref() == Some("master"))
        .collect();
    if masters.len() != 3 {
        return false;
    }
    masters.iter().all(|master| {
        let Ok(info) = master.cli(&["INFO", "replication"]) else {
            return false;
        };
        let fields: HashMap<&str, &str> = info
            .lines()
            .filter_map(|l| l.trim().split_once(':'))
            .collect();
        let offset = fields.get("master_repl_offset").copied().unwrap_or("");
        fields.iter().any(|(k, v)| {
            k.starts_with("slave")
                && v.contains("state=online")
                && v.contains(&format!("offset={offset},"))
        })
    })
}

fn masters(nodes: &[Redis]) -> Vec<&Redis> {
    nodes
        .iter()
        .filter(|n| n.role().as_deref() == Some("master"))
        .collect()
}

fn evalsha_calls(nodes: &[&Redis]) -> u64 {
    nodes
        .iter()
        .map(|n| n.command_calls("evalsha") + n.command_calls("eval"))
        .sum()
}

#[test]
fn a_cluster_spreads_shards_and_survives_a_master_failover() {
    let mut nodes = cluster();
    let seeds: Vec<String> = nodes[..3].iter().map(Redis::url).collect();
    let sync = Sync::start(&[
        "--cluster",
        "--redis",
        &seeds.join(","),
        "--redis-timeout",
        "1s",
    ]);
    wait_until("/readyz", Duration::from_secs(10), || {
        get(sync.port, "/readyz").status == 200
    });

    // Leases: a key of every shard granted its limit of 5 exactly, each key's counter (with
    // its previous bucket's) on one slot.
    let lease_bucket = now_ms() / 60_000;
    for shard in 0..16 {
        let key = key_in_shard(shard, 1000 + shard);
        let mut granted = 0;
        for _ in 0..10 {
            let answer = request(
                sync.port,
                "POST",
                "/v1/lease",
                Some("application/json"),
                serde_json::to_vec(&serde_json::json!({"version": 1, "leases": [
                    {"key": key, "window_ms": 60_000, "bucket": lease_bucket, "elapsed_ms": 0, "limit": 5, "want": 2}
                ]}))
                .unwrap(),
                false,
            );
            assert_eq!(answer.status, 200, "{}", answer.body);
            granted += answer.json()["leases"][0]["granted"].as_u64().unwrap();
        }
        assert_eq!(granted, 5, "shard {shard}");
    }

    // 100 keys over the 16 shards, 60 s windows; every batch adds 1 to each.
    let bucket = now_ms() / 60_000;
    let keys: Vec<String> = (0..100).map(|n| key_in_shard(n % 16, n)).collect();
    let counters: Vec<(&str, u64, u64, u64)> = keys
        .iter()
        .map(|k| (k.as_str(), 60_000, bucket, 1))
        .collect();
    let mut seq = 1u64;
    assert!(post(sync.port, &batch(P1, seq, &counters))
        .totals()
        .iter()
        .all(|&(_, c)| c == 1));

    // The shards' hash tags spread the counters over every master.
    let live = masters(&nodes);
    let sizes: Vec<u64> = live.iter().map(|m| m.dbsize()).collect();
    assert!(sizes.iter().all(|&n| n > 0), "keys per master: {sizes:?}");
    assert_eq!(
        sizes.iter().sum::<u64>(),
        100 + 16 + 16 + 1,
        "100 counters, 16 dedup keys, the 16 leased keys' counters and the second's HyperLogLog of proxies"
    );
    // In a cluster each shard keeps its own dedup hash, on its slot (`fg:{s}:seen:...`).
    let mut dedup: Vec<String> = live.iter().flat_map(|m| m.keys()).filter(|k| k.contains(":seen:")).collect();
    dedup.sort();
    dedup.dedup_by_key(|k| k.split(':').nth(1).map(str::to_owned));
    assert_eq!(dedup.len(), 16, "{dedup:?}");
    assert!(dedup.iter().all(|k| k.starts_with("fg:{")), "{dedup:?}");

    // Redis commands per batch: one script call per shard present (16), NOSCRIPT paid once.
    let before = evalsha_calls(&live);
    let batches = 10;
    for _ in 0..batches {
        seq += 1;
        let totals = post(sync.port, &batch(P1, seq, &counters)).totals();
        assert!(totals.iter().all(|&(_, c)| c == seq), "{totals:?}");
    }
    let per_batch = (evalsha_calls(&live) - before) as f64 / batches as f64;
    eprintln!("cluster, 100 keys over 16 shards on 3 masters: {per_batch} script calls (EVALSHA) per batch");
    assert_eq!(per_batch, 16.0);

    // Kill the master of shard 1's slot with SIGKILL once its replica has every write.
    wait_until("replicas in sync", Duration::from_secs(10), || {
        replicas_in_sync(&nodes)
    });
    let victim = key_in_shard(1, 1);
    let victim_key = format!("fg:{{1}}:{victim}:60000:{bucket}");
    let slot_owner = nodes
        .iter()
        .position(|n| {
            n.role().as_deref() == Some("master") && n.conn_get_local(&victim_key).is_some()
        })
        .expect("a master holds shard 1");
    let killed_port = nodes[slot_owner].port;
    nodes[slot_owner].kill();
    let killed_at = Instant::now();

    // The next batch: 503 while the master is gone (the other shards are applied already), then
    // retried, the same (proxy, seq), until the replica has taken over.
    seq += 1;
    let body = batch(P1, seq, &counters);
    let mut unavailable = 0;
    let answer = loop {
        let answer = post(sync.port, &body);
        if answer.status == 200 {
            break answer;
        }
        assert_eq!(answer.status, 503, "{}", answer.body);
        unavailable += 1;
        assert!(
            killed_at.elapsed() < Duration::from_secs(30),
            "no failover within 30 s: {}",
            answer.body
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!(
        "master on port {killed_port} killed: {unavailable} answers 503, then 200 after {:?}",
        killed_at.elapsed()
    );
    assert!(
        unavailable > 0,
        "the batch right after the kill cannot have reached the dead master"
    );
    // Usually the first attempt applied the shards of the live masters (10 or 12 of the 16)
    // and the retry that succeeded only read those and applied the dead master's: the shard
    // parts applied never exceed 16 per batch.
    let metrics = get(sync.port, "/metrics").body;
    let parts = |result: &str| {
        metric(
            &metrics,
            &format!("floodgate_sync_shard_parts_total{{result=\"{result}\"}}"),
        )
    };
    eprintln!(
        "shard parts after the failover: {} applied, {} deduplicated (by the retry)",
        parts("applied"),
        parts("deduplicated")
    );
    assert!(parts("applied") <= 16 * seq);
    // Exactly once: every counter holds one per batch, whether its shard was applied by the
    // first attempt or by the retry.
    let totals = answer.totals();
    assert!(totals.iter().all(|&(_, c)| c == seq), "{totals:?}");
    // Retrying once more, and a new batch, still count exactly.
    assert!(post(sync.port, &body)
        .totals()
        .iter()
        .all(|&(_, c)| c == seq));
    seq += 1;
    assert!(post(sync.port, &batch(P1, seq, &counters))
        .totals()
        .iter()
        .all(|&(_, c)| c == seq));
    let metrics = get(sync.port, "/metrics").body;
    assert!(
        metric(&metrics, "floodgate_sync_batches_deduplicated_total") >= 2,
        "{metrics}"
    );

    // /readyz: every node answers PING again once the dead one has left the slot map (it is
    // still down); in any case it must not hang.
    let ready = get(sync.port, "/readyz");
    assert!(ready.status == 200 || ready.status == 503, "{}", ready.body);
    eprintln!(
        "/readyz after the failover: {} {}",
        ready.status, ready.body
    );
    // One line per Redis error at most once a second, not the client's own chatter.
    let lines = sync.log().lines().count();
    assert!(lines < 12, "{}", sync.log());
}

trait LocalGet {
    fn conn_get_local(&self, key: &str) -> Option<u64>;
}

impl LocalGet for Redis {
    /// GET on this node only (None when the key lives elsewhere: MOVED).
    fn conn_get_local(&self, key: &str) -> Option<u64> {
        redis::cmd("GET")
            .arg(key)
            .query::<Option<u64>>(&mut self.conn())
            .ok()
            .flatten()
    }
}

