//! The fleet tool's store: a Redis Cluster of 3 masters and 3 replicas and two `floodgate-sync`
//! replicas in front of it, on 127.0.0.1 ([`crate::services`]), and what they have done so far
//! (Redis's commands and bytes, summed over the masters; CPU time of every process).

use crate::envoy::cpu_ns_of;
use crate::services::{RedisCluster, Sync};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// Masters of the cluster.
const MASTERS: usize = 3;
/// `floodgate-sync` replicas.
pub const SYNC_REPLICAS: usize = 2;

/// The cluster and the replicas.
pub struct Stack {
    /// The cluster.
    pub cluster: RedisCluster,
    /// The replicas.
    pub syncs: Vec<Sync>,
}

/// What the store had done at one moment.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Per node: commands executed (`INFO commandstats`, `INFO`/`PING` left out), bytes in and
    /// out (`INFO stats`), and whether it was a master.
    nodes: Vec<(u64, u64, bool)>,
    /// Per node: calls per command (`INFO commandstats`).
    by_name: Vec<BTreeMap<String, u64>>,
    /// CPU time of every Redis node, ns, by pid.
    redis_cpu_ns: Vec<(u32, u64)>,
    /// CPU time of the `floodgate-sync` replicas, ns, by pid.
    sync_cpu_ns: Vec<(u32, u64)>,
    /// CPU time of this tool, ns.
    pub tool_cpu_ns: u64,
    /// Per replica: the calls it answered so far on `/v1/sync` and on `/v1/lease` (its
    /// `/metrics`: the count of each route's duration histogram).
    sync_calls: Vec<(u64, u64)>,
}

/// What the store did between two snapshots.
#[derive(Clone, Debug, Default)]
pub struct Spent {
    /// Redis commands on the masters.
    pub commands: u64,
    /// The same per command (`evalsha`, `get`, ...), those inside scripts included.
    pub by_name: BTreeMap<String, u64>,
    /// Redis bytes in and out on the masters.
    pub bytes: u64,
    /// CPU of the Redis nodes, ns.
    pub redis_cpu_ns: u64,
    /// CPU of the replicas, ns.
    pub sync_cpu_ns: u64,
    /// CPU of the tool, ns.
    pub tool_cpu_ns: u64,
    /// Calls the replicas answered on `/v1/sync` (batches).
    pub sync_batches: u64,
    /// Calls the replicas answered on `/v1/lease` (asks of batched keys, lease calls).
    pub sync_leases: u64,
}

impl Stack {
    /// Starts the cluster and the replicas (`--cluster`, every node a seed, `--replica-acks`
    /// `replica_acks`).
    pub fn start(redis: &Path, sync: &Path, replica_acks: u32) -> Result<Stack, String> {
        let cluster = RedisCluster::start(redis, MASTERS, 1)?;
        let seeds = cluster.urls().join(",");
        let acks = replica_acks.to_string();
        let syncs = (0..SYNC_REPLICAS)
            .map(|_| Sync::start_with(sync, &["--cluster", "--redis", &seeds, "--redis-timeout", "500ms", "--replica-acks", &acks]))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Stack { cluster, syncs })
    }

    /// The replicas' addresses.
    pub fn addrs(&self) -> Vec<std::net::SocketAddr> {
        self.syncs.iter().map(|s| s.addr).collect()
    }

    /// What the store has done so far.
    pub fn snapshot(&self) -> Snapshot {
        let masters = self.cluster.masters();
        let nodes = self
            .cluster
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| {
                let commands = n.counts().map_or(0, |c| c.commands);
                let bytes = n.command("INFO stats").map_or(0, |info| field(&info, "total_net_input_bytes") + field(&info, "total_net_output_bytes"));
                (commands, bytes, masters.contains(&i))
            })
            .collect();
        let by_name = self.cluster.nodes.iter().map(|n| n.calls_by_name().unwrap_or_default()).collect();
        Snapshot {
            nodes,
            by_name,
            redis_cpu_ns: self.cluster.nodes.iter().filter_map(|n| n.pid()).map(|p| (p, cpu_ns_of(p))).collect(),
            sync_cpu_ns: self.syncs.iter().map(|s| s.pid()).filter(|&p| p > 0).map(|p| (p, cpu_ns_of(p))).collect(),
            tool_cpu_ns: cpu_ns_of(std::process::id()),
            sync_calls: self
                .syncs
                .iter()
                .map(|s| {
                    let text = crate::envoy::http_get(s.addr, "/metrics").map(|(_, body)| body).unwrap_or_default();
                    (metric(&text, "floodgate_sync_request_duration_seconds_count"), metric(&text, "floodgate_sync_lease_duration_seconds_count"))
                })
                .collect(),
        }
    }

    /// Empties the store (`FLUSHALL` on every master; the replicas follow): a run that follows
    /// starts from nothing, as the one before it did, and may use the same keys.
    pub fn flush(&self) -> Result<(), String> {
        for m in self.cluster.masters() {
            self.cluster.nodes[m].command("FLUSHALL")?;
        }
        Ok(())
    }

    /// Kills a master (SIGKILL) and waits (at most 10 s) until its replica took over.
    pub fn fail_a_master(&mut self) -> Result<Duration, String> {
        let started = std::time::Instant::now();
        let master = *self.cluster.masters().first().ok_or("no master")?;
        self.cluster.nodes[master].kill();
        std::thread::sleep(Duration::from_millis(200));
        self.cluster.wait_ok(Duration::from_secs(10))?;
        Ok(started.elapsed())
    }
}

/// What the store did from `before` to `after` (Redis's counts on the nodes that were masters at
/// either moment; a node or replica killed meanwhile counts for nothing, a new one from its start).
pub fn spent(before: &Snapshot, after: &Snapshot) -> Spent {
    let mut s = Spent {
        redis_cpu_ns: cpu_since(&before.redis_cpu_ns, &after.redis_cpu_ns),
        sync_cpu_ns: cpu_since(&before.sync_cpu_ns, &after.sync_cpu_ns),
        tool_cpu_ns: after.tool_cpu_ns.saturating_sub(before.tool_cpu_ns),
        ..Spent::default()
    };
    for (b, a) in before.sync_calls.iter().zip(&after.sync_calls) {
        s.sync_batches += a.0.saturating_sub(b.0);
        s.sync_leases += a.1.saturating_sub(b.1);
    }
    for (i, (b, a)) in before.nodes.iter().zip(&after.nodes).enumerate() {
        if (b.2 || a.2) && a.0 >= b.0 {
            s.commands += a.0 - b.0;
            s.bytes += a.1.saturating_sub(b.1);
            let empty = BTreeMap::new();
            let (nb, na) = (before.by_name.get(i).unwrap_or(&empty), after.by_name.get(i).unwrap_or(&empty));
            for (name, calls) in na {
                let since = calls.saturating_sub(nb.get(name).copied().unwrap_or(0));
                if since > 0 {
                    *s.by_name.entry(name.clone()).or_default() += since;
                }
            }
        }
    }
    s
}

/// The CPU time the processes of `after` used since `before` (a process started meanwhile: all
/// of its time; one that ended meanwhile, killed by an event, is not counted).
fn cpu_since(before: &[(u32, u64)], after: &[(u32, u64)]) -> u64 {
    after.iter().map(|(pid, ns)| ns.saturating_sub(before.iter().find(|(p, _)| p == pid).map_or(0, |(_, b)| *b))).sum()
}

/// A numeric field of an `INFO` section.
fn field(info: &str, name: &str) -> u64 {
    info.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')?.trim().parse().ok()).unwrap_or(0)
}

/// A metric without labels from Prometheus text (0 when absent).
pub fn metric(text: &str, name: &str) -> u64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

#[cfg(test)]
mod tests {
    use super::{cpu_since, metric};

    #[test]
    fn a_metric_by_its_exact_name() {
        let text = "# TYPE x_count counter\nx_sum 3.5\nx_count 12\nx_count_other 7\ny{a=\"b\"} 4\n";
        assert_eq!(metric(text, "x_count"), 12);
        assert_eq!(metric(text, "x_sum"), 3);
        assert_eq!(metric(text, "y"), 0, "labelled series are not read");
        assert_eq!(metric(text, "z"), 0);
    }

    #[test]
    fn cpu_of_processes_replaced_meanwhile() {
        // 7 kept running, 8 was killed, 9 started meanwhile.
        assert_eq!(cpu_since(&[(7, 100), (8, 50)], &[(7, 130), (9, 20)]), 30 + 20);
    }
}
