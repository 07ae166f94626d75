//! A real Envoy with the floodgate filter in front of the router: [`EnvoyBuilder`] generates its
//! bootstrap (clusters, routes, extra filters) and starts it, [`Envoy`] is the running process
//! with its listener, admin API, stats, RSS and log.

use std::collections::BTreeMap;
use std::fmt::Display;
use std::net::SocketAddr;
use std::path::Path;
use std::time::{Duration, Instant};

use floodgate_harness::bootstrap::{endpoint, http2_protocol_options, router, static_cluster, wasm_filter};
pub use floodgate_harness::{Launch, Running, Wait};
use serde_json::{json, Value};

use crate::artifacts::{envoy_binary, wasm_module};
use crate::client::http_get_blocking;
use crate::logs::tail;
use crate::stats::{stats_of, wait_for_stat_of};
use crate::upstream::Upstream;

/// How long [`EnvoyBuilder::start_expecting_failure`] waits for Envoy to exit.
const ENVOY_FAILURE_TIMEOUT: Duration = Duration::from_secs(30);

/// The routes and extra clusters of a test Envoy, shared by [`EnvoyBuilder`] and
/// [`crate::dynamic::DynamicEnvoyBuilder`].
#[derive(Clone, Debug)]
pub(crate) struct Routing {
    /// Clusters by name, each with its endpoints (besides `upstream` in [`EnvoyBuilder`]).
    pub(crate) clusters: Vec<(String, Vec<SocketAddr>)>,
    /// Route by this request header (`cluster_header`) instead of to the `upstream` cluster.
    pub(crate) route_header: Option<String>,
    /// Without a route header: the cluster every request goes to (default `upstream`).
    pub(crate) route_cluster: Option<String>,
    /// The route's upstream timeout.
    pub(crate) route_timeout: Duration,
    /// Names of the clusters that speak HTTP/2 (cleartext, prior knowledge) to their endpoints.
    pub(crate) http2: Vec<String>,
}

impl Default for Routing {
    fn default() -> Routing {
        Routing {
            clusters: Vec::new(),
            route_header: None,
            route_cluster: None,
            route_timeout: Duration::from_secs(30),
            http2: Vec::new(),
        }
    }
}

impl Routing {
    /// The one route's action: to the cluster the route header names, or to one cluster
    /// (`upstream` unless [`EnvoyBuilder::route_to`] says another).
    pub(crate) fn route(&self) -> Value {
        let timeout = format!("{}s", self.route_timeout.as_secs_f64());
        match &self.route_header {
            Some(header) => json!({"cluster_header": header, "timeout": timeout}),
            None => json!({"cluster": self.route_cluster.as_deref().unwrap_or("upstream"), "timeout": timeout}),
        }
    }

    /// The clusters added by name.
    pub(crate) fn clusters(&self) -> impl Iterator<Item = Value> + '_ {
        self.clusters.iter().map(|(name, addrs)| {
            let mut cluster = static_cluster(name, addrs.iter().map(|a| endpoint(*a)).collect());
            if self.http2.contains(name) {
                cluster["typed_extension_protocol_options"] = http2_protocol_options();
            }
            cluster
        })
    }
}

/// Builds and starts an [`Envoy`]: the floodgate filter (with the given JSON configuration) in
/// front of the router, routing every request to a cluster of the given upstreams.
pub struct EnvoyBuilder {
    filter_config: String,
    upstreams: Vec<SocketAddr>,
    concurrency: usize,
    routing: Routing,
    /// Extra environment of the Envoy process.
    env: Vec<(String, String)>,
    /// HTTP filters between floodgate and the router.
    filters_after: Vec<Value>,
    /// Routes by path prefix, each with its name (none: one unnamed route for every path).
    named_routes: Vec<(String, String)>,
    /// Whether the connection manager writes floodgate's decisions to an access log.
    access_log: bool,
    /// The module to load (default: [`wasm_module`]).
    module: Option<std::path::PathBuf>,
    /// The plugin's `allow_on_headers_stop_iteration` (a request paused on its headers still
    /// hands its body to the filter).
    stop_iteration: bool,
    /// The routes' `request_body_buffer_limit`: how much of a request body Envoy holds for the
    /// filters (default: the listener's `per_connection_buffer_limit_bytes`, 1 MiB).
    body_buffer_limit: Option<u64>,
}

/// The file access log's name, in Envoy's working directory.
pub const ACCESS_LOG_FILE: &str = "access.log";

/// An HTTP connection manager's `access_log`: one JSON line per request with its status, path,
/// gRPC status and floodgate's decision fields (the filter state the `access_log` option
/// writes; `null` where a field is absent).
pub fn access_log() -> Value {
    let state = |field: &str| format!("%FILTER_STATE(wasm.floodgate.{field}:PLAIN)%");
    json!([{
        "name": "envoy.access_loggers.file",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
            "path": ACCESS_LOG_FILE,
            "log_format": {"json_format": {
                "status": "%RESPONSE_CODE%",
                "path": "%REQ(:PATH)%",
                "grpc_status": "%GRPC_STATUS_NUMBER%",
                "outcome": state("outcome"),
                "by": state("by"),
                "limit": state("limit"),
                "remaining": state("remaining"),
                "flow_in_flight": state("flow_in_flight"),
                "flow_waiting": state("flow_waiting"),
                "fair_share": state("fair_share"),
                "cluster": state("cluster"),
                "waited_ms": state("waited_ms"),
            }}
        }
    }])
}

/// The lines of the access log in `dir` (waits, bounded, until there are at least `expected`).
pub fn access_log_lines(dir: &Path, expected: usize) -> Vec<Value> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let lines: Vec<Value> = std::fs::read_to_string(dir.join(ACCESS_LOG_FILE))
            .unwrap_or_default()
            .lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .collect();
        if lines.len() >= expected || Instant::now() > deadline {
            return lines;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

impl EnvoyBuilder {
    /// A builder with the filter configuration `filter_config` (a `serde_json::Value` or a JSON
    /// string; it is passed verbatim as the plugin's `StringValue` configuration).
    pub fn new(filter_config: impl Display) -> EnvoyBuilder {
        EnvoyBuilder {
            filter_config: filter_config.to_string(),
            upstreams: Vec::new(),
            concurrency: 2,
            routing: Routing::default(),
            env: Vec::new(),
            filters_after: Vec::new(),
            named_routes: Vec::new(),
            access_log: false,
            module: None,
            stop_iteration: false,
            body_buffer_limit: None,
        }
    }

    /// Sets every route's `request_body_buffer_limit` (Envoy 1.37 and later; docs/llm.md, "The estimate in
    /// the request body"): what Envoy holds of a request body while the filter reads it, apart
    /// from how much it reads at once.
    pub fn request_body_buffer_limit(mut self, bytes: u64) -> EnvoyBuilder {
        self.body_buffer_limit = Some(bytes);
        self
    }

    /// Sets the plugin's `allow_on_headers_stop_iteration`: a request the filter pauses on its
    /// headers still hands it its body (which a `cost.estimate.body` reads).
    pub fn allow_on_headers_stop_iteration(mut self) -> EnvoyBuilder {
        self.stop_iteration = true;
        self
    }

    /// Loads `module` instead of [`wasm_module`] (e.g. [`crate::artifacts::llm_wasm_module`]).
    pub fn module(mut self, module: std::path::PathBuf) -> EnvoyBuilder {
        self.module = Some(module);
        self
    }

    /// Routes by path prefix, each with a name (`(prefix, name)`, the first that matches wins).
    pub fn named_routes(mut self, routes: &[(&str, &str)]) -> EnvoyBuilder {
        self.named_routes = routes.iter().map(|(p, n)| ((*p).to_owned(), (*n).to_owned())).collect();
        self
    }

    /// Writes an access log of floodgate's decisions ([`access_log`]; read with
    /// [`Envoy::access_log`]).
    pub fn with_access_log(mut self) -> EnvoyBuilder {
        self.access_log = true;
        self
    }

    /// Adds an Envoy Lua filter with `code` after floodgate (before the router): e.g. one that
    /// burns CPU on the worker to make its event loop lag.
    pub fn lua_after(mut self, code: &str) -> EnvoyBuilder {
        self.filters_after.push(json!({
            "name": "envoy.filters.http.lua",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua",
                "default_source_code": {"inline_string": code}
            }
        }));
        self
    }

    /// Adds `vars` to the Envoy process's environment (e.g. [`crate::wallclock::SteppedWallClock::env`]).
    pub fn env(mut self, vars: Vec<(String, String)>) -> EnvoyBuilder {
        self.env.extend(vars);
        self
    }

    /// Adds a cluster `name` whose endpoints are `addrs` (an address nothing listens on makes a
    /// cluster that is down: Envoy answers 503 with flag UF).
    pub fn cluster(mut self, name: &str, addrs: &[SocketAddr]) -> EnvoyBuilder {
        self.routing.clusters.push((name.to_string(), addrs.to_vec()));
        self
    }

    /// Adds a cluster `name` whose endpoints speak HTTP/2 without TLS (prior knowledge), as
    /// `floodgate-sync` and gRPC servers do.
    pub fn http2_cluster(mut self, name: &str, addrs: &[SocketAddr]) -> EnvoyBuilder {
        self.routing.clusters.push((name.to_string(), addrs.to_vec()));
        self.routing.http2.push(name.to_string());
        self
    }

    /// Routes every request to the cluster named by request header `header` (the route's
    /// `cluster_header`), as cluster selection needs.
    pub fn route_by_header(mut self, header: &str) -> EnvoyBuilder {
        self.routing.route_header = Some(header.to_string());
        self
    }

    /// Routes every request to cluster `name` (added with [`EnvoyBuilder::cluster`] or
    /// [`EnvoyBuilder::http2_cluster`]) instead of `upstream`.
    pub fn route_to(mut self, name: &str) -> EnvoyBuilder {
        self.routing.route_cluster = Some(name.to_string());
        self
    }

    /// The route's upstream timeout (default 30 s); past it Envoy answers `504` itself.
    pub fn route_timeout(mut self, timeout: Duration) -> EnvoyBuilder {
        self.routing.route_timeout = timeout;
        self
    }

    /// Adds an upstream to the `upstream` cluster.
    pub fn upstream(mut self, upstream: &Upstream) -> EnvoyBuilder {
        self.upstreams.push(upstream.addr());
        self
    }

    /// Adds an endpoint to the `upstream` cluster by address (an upstream in another process).
    pub fn upstream_at(mut self, addr: SocketAddr) -> EnvoyBuilder {
        self.upstreams.push(addr);
        self
    }

    /// Number of Envoy worker threads (`--concurrency`, default 2).
    pub fn concurrency(mut self, n: usize) -> EnvoyBuilder {
        self.concurrency = n;
        self
    }

    /// The bootstrap configuration (JSON, which Envoy reads as YAML too).
    pub fn bootstrap(&self) -> Value {
        let endpoints: Vec<Value> = if self.upstreams.is_empty() {
            // Nothing listens there: requests that reach the router get 503 (no test relies on it).
            vec![endpoint("127.0.0.1:9".parse().expect("addr"))]
        } else {
            self.upstreams.iter().map(|a| endpoint(*a)).collect()
        };
        let route = self.routing.route();
        let mut routes: Vec<Value> = if self.named_routes.is_empty() {
            vec![json!({"match": {"prefix": "/"}, "route": route})]
        } else {
            self.named_routes.iter().map(|(prefix, name)| json!({"name": name, "match": {"prefix": prefix}, "route": route})).collect()
        };
        if let Some(bytes) = self.body_buffer_limit {
            routes.iter_mut().for_each(|r| r["request_body_buffer_limit"] = json!(bytes));
        }
        let access_log = if self.access_log { access_log() } else { json!([]) };
        let mut clusters = vec![static_cluster("upstream", endpoints)];
        clusters.extend(self.routing.clusters());
        let module = self.module.clone().unwrap_or_else(wasm_module);
        let mut http_filters = vec![wasm_filter(&module, &self.filter_config)];
        if self.stop_iteration {
            http_filters[0]["typed_config"]["config"]["allow_on_headers_stop_iteration"] = json!(true);
        }
        http_filters.extend(self.filters_after.iter().cloned());
        http_filters.push(router());
        json!({
            "admin": floodgate_harness::bootstrap::admin(),
            "static_resources": {
                "listeners": [{
                    "name": "front",
                    "stat_prefix": "front",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": 0}},
                    "filter_chains": [{
                        "filters": [{
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                                "stat_prefix": "front",
                                "max_request_headers_kb": 96,
                                "route_config": {
                                    "name": "front",
                                    "virtual_hosts": [{
                                        "name": "all",
                                        "domains": ["*"],
                                        "routes": routes
                                    }]
                                },
                                "access_log": access_log,
                                "http_filters": http_filters
                            }
                        }]
                    }]
                }],
                "clusters": clusters
            }
        })
    }

    fn launch(&self) -> Launch {
        launch().concurrency(self.concurrency).env(self.env.iter().cloned())
    }

    /// Starts Envoy and waits (bounded) until it is ready and its listener's port is known.
    /// Panics, showing the end of Envoy's log, if it exits or does not become ready.
    pub fn start(self) -> Envoy {
        Envoy::launched(&self.launch(), &self.bootstrap().to_string())
    }

    /// Starts Envoy expecting it to refuse the configuration: waits (bounded) for it to exit with
    /// a non-zero status and returns its log. Panics if it becomes ready or keeps running.
    pub fn start_expecting_failure(self) -> String {
        let mut envoy = self.launch().spawn(&self.bootstrap().to_string()).unwrap_or_else(|e| panic!("{e}"));
        let outcome = envoy.wait_exit(ENVOY_FAILURE_TIMEOUT);
        envoy.stop();
        let log = envoy.log();
        match outcome {
            Ok(Some(status)) => {
                assert!(
                    !status.success(),
                    "Envoy exited successfully; expected a configuration error. Log:\n{}",
                    tail(&log, 40)
                );
                log
            }
            Ok(None) => panic!("Envoy became ready with a configuration that should be refused; end of its log:\n{}", tail(&log, 40)),
            Err(why) => panic!("{why} with a configuration that should be refused; end of its log:\n{}", tail(&log, 40)),
        }
    }
}

/// How the tests run Envoy ([`envoy_binary`], 2 workers, log level `info`): with access logs
/// reaching their files within 100 ms (Envoy's default is 10 s).
pub fn launch() -> Launch {
    Launch::new(envoy_binary()).args(["--file-flush-interval-msec", "100"])
}

/// A running Envoy (see [`EnvoyBuilder`]); killed when dropped. If the test is panicking, the end
/// of Envoy's log is printed first.
pub struct Envoy {
    process: Running,
}

impl Envoy {
    /// Starts Envoy (2 workers) with the filter configuration `filter_config` in front of
    /// `upstream`. See [`EnvoyBuilder`] for more options.
    pub fn start(filter_config: impl Display, upstream: &Upstream) -> Envoy {
        EnvoyBuilder::new(filter_config).upstream(upstream).start()
    }

    /// A builder, for more options.
    pub fn builder(filter_config: impl Display) -> EnvoyBuilder {
        EnvoyBuilder::new(filter_config)
    }

    /// Starts Envoy (2 workers) with a whole bootstrap (a shipped example's, say, its ports and
    /// paths set by the test), whose listener is named `front`.
    pub fn from_bootstrap(bootstrap: &Value) -> Envoy {
        Envoy::launched(&launch(), &bootstrap.to_string())
    }

    /// Starts Envoy with `launch` on `bootstrap` (JSON or YAML text) and waits (bounded) until
    /// it is ready. Panics, showing the end of its log, if it does not start.
    pub fn launched(launch: &Launch, bootstrap: &str) -> Envoy {
        Envoy { process: launch.start(bootstrap).unwrap_or_else(|e| panic!("{e}")) }
    }

    /// Starts Envoy with `launch` on the bootstrap `make` returns (JSON or YAML text, its ports
    /// picked free, e.g. with [`free_ports`](crate::free_ports)); when one of them is taken
    /// before Envoy binds it, starts again on a bootstrap `make` returns afresh (see
    /// [`Launch::start_with`]). [`Envoy::admin_addr`] and [`Envoy::addr`] are the ports bound.
    pub fn launched_with(launch: &Launch, make: impl FnMut() -> String) -> Envoy {
        Envoy { process: launch.start_with(make).unwrap_or_else(|e| panic!("{e}")) }
    }

    /// The process (its directory, listeners by name).
    pub fn process(&self) -> &Running {
        &self.process
    }

    /// Starts Envoy with `filter_config` expecting it to refuse it; returns Envoy's log.
    pub fn start_expecting_failure(filter_config: impl Display) -> String {
        EnvoyBuilder::new(filter_config).start_expecting_failure()
    }

    /// The address of the listener with the floodgate filter (`front`).
    pub fn addr(&self) -> SocketAddr {
        self.process.listener("front").expect("an address for listener `front`")
    }

    /// `http://127.0.0.1:<port><path>` on the floodgate listener.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr(), path)
    }

    /// The admin API's address.
    pub fn admin_addr(&self) -> SocketAddr {
        self.process.admin().expect("admin address")
    }

    /// `http://127.0.0.1:<admin port><path>`.
    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{}", self.admin_addr(), path)
    }

    /// GET on the admin API (blocking); returns status and body.
    pub fn admin_get(&self, path: &str) -> (u16, String) {
        http_get_blocking(self.admin_addr(), path)
            .unwrap_or_else(|e| panic!("admin GET {path}: {e}"))
    }

    /// Envoy's process id.
    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// Envoy's resident set size (`VmRSS` of `/proc/<pid>/status`), in bytes.
    pub fn rss_bytes(&self) -> u64 {
        rss_bytes_of(self.pid())
    }

    /// All counters and gauges of the admin `/stats` page, by name (histograms are left out).
    ///
    /// Envoy 1.40's `/stats` shows the module's metrics in their namespace, as
    /// `wasmcustom.<name>` (only `/stats/prometheus` drops it); each such stat is also listed
    /// under `<name>`, the name the module defined, which is what the tests use.
    pub fn stats(&self) -> BTreeMap<String, u64> {
        stats_of(self.admin_addr())
    }

    /// One stat by its full name, if Envoy has it.
    pub fn stat(&self, name: &str) -> Option<u64> {
        self.stats().get(name).copied()
    }

    /// Polls (at most `timeout`) until stat `name` equals `expected`; returns its last value.
    /// Stats may lag the responses by a moment.
    pub fn wait_for_stat(&self, name: &str, expected: u64, timeout: Duration) -> Option<u64> {
        wait_for_stat_of(self.admin_addr(), name, expected, timeout)
    }

    /// All stats whose name starts with `prefix`, as `name: value` lines (for printing).
    pub fn stats_matching(&self, prefix: &str) -> String {
        self.stats()
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| format!("{k}: {v}"))
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Downstream connections accepted by each worker on the floodgate listener
    /// (`listener.front.worker_<n>.downstream_cx_total`), in worker order.
    pub fn connections_per_worker(&self) -> Vec<u64> {
        let stats = self.stats();
        let prefix = "listener.front.worker_";
        let mut v: Vec<(u64, u64)> = stats
            .iter()
            .filter_map(|(k, val)| {
                let rest = k.strip_prefix(prefix)?;
                let (n, stat) = rest.split_once('.')?;
                (stat == "downstream_cx_total").then(|| Some((n.parse().ok()?, *val)))?
            })
            .collect();
        v.sort();
        v.into_iter().map(|(_, c)| c).collect()
    }

    /// Envoy's log so far (its stderr, at level info, kept in a file of the temporary directory).
    pub fn log(&self) -> String {
        self.process.log()
    }

    /// The access log's lines (with [`EnvoyBuilder::with_access_log`]), once there are at least
    /// `expected` (or after a bounded wait).
    pub fn access_log(&self, expected: usize) -> Vec<Value> {
        access_log_lines(self.process.dir(), expected)
    }
}

/// The resident set size of process `pid` (`VmRSS` of `/proc/<pid>/status`), in bytes.
pub fn rss_bytes_of(pid: u32) -> u64 {
    floodgate_harness::launch::rss_bytes_of(pid).unwrap_or_else(|| panic!("no VmRSS in /proc/{pid}/status"))
}

/// Floodgate's cluster selection (default tuning) over clusters `a`, `b` and `c`, routed by
/// `route_header`, each an upstream that counts the route header's values; `c` answers `503` to
/// everything. Returns the Envoy and the upstreams `[a, b, c]`.
pub fn three_clusters_one_failing(route_header: &str) -> (Envoy, [Upstream; 3]) {
    let upstreams = [0, 1, 2].map(|_| Upstream::counting_header(route_header));
    let [a, b, c] = &upstreams;
    c.set_status(503);
    let envoy = Envoy::builder(json!({"cluster_selection": {"route_header": route_header, "clusters": ["a", "b", "c"]}}))
        .cluster("a", &[a.addr()])
        .cluster("b", &[b.addr()])
        .cluster("c", &[c.addr()])
        .route_by_header(route_header)
        .start();
    (envoy, upstreams)
}
