//! A real Envoy whose floodgate filter configuration is delivered dynamically, from a file, so a
//! test can change it while Envoy runs: the listener's Wasm filter is an ECDS filter
//! (`config_discovery` with a `path_config_source`), and [`DynamicEnvoy::deliver`] writes a new
//! `TypedExtensionConfig` to a temporary file and renames it over the watched one (an atomic
//! move, which Envoy's file watcher picks up), then waits until Envoy has taken it or refused it.
//!
//! This is how Istio delivers a `WasmPlugin` (ECDS), so it exercises the same update path:
//! - a new plugin configuration with the same VM configuration keeps the VMs (a new root context
//!   in each) and, with them, the shared data;
//! - a new VM configuration ([`FilterVersion::vm_generation`]) makes Envoy create new VMs; the
//!   shared data lives on (same `vm_id`).
//!
//! With [`DynamicEnvoyBuilder::listener_by_lds`], the whole listener comes from a file instead
//! (`dynamic_resources.lds_config`), the filter's configuration inline in it: each delivery is a
//! changed listener (LDS), as a control plane that pushes listeners sends it.
//!
//! Everything listens on 127.0.0.1 (ephemeral ports); the Envoy process is killed on drop.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use floodgate_harness::bootstrap::{router, wasm_config};
use floodgate_harness::Running;
use serde_json::{json, Value};

use crate::envoy::{launch, Routing};
use crate::{http_get_blocking, rss_bytes_of, tail, wasm_module, Error};

/// How long a delivered configuration may take to be taken or refused.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(30);
/// The ECDS resource name (also the HTTP filter's name in the listener).
pub const FILTER_NAME: &str = "floodgate";

/// One version of the Wasm filter's configuration.
#[derive(Clone, Debug)]
pub struct FilterVersion {
    /// The plugin configuration (floodgate's JSON).
    pub plugin: String,
    /// The VM configuration (`vm_config.configuration`, ignored by floodgate): changing it makes
    /// Envoy start new VMs, as a code update would.
    pub vm_generation: String,
}

impl FilterVersion {
    /// A version with plugin configuration `plugin` on VM generation `"1"`.
    pub fn new(plugin: impl Display) -> FilterVersion {
        FilterVersion {
            plugin: plugin.to_string(),
            vm_generation: "1".into(),
        }
    }

    /// The same plugin configuration on VM generation `generation`.
    pub fn vm_generation(mut self, generation: impl Display) -> FilterVersion {
        self.vm_generation = generation.to_string();
        self
    }

    /// The Wasm filter's configuration of this version.
    fn wasm_config(&self) -> Value {
        wasm_config(&wasm_module(), &self.plugin, Some(&self.vm_generation))
    }

    /// The `TypedExtensionConfig` of this version.
    fn extension_config(&self) -> Value {
        json!({
            "@type": "type.googleapis.com/envoy.config.core.v3.TypedExtensionConfig",
            "name": FILTER_NAME,
            "typed_config": self.wasm_config()
        })
    }
}

/// What became of a delivered configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Envoy applied it (`update_success`).
    Taken,
    /// Envoy rejected it (`update_rejected`); the previous configuration stays.
    Refused,
}

/// Builds a [`DynamicEnvoy`].
pub struct DynamicEnvoyBuilder {
    first: FilterVersion,
    routing: Routing,
    concurrency: usize,
    lds: bool,
}

impl DynamicEnvoyBuilder {
    /// Envoy (2 workers) with `first` as the initial filter configuration.
    pub fn new(first: FilterVersion) -> DynamicEnvoyBuilder {
        DynamicEnvoyBuilder {
            first,
            routing: Routing::default(),
            concurrency: 2,
            lds: false,
        }
    }

    /// The listener by LDS from a file, the filter inline in it (module docs).
    pub fn listener_by_lds(mut self) -> DynamicEnvoyBuilder {
        self.lds = true;
        self
    }

    /// Adds a cluster (STATIC, generous circuit breakers). Without [`Self::route_by_header`],
    /// every request goes to the cluster named `upstream`.
    pub fn cluster(mut self, name: &str, addrs: &[SocketAddr]) -> DynamicEnvoyBuilder {
        self.routing.clusters.push((name.to_string(), addrs.to_vec()));
        self
    }

    /// Routes by the cluster named in request header `header` (`cluster_header`).
    pub fn route_by_header(mut self, header: &str) -> DynamicEnvoyBuilder {
        self.routing.route_header = Some(header.to_string());
        self
    }

    /// The route's upstream timeout (default 30 s).
    pub fn route_timeout(mut self, timeout: Duration) -> DynamicEnvoyBuilder {
        self.routing.route_timeout = timeout;
        self
    }

    /// Worker threads (default 2).
    pub fn concurrency(mut self, n: usize) -> DynamicEnvoyBuilder {
        self.concurrency = n;
        self
    }

    fn bootstrap(&self, filter_file: &Path) -> Value {
        let clusters: Vec<Value> = self.routing.clusters().collect();
        if self.lds {
            return json!({
                "node": {"id": "floodgate-test", "cluster": "floodgate-test"},
                "admin": floodgate_harness::bootstrap::admin(),
                "dynamic_resources": {
                    "lds_config": {"path_config_source": {"path": filter_file.display().to_string()}, "resource_api_version": "V3"}
                },
                "static_resources": {"clusters": clusters}
            });
        }
        let filter = json!({
            "name": FILTER_NAME,
            "config_discovery": {
                "config_source": {
                    "path_config_source": {"path": filter_file.display().to_string()},
                    "resource_api_version": "V3"
                },
                "type_urls": ["type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm"]
            }
        });
        json!({
            "node": {"id": "floodgate-test", "cluster": "floodgate-test"},
            "admin": floodgate_harness::bootstrap::admin(),
            "static_resources": {
                "listeners": [self.listener(filter, 0)],
                "clusters": clusters
            }
        })
    }

    /// The listener `front` on `port` (0: any), with `filter` before the router.
    fn listener(&self, filter: Value, port: u16) -> Value {
        let route = self.routing.route();
        json!({
                    "name": "front",
                    "stat_prefix": "front",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                    "filter_chains": [{"filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                            "stat_prefix": "front",
                            "route_config": {"name": "front", "virtual_hosts": [{
                                "name": "all", "domains": ["*"],
                                "routes": [{"match": {"prefix": "/"}, "route": route}]
                            }]},
                            "access_log": crate::envoy::access_log(),
                            "http_filters": [filter, router()]
                        }
                    }]}]
        })
    }

    /// The discovery response of `version`, numbered `number`: the filter's configuration
    /// (ECDS), or the listener with it inline (LDS, on `port`).
    fn discovery(&self, version: &FilterVersion, number: u64, port: u16) -> String {
        if !self.lds {
            return discovery_response(version, number);
        }
        let filter = json!({"name": FILTER_NAME, "typed_config": version.wasm_config()});
        let mut listener = self.listener(filter, port);
        listener["@type"] = json!("type.googleapis.com/envoy.config.listener.v3.Listener");
        serde_json::to_string_pretty(&json!({"version_info": number.to_string(), "resources": [listener]})).expect("json")
    }

    /// Starts Envoy and waits (bounded) until it is ready. Panics with the end of its log if it
    /// does not start.
    pub fn start(self) -> DynamicEnvoy {
        let files = tempfile::Builder::new()
            .prefix("floodgate-dynamic-")
            .tempdir()
            .expect("tempdir");
        let filter_file = files.path().join("floodgate-filter.json");
        let mut port = 0;
        let make = || {
            // A changed listener keeps its port (an LDS listener on port 0 would move); one picked
            // afresh for each start.
            port = if self.lds { crate::free_ports(1)[0] } else { 0 };
            write_atomically(&filter_file, &self.discovery(&self.first, 1, port));
            self.bootstrap(&filter_file).to_string()
        };
        let process = launch()
            .concurrency(self.concurrency)
            .dir_prefix("floodgate-dynamic-")
            .start_with(make)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(process.listener("front").is_some(), "no listener `front`; end of Envoy's log:\n{}", process.log_tail(60));
        DynamicEnvoy {
            process,
            _files: files,
            filter_file,
            version: 1,
            builder: self,
            port,
        }
    }
}

fn discovery_response(version: &FilterVersion, number: u64) -> String {
    serde_json::to_string_pretty(&json!({
        "version_info": number.to_string(),
        "resources": [version.extension_config()]
    }))
    .expect("json")
}

/// Writes `contents` to `path` by a rename from a file beside it (what Envoy's watcher sees).
fn write_atomically(path: &Path, contents: &str) {
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, contents).expect("write the new filter configuration");
    std::fs::rename(&tmp, path).expect("move the new filter configuration into place");
}

/// A running Envoy whose floodgate configuration can be replaced (see the module docs). Killed
/// on drop; if the test is panicking, the end of its log is printed first.
pub struct DynamicEnvoy {
    process: Running,
    /// The directory of the filter file.
    _files: tempfile::TempDir,
    filter_file: PathBuf,
    version: u64,
    builder: DynamicEnvoyBuilder,
    port: u16,
}

impl DynamicEnvoy {
    /// The access log's lines ([`crate::envoy::access_log`]), once there are at least
    /// `expected` (or after a bounded wait).
    pub fn access_log(&self, expected: usize) -> Vec<Value> {
        crate::envoy::access_log_lines(self.process.dir(), expected)
    }

    /// A builder with `first` as the initial configuration.
    pub fn builder(first: FilterVersion) -> DynamicEnvoyBuilder {
        DynamicEnvoyBuilder::new(first)
    }

    /// The ECDS counter `what` (`update_success`, `update_rejected`, `config_reload`, ...) of
    /// the floodgate filter.
    pub fn discovery_stat(&self, what: &str) -> u64 {
        let suffix = format!(".{FILTER_NAME}.{what}");
        self.stats()
            .iter()
            .find(|(k, _)| k.starts_with("extension_config_discovery.") && k.ends_with(&suffix))
            .map_or(0, |(_, v)| *v)
    }

    /// Delivers a new filter configuration and waits (bounded) until Envoy has applied or
    /// rejected it (ECDS `update_success` / `update_rejected`), then a moment more for the
    /// workers to switch (the update reaches them through their event loops). Panics if
    /// neither happens in time.
    /// With the listener by LDS, the listener changes, and the wait is on LDS's counters and
    /// until no listener is warming.
    pub fn deliver(&mut self, version: &FilterVersion) -> Delivery {
        let stat = |envoy: &DynamicEnvoy, what: &str| {
            if envoy.builder.lds {
                envoy.stat(&format!("listener_manager.lds.{what}")).unwrap_or(0)
            } else {
                envoy.discovery_stat(what)
            }
        };
        let (successes, rejections) = (stat(self, "update_success"), stat(self, "update_rejected"));
        self.version += 1;
        write_atomically(&self.filter_file, &self.builder.discovery(version, self.version, self.port));
        let deadline = Instant::now() + DELIVERY_TIMEOUT;
        loop {
            if stat(self, "update_rejected") > rejections {
                return Delivery::Refused;
            }
            let warming = self.builder.lds && self.stat("listener_manager.total_listeners_warming").unwrap_or(0) > 0;
            if stat(self, "update_success") > successes && !warming {
                std::thread::sleep(Duration::from_millis(300));
                return Delivery::Taken;
            }
            assert!(
                Instant::now() < deadline,
                "Envoy neither took nor refused filter configuration {} within {DELIVERY_TIMEOUT:?}; end of its log:\n{}",
                self.version,
                tail(&self.log(), 40)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Wasm VMs Envoy has created so far (all runtimes; canaries and the main thread included).
    pub fn vms_created(&self) -> u64 {
        self.stats()
            .iter()
            .filter(|(k, _)| k.starts_with("wasm.envoy.wasm.runtime.") && k.ends_with(".created"))
            .map(|(_, v)| *v)
            .sum()
    }

    /// The admin API's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.process.admin().expect("admin address")
    }

    /// The listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.process.listener("front").expect("listener address")
    }

    /// GET on the admin API; returns status and body.
    pub fn admin_get(&self, path: &str) -> (u16, String) {
        http_get_blocking(self.admin_addr(), path).unwrap_or_else(|e| panic!("admin GET {path}: {e}"))
    }

    /// Counters and gauges of `/stats` by name (see [`crate::stats_of`]).
    pub fn stats(&self) -> BTreeMap<String, u64> {
        crate::stats_of(self.admin_addr())
    }

    /// One stat by name.
    pub fn stat(&self, name: &str) -> Option<u64> {
        self.stats().get(name).copied()
    }

    /// Polls (at most `timeout`) until stat `name` equals `expected`; returns its last value.
    pub fn wait_for_stat(&self, name: &str, expected: u64, timeout: Duration) -> Option<u64> {
        crate::wait_for_stat_of(self.admin_addr(), name, expected, timeout)
    }

    /// Envoy's process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Envoy's resident set size, in bytes.
    pub fn rss_bytes(&self) -> u64 {
        rss_bytes_of(self.pid())
    }

    /// Envoy's log so far.
    pub fn log(&self) -> String {
        self.process.log()
    }

    /// `GET path` through the listener on a new connection; status and JSON body (`Null` if the
    /// body is not JSON).
    pub async fn get_json(&self, path: &str, headers: &[(&str, &str)]) -> Result<(u16, Value), Error> {
        let mut c = crate::Client::connect(self.addr()).await?;
        let r = c.get(path, headers).await?;
        Ok((r.status, serde_json::from_slice(&r.body).unwrap_or(Value::Null)))
    }
}
