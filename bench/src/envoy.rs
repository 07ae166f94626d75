//! Envoy for the benchmark: bootstraps for each variant (no filter, native `local_ratelimit`, a
//! wasm module with a configuration), started through `floodgate-harness` with
//! `--disable-hot-restart`, pinned with `taskset`, listening on 127.0.0.1 ports picked at run
//! time; its CPU time, RSS and stats.

use floodgate_harness::bootstrap::{endpoint, http2_protocol_options, router, static_cluster, wasm_filter};
use floodgate_harness::{Launch, Running, Spawned, Wait};
use serde_json::{json, Value};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use floodgate_harness::http_get;
pub use floodgate_harness::launch::cpu_ns_of;

/// The filter chain in front of the router.
#[derive(Clone, Debug)]
pub enum Filter {
    /// Nothing but the router.
    None,
    /// Envoy's `envoy.filters.http.local_ratelimit`, one token bucket large enough to admit
    /// everything (the check is still made per request).
    NativeLocalRateLimit,
    /// `envoy.filters.http.wasm` with this module and configuration string.
    Wasm { module: PathBuf, config: String },
}

/// The Envoy cluster of `floodgate-sync` (see [`Spec::services`]).
pub const SYNC_CLUSTER: &str = "floodgate-sync";

/// The Envoy cluster of Limitador's gRPC rate limit service (see [`Spec::services`]).
pub const LIMITADOR_CLUSTER: &str = "limitador";

/// How the route picks its cluster.
#[derive(Clone, Debug)]
pub enum Route {
    /// Every request to cluster `a`.
    Fixed,
    /// `cluster_header: <header>` over clusters `a`, `b`, `c` (floodgate's cluster selection).
    ClusterHeader(String),
}

/// An Envoy to start.
#[derive(Clone, Debug)]
pub struct Spec {
    /// Filter chain.
    pub filter: Filter,
    /// Route.
    pub route: Route,
    /// Upstream of each cluster `a`, `b`, `c`.
    pub clusters: [SocketAddr; 3],
    /// The clusters speak HTTP/2 without TLS (gRPC upstreams) instead of HTTP/1.1.
    pub http2: bool,
    /// Worker threads.
    pub concurrency: usize,
    /// CPUs the process may run on (`taskset -c` list).
    pub cpus: String,
    /// A command Envoy runs under (e.g. valgrind and its options); empty for none.
    pub wrapper: Vec<String>,
    /// The limiter services the module calls, as HTTP/2 clusters by name: `floodgate-sync`
    /// ([`SYNC_CLUSTER`]), which a configuration's `global.cluster` names, or Limitador
    /// ([`LIMITADOR_CLUSTER`]) for Kuadrant's wasm-shim.
    pub services: Vec<(&'static str, SocketAddr)>,
}

impl Spec {
    /// The bootstrap (JSON, which Envoy reads as YAML).
    pub fn bootstrap(&self) -> Value {
        let mut filters = Vec::new();
        match &self.filter {
            Filter::None => {}
            Filter::NativeLocalRateLimit => filters.push(json!({
                "name": "envoy.filters.http.local_ratelimit",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit",
                    "stat_prefix": "native_local_rate_limit",
                    "token_bucket": {"max_tokens": 1_000_000_000u64, "tokens_per_fill": 1_000_000_000u64, "fill_interval": "60s"},
                    "filter_enabled": {"runtime_key": "local_rate_limit_enabled", "default_value": {"numerator": 100, "denominator": "HUNDRED"}},
                    "filter_enforced": {"runtime_key": "local_rate_limit_enforced", "default_value": {"numerator": 100, "denominator": "HUNDRED"}}
                }
            })),
            Filter::Wasm { module, config } => filters.push(wasm_filter(module, config)),
        }
        filters.push(router());
        let route = match &self.route {
            Route::Fixed => json!({"cluster": "a", "timeout": "30s"}),
            Route::ClusterHeader(header) => json!({"cluster_header": header, "timeout": "30s"}),
        };
        let mut clusters: Vec<Value> = ["a", "b", "c"]
            .iter()
            .zip(self.clusters)
            .map(|(name, addr)| {
                let mut cluster = static_cluster(name, vec![endpoint(addr)]);
                if self.http2 {
                    cluster["typed_extension_protocol_options"] = http2_protocol_options();
                }
                cluster
            })
            .collect();
        for &(name, addr) in &self.services {
            clusters.push(json!({
                "name": name,
                "type": "STATIC",
                "connect_timeout": "1s",
                "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [endpoint(addr)]}]},
                "typed_extension_protocol_options": http2_protocol_options()
            }));
        }
        json!({
            "admin": floodgate_harness::bootstrap::admin(),
            "static_resources": {
                "listeners": [{
                    "name": "front",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "filter_chains": [{"filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "front",
                            "route_config": {"name": "front", "virtual_hosts": [{
                                "name": "all", "domains": ["*"],
                                "routes": [{"match": {"prefix": "/"}, "route": route}]
                            }]},
                            "http_filters": filters
                        }
                    }]}]
                }],
                "clusters": clusters
            }
        })
    }

    /// Starts Envoy and waits (at most 60 s) until it is ready. `Err` carries the end of its log
    /// (e.g. a configuration the module refused).
    pub fn start(&self, envoy: &Path) -> Result<Envoy, String> {
        self.spawn(envoy)?.wait_ready(Duration::from_secs(60))
    }

    /// Starts Envoy without waiting for it.
    pub fn spawn(&self, envoy: &Path) -> Result<Starting, String> {
        let bootstrap = self.bootstrap().to_string();
        let launch = Launch::new(envoy)
            .wrapper(["taskset", "-c", self.cpus.as_str()])
            .wrapper(&self.wrapper)
            .concurrency(self.concurrency)
            .log_level("warn")
            .dir_prefix("floodgate-bench-");
        Ok(Starting(launch.spawn_with(move || bootstrap.clone())?))
    }
}

/// An Envoy [`Spec::spawn`] started, not yet known to be ready.
pub struct Starting(Spawned<'static>);

impl Starting {
    /// Waits (at most `timeout`) until it is ready.
    pub fn wait_ready(self, timeout: Duration) -> Result<Envoy, String> {
        Ok(Envoy(self.0.wait_ready_within(Wait::For(timeout))?))
    }

    /// Waits until it is ready for as long as it works towards it: it fails when the process has
    /// used no CPU time for `stall`, or after `cap` in all ([`Wait::WhileWorking`]: an Envoy under
    /// valgrind).
    pub fn wait_ready_while_working(self, stall: Duration, cap: Duration) -> Result<Envoy, String> {
        Ok(Envoy(self.0.wait_ready_within(Wait::WhileWorking { stall, cap })?))
    }
}

/// A running Envoy; killed when dropped.
pub struct Envoy(Running);

impl Envoy {
    /// The listener.
    pub fn addr(&self) -> SocketAddr {
        self.0.listener("front").expect("listener")
    }

    /// Its process id.
    pub fn pid(&self) -> u32 {
        self.0.pid()
    }

    /// Its temporary directory (bootstrap, log, profiles).
    pub fn dir(&self) -> &Path {
        self.0.dir()
    }

    /// Resident set size in bytes (`VmRSS`).
    pub fn rss_bytes(&self) -> u64 {
        floodgate_harness::launch::rss_bytes_of(self.pid()).unwrap_or(0)
    }

    /// GET on the admin API.
    pub fn admin_get(&self, path: &str) -> Result<(u16, String), String> {
        http_get(self.0.admin().ok_or("no admin address")?, path)
    }

    /// A counter or gauge of `/stats` by full name (e.g. `wasmcustom.floodgate...`).
    pub fn stat(&self, name: &str) -> Option<u64> {
        let (_, body) = self.admin_get(&format!("/stats?filter=^{}$", name.replace('.', "\\."))).ok()?;
        body.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(": ")?.trim().parse().ok())
    }

    /// The last `n` lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        self.0.log_tail(n)
    }
}

/// What the kernel counted for process `pid` so far: CPU time split into user and system
/// (`/proc/<pid>/stat`, all threads, in clock ticks of 10 ms: Linux's `USER_HZ` is 100), page
/// faults, and context switches summed over its threads (`/proc/<pid>/task/<tid>/status`).
/// Where CPU time goes that instruction counts leave out: the kernel, and waiting.
#[derive(Clone, Copy, Debug, Default)]
pub struct KernelCounts {
    /// User-mode CPU time, in nanoseconds (10 ms resolution).
    pub user_ns: u64,
    /// Kernel-mode CPU time, in nanoseconds (10 ms resolution).
    pub system_ns: u64,
    /// Minor page faults (no disk read).
    pub minor_faults: u64,
    /// Context switches, voluntary (the thread waited) and involuntary (it was preempted).
    pub context_switches: u64,
}

impl KernelCounts {
    /// Process `pid`'s counts now (zeros for what cannot be read).
    pub fn of(pid: u32) -> KernelCounts {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let context_switches = std::fs::read_dir(format!("/proc/{pid}/task"))
            .map(|tasks| {
                tasks
                    .flatten()
                    .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
                    .flat_map(|status| {
                        status
                            .lines()
                            .filter(|l| l.starts_with("voluntary_ctxt_switches:") || l.starts_with("nonvoluntary_ctxt_switches:"))
                            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                            .collect::<Vec<_>>()
                    })
                    .sum()
            })
            .unwrap_or(0);
        KernelCounts { context_switches, ..KernelCounts::from_stat(&stat) }
    }

    /// Times and faults from the text of `/proc/<pid>/stat` (context switches left at 0).
    fn from_stat(stat: &str) -> KernelCounts {
        const NS_PER_TICK: u64 = 10_000_000;
        // The fields after the command name, which is in parentheses and may hold spaces.
        let fields: Vec<u64> = stat
            .rsplit_once(')')
            .map_or("", |(_, rest)| rest)
            .split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .collect();
        // proc(5) numbers them from 1 with the pid; here index 0 is field 3 (state).
        let field = |n: usize| fields.get(n - 3).copied().unwrap_or(0);
        KernelCounts {
            user_ns: field(14) * NS_PER_TICK,
            system_ns: field(15) * NS_PER_TICK,
            minor_faults: field(10),
            context_switches: 0,
        }
    }

    /// The counts from `earlier` to `self`.
    pub fn since(&self, earlier: &KernelCounts) -> KernelCounts {
        KernelCounts {
            user_ns: self.user_ns.saturating_sub(earlier.user_ns),
            system_ns: self.system_ns.saturating_sub(earlier.system_ns),
            minor_faults: self.minor_faults.saturating_sub(earlier.minor_faults),
            context_switches: self.context_switches.saturating_sub(earlier.context_switches),
        }
    }
}

/// CPU time used by the whole machine so far (all CPUs, busy time only), in nanoseconds, from
/// `/proc/stat` (10 ms resolution).
pub fn machine_busy_ns() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(line) = stat.lines().next() else { return 0 };
    let fields: Vec<u64> = line.split_whitespace().skip(1).filter_map(|f| f.parse().ok()).collect();
    // user nice system idle iowait irq softirq steal guest guest_nice
    let busy: u64 = fields.iter().enumerate().filter(|(i, _)| ![3, 4, 8, 9].contains(i)).map(|(_, v)| v).sum();
    busy * 10_000_000
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic)]
mod tests {
    use super::KernelCounts;

    #[test]
    fn kernel_counts_read_the_fields_after_a_command_name_with_spaces_and_parentheses() {
        // pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime ...
        let stat = "4242 (envoy (main) x) S 1 4242 4242 0 -1 4194560 1234 0 5 0 250 75 0 0 20 0 14 0";
        let counts = KernelCounts::from_stat(stat);
        assert_eq!(counts.minor_faults, 1234);
        assert_eq!(counts.user_ns, 2_500_000_000);
        assert_eq!(counts.system_ns, 750_000_000);
        assert_eq!(KernelCounts::from_stat("").user_ns, 0);
    }

    #[test]
    fn kernel_counts_of_this_process_count_its_threads_switches_and_move_forward() {
        let before = KernelCounts::of(std::process::id());
        std::thread::sleep(std::time::Duration::from_millis(20));
        let after = KernelCounts::of(std::process::id());
        // Sleeping is a voluntary context switch.
        assert!(after.since(&before).context_switches >= 1, "{before:?} -> {after:?}");
    }
}
