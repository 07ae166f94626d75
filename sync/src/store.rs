//! Redis: applies a [`Plan`] with the Lua script `apply.lua`, and grants leases with `lease.lua`
//! and `ask.lua`, single node or Redis Cluster.
//!
//! - Single node: one lazily connected, auto-reconnecting multiplexed connection (redis-rs
//!   `ConnectionManager`); one script call applies every shard of a batch (one round trip).
//! - Cluster: redis-rs's async cluster client (follows MOVED/ASK, refreshes its slot map); one
//!   script call per shard present in the batch (a shard is one slot), all at once. The client is
//!   built in the background, so the service starts (and answers 503) while the cluster is down.
//!
//! **Merging.** A batch's parts (the whole batch on a single node, a part per shard in a
//! cluster: `layout`) wait in a lane (one on a single node, one per shard in a cluster); a lane
//! has at most one script call in flight, and each call takes every part waiting (whole parts up
//! to 1 000 counters), from whichever proxies, and a lane starts a call at most every
//! `--batch-pace` ([`DEFAULT_BATCH_PACE`]). An instance that receives batches faster than that
//! (or than Redis answers them) therefore sends fewer, larger calls: the counters the merged
//! parts share are added once, and read once, and a call's dedup costs the same whatever the
//! proxies in it, so the Redis commands of an instance's batches are bounded by its lanes, not
//! by the proxies. The proxies send on a shared grid of the wall clock (each ticks on the
//! starts of its `sync_interval`'s slots), so a fleet's batches arrive together: a batch that
//! finds its lane idle waits `--batch-gather` ([`DEFAULT_BATCH_GATHER`]) for the others, and a
//! batch waits at most that, or `--batch-pace`, besides the call before it.
//! The script reads nothing it does not write: it is handed the counters a part changes (a
//! delta or a give-back, one argument each; not those a proxy only refreshes its view of), and
//! returns which groups it applied and the value its write left in each counter. A plain `MGET`
//! pipelined after it, in its round trip and on its connection, reads the rest: the previous
//! buckets, and the counters a call only reads, so the totals each proxy learns include the
//! call's writes (and any that reached Redis between the two). In Redis a script pays for every
//! key and argument it is handed and for every value it reads, several times what a native read
//! costs.
//! The parts waiting are the only state, in memory for one call's time at most; a part whose
//! call fails is answered with the error, and its proxy retries it (the dedup hashes keep the
//! retry exactly once).
//! The asks of batched rules ([`PlannedLease::is_ask`]) have lanes of their own, the same
//! mechanism ([`LaneWork`]), paced at `--ask-pace` ([`DEFAULT_ASK_PACE`]: a request waits for its ask): a call
//! (`ask.lua`) reads each distinct counter once and adds each counter's grants once, whatever the
//! proxies asking; other leases go one script call each.
//!
//! Scripts go as EVALSHA; on NOSCRIPT (a restarted or promoted node) the same call goes again as
//! EVAL with the source. Everything a batch does is bounded by `--redis-timeout`.
//!
//! **Acknowledged leases.** With `--replica-acks N` a lease call (`lease.lua`, the leased
//! rules') sends `WAIT N` in the script's round trip, on the same connection, and is answered
//! only once N replicas have its writes: Redis replicates asynchronously, so a master that fails
//! over loses the writes its replicas had not received, and units it had granted would be
//! granted again. A call that fewer replicas acknowledged within half of `--redis-timeout`
//! fails (503): its units stay counted where they were written, and nobody uses them.
//!
//! `rediss://` URLs connect over TLS (rustls): the server's certificate is checked against
//! `--redis-ca` when given, else against the built-in public roots, and its name against the
//! URL's host; `--redis-cert`/`--redis-key` answer servers that ask for a client certificate.
//! ACL users and passwords come in the URL (`redis://user:password@host`).

use std::fmt;
use std::future::Future;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{MultipleNodeRoutingInfo, ResponsePolicy, RoutingInfo};
use redis::{ClientTlsConfig, Cmd, RedisError, Script, ServerErrorKind, TlsCertificates, Value};
use tokio::sync::{oneshot, watch};
use tracing::{info, warn};

use crate::holders::{BucketHolders, Holder};
use crate::layout::{Group, Plan, PlannedCounter, MAX_SCRIPT_COUNTERS};
use crate::lease::{holders_key, Grant, PlannedLease};
use crate::metrics::{ErrorKind, Metrics};
use crate::protocol::Totals;

const SCRIPT_SOURCE: &str = concat!(include_str!("seq.lua"), include_str!("apply.lua"));
const LEASE_SOURCE: &str = concat!(include_str!("window.lua"), include_str!("lease.lua"));
const ASK_SOURCE: &str = concat!(include_str!("window.lua"), include_str!("seq.lua"), include_str!("ask.lua"));

/// A batches' lane starts a script call at most this often by default (`--batch-pace`): the
/// parts that arrive meanwhile wait and go together in the next call (a lone part on an idle
/// lane goes at once).
pub const DEFAULT_BATCH_PACE: Duration = Duration::from_millis(25);
/// How long a batch that finds its lane idle waits for others by default (`--batch-gather`): the
/// proxies send on the same grid, so a fleet's batches arrive together.
pub const DEFAULT_BATCH_GATHER: Duration = Duration::from_millis(5);
/// An asks' lane starts a script call at most this often by default (`--ask-pace`): shorter
/// than [`DEFAULT_BATCH_PACE`], since a request waits for its ask's answer, and long enough that
/// the asks of a large fleet, which grow with its proxies, share their calls (docs/global.md,
/// "At mesh scale").
pub const DEFAULT_ASK_PACE: Duration = Duration::from_millis(20);

/// How to reach Redis.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// `redis://` URLs: exactly one for a single node, one or more seed nodes for a cluster.
    pub urls: Vec<String>,
    /// Redis Cluster mode.
    pub cluster: bool,
    /// The bound on everything one request asks of Redis (connecting included).
    pub timeout: Duration,
    /// The least time between two calls of one batches' lane (`--batch-pace`,
    /// [`DEFAULT_BATCH_PACE`]).
    pub batch_pace: Duration,
    /// How long a batch that finds its lane idle waits for others (`--batch-gather`, at most
    /// `batch_pace`; [`DEFAULT_BATCH_GATHER`]).
    pub batch_gather: Duration,
    /// The least time between two calls of one asks' lane (`--ask-pace`, [`DEFAULT_ASK_PACE`]).
    pub ask_pace: Duration,
    /// `--replica-acks`: the replicas that must have a lease call's writes before it is
    /// answered (0: none, answered once the master ran the script).
    pub replica_acks: u32,
    /// Certificates for `rediss://` URLs.
    pub tls: StoreTls,
}

/// Certificates for `rediss://` URLs, as PEM bytes; without any, the server's certificate is
/// checked against the built-in public roots.
#[derive(Clone, Default)]
pub struct StoreTls {
    /// `--redis-ca`: the CA certificates the server's certificate must chain to.
    pub ca: Option<Vec<u8>>,
    /// `--redis-cert` and `--redis-key`: a client certificate and its key.
    pub client: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for StoreTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "StoreTls {{ ca: {}, client certificate: {} }}",
            self.ca.is_some(),
            self.client.is_some()
        )
    }
}

impl StoreTls {
    /// redis-rs's form, when a CA or a client certificate is given.
    fn certificates(&self) -> Option<TlsCertificates> {
        if self.ca.is_none() && self.client.is_none() {
            return None;
        }
        Some(TlsCertificates {
            client_tls: self.client.clone().map(|(client_cert, client_key)| ClientTlsConfig {
                client_cert,
                client_key,
            }),
            root_cert: self.ca.clone(),
        })
    }
}

/// Whether a Redis URL asks for TLS.
pub fn is_tls(url: &str) -> bool {
    ["rediss://", "valkeys://"]
        .iter()
        .any(|scheme| url.get(..scheme.len()).is_some_and(|s| s.eq_ignore_ascii_case(scheme)))
}

/// The URLs' TLS mode (all TLS or none), and the certificates to use; errors name the flags.
fn tls_of(config: &StoreConfig) -> Result<Option<TlsCertificates>, String> {
    let tls = config.urls.iter().filter(|url| is_tls(url)).count();
    if tls != 0 && tls != config.urls.len() {
        return Err("--redis: either every URL is rediss:// (TLS) or none is".into());
    }
    let certificates = config.tls.certificates();
    if certificates.is_some() && tls == 0 {
        return Err("--redis-ca, --redis-cert and --redis-key need rediss:// URLs".into());
    }
    Ok(certificates)
}

/// Why Redis did not serve a request (answered 503).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreError {
    /// No answer within `--redis-timeout`.
    Timeout(Duration),
    /// The cluster client has not connected yet.
    NotConnected(String),
    /// Redis answered with an error, or the connection failed.
    Redis(String),
    /// The script's answer did not have the expected shape.
    Reply(String),
}

impl StoreError {
    /// The metrics' kind of this error.
    pub fn kind(&self) -> ErrorKind {
        match self {
            StoreError::Timeout(_) => ErrorKind::StoreTimeout,
            _ => ErrorKind::StoreError,
        }
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Timeout(after) => write!(f, "no answer from Redis within {after:?}"),
            StoreError::NotConnected(why) => write!(f, "not connected to the cluster yet: {why}"),
            StoreError::Redis(err) => write!(f, "{err}"),
            StoreError::Reply(err) => write!(f, "unexpected script reply: {err}"),
        }
    }
}

impl From<RedisError> for StoreError {
    fn from(err: RedisError) -> Self {
        // One line: Redis error texts may carry newlines (script errors).
        StoreError::Redis(err.to_string().replace(['\r', '\n'], " "))
    }
}

/// What a batch did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The totals of every distinct counter, in the plan's flattened order.
    pub totals: Vec<Totals>,
    /// Shard parts applied by this call.
    pub applied: usize,
    /// Shard parts already applied before (their seq was not newer): only read.
    pub deduplicated: usize,
}

#[derive(Clone)]
enum Backend {
    Single(ConnectionManager),
    /// Two clients: one that retries (batches, made idempotent by the dedup hashes), one that
    /// never does, for leases (a grant or a give-back run twice would count twice).
    Cluster {
        retrying: watch::Receiver<Option<ClusterConnection>>,
        once: watch::Receiver<Option<ClusterConnection>>,
    },
}

/// One line per Redis error, at most one a second; the others are counted and reported with the
/// next line. Over TLS, an error that comes from the TLS handshake says so.
#[derive(Debug, Default)]
struct ErrorLog {
    state: Mutex<(Option<Instant>, u64)>,
    tls: bool,
}

/// What an error's text tells of a TLS failure (a certificate refused, a handshake cut short).
fn tls_hint(tls: bool, err: &StoreError) -> &'static str {
    let text = err.to_string().to_ascii_lowercase();
    let tls_failure = ["certificate", "tls", "handshake", "unknownissuer"]
        .iter()
        .any(|word| text.contains(word));
    if tls && tls_failure {
        " (TLS: check --redis-ca against the server's certificate, and --redis-cert/--redis-key if it asks for one)"
    } else {
        ""
    }
}

impl ErrorLog {
    fn log(&self, what: &str, err: &StoreError) {
        let hint = tls_hint(self.tls, err);
        let mut state = self
            .state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let now = Instant::now();
        let due = state
            .0
            .is_none_or(|last| now.saturating_duration_since(last) >= Duration::from_secs(1));
        if due {
            let suppressed = state.1;
            *state = (Some(now), 0);
            drop(state);
            if suppressed > 0 {
                warn!(
                    "redis: {what}: {err}{hint} ({suppressed} more errors in the last second not logged)"
                );
            } else {
                warn!("redis: {what}: {err}{hint}");
            }
        } else {
            state.1 = state.1.saturating_add(1);
        }
    }
}

/// The Redis side of the service. Cheap to share (`Arc`).
pub struct Store {
    calls: Calls,
    lease_script: Script,
    /// `--replica-acks`.
    replica_acks: u32,
    /// The shard parts of batches waiting for their script call.
    batches: Lanes<BatchPart>,
    /// The asks of batched rules waiting for theirs.
    asks: Lanes<PlannedLease>,
}

/// What a lane's script call needs of the store (a lane's runner, a spawned task, owns a copy).
#[derive(Clone)]
struct Calls {
    backend: Backend,
    script: Script,
    ask_script: Script,
    timeout: Duration,
    batch_pace: Duration,
    batch_gather: Duration,
    ask_pace: Duration,
    metrics: Arc<Metrics>,
    errors: Arc<ErrorLog>,
}

/// Work that waits in a lane (module doc, "Merging"): one lane per kind of work on a single
/// node, one per kind and shard (slot) in a cluster; a lane's call takes every unit waiting.
trait LaneWork: Sized + Send + 'static {
    /// What one unit of work gets back.
    type Outcome: Send + 'static;
    /// What the error log calls a failed call.
    const WHAT: &'static str;
    /// The least time between the starts of two calls of one lane.
    fn pace(calls: &Calls) -> Duration;
    /// How long the first unit on an idle lane waits for others before the lane's first call.
    fn gather(calls: &Calls) -> Duration;
    /// Its size toward [`MAX_SCRIPT_COUNTERS`] per call.
    fn size(&self) -> usize;
    /// One script call over `work` (all on one slot in a cluster), an outcome per unit.
    fn call<'a>(calls: &'a Calls, work: &'a [Self]) -> impl Future<Output = Result<Vec<Self::Outcome>, StoreError>> + Send + 'a;
}

/// The lanes of one kind of work, by lane id (the shard in a cluster, else 0): the work waiting
/// in each, each unit with where its outcome goes. A lane is in the map exactly while a runner
/// serves it.
type Lanes<W> = Arc<Mutex<HashMap<u32, VecDeque<(W, Answer<W>)>>>>;

/// Where a unit of work's outcome goes.
type Answer<W> = oneshot::Sender<Result<<W as LaneWork>::Outcome, StoreError>>;

/// One batch's part on one shard.
struct BatchPart {
    seq: u64,
    group: Group,
}

/// What one shard part of a batch did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupOutcome {
    /// Applied (its seq was newer than its proxy's last in the shard), or only read.
    pub applied: bool,
    /// Its counters' totals, in the group's order.
    pub totals: Vec<Totals>,
}

impl Store {
    /// Sets up the connection (lazily: no Redis needs to be up yet). Fails only on a bad URL.
    pub fn connect(config: &StoreConfig, metrics: Arc<Metrics>) -> Result<Store, String> {
        let certificates = tls_of(config)?;
        let errors = Arc::new(ErrorLog {
            tls: config.urls.iter().any(|url| is_tls(url)),
            ..ErrorLog::default()
        });
        let backend = if config.cluster {
            if config.urls.is_empty() {
                return Err("--cluster needs at least one --redis seed URL".into());
            }
            let client = |retries: u32| {
                let builder = ClusterClient::builder(config.urls.iter().map(String::as_str))
                    .connection_timeout(config.timeout)
                    .response_timeout(config.timeout)
                    .overall_response_timeout(Some(config.timeout))
                    .retries(retries)
                    .min_retry_wait(20)
                    .max_retry_wait(500);
                match certificates.clone() {
                    Some(certificates) => builder.certs(certificates),
                    None => builder,
                }
                .build()
                .map_err(|err| format!("--redis: {err}"))
            };
            let (sender, retrying) = watch::channel(None);
            tokio::spawn(connect_cluster(client(8)?, sender, errors.clone()));
            let (sender, once) = watch::channel(None);
            tokio::spawn(connect_cluster(client(0)?, sender, errors.clone()));
            Backend::Cluster { retrying, once }
        } else {
            let [url] = config.urls.as_slice() else {
                return Err(format!(
                    "a single Redis node takes exactly one --redis URL, got {} (use --cluster for a Redis Cluster)",
                    config.urls.len()
                ));
            };
            let client = match certificates {
                Some(certificates) => redis::Client::build_with_tls(url.as_str(), certificates),
                None => redis::Client::open(url.as_str()),
            }
            .map_err(|err| format!("--redis {}: {err}", redact(url)))?;
            let manager_config = ConnectionManagerConfig::new()
                .set_connection_timeout(Some(config.timeout))
                .set_response_timeout(Some(config.timeout))
                .set_number_of_retries(1)
                .set_min_delay(Duration::from_millis(50))
                .set_max_delay(Duration::from_millis(500));
            let manager = ConnectionManager::new_lazy_with_config(client, manager_config)
                .map_err(|err| format!("--redis {}: {err}", redact(url)))?;
            Backend::Single(manager)
        };
        Ok(Store {
            calls: Calls {
                backend,
                script: Script::new(SCRIPT_SOURCE),
                ask_script: Script::new(ASK_SOURCE),
                timeout: config.timeout,
                batch_pace: config.batch_pace,
                batch_gather: config.batch_gather.min(config.batch_pace),
                ask_pace: config.ask_pace,
                metrics,
                errors,
            },
            lease_script: Script::new(LEASE_SOURCE),
            replica_acks: config.replica_acks,
            batches: Arc::default(),
            asks: Arc::default(),
        })
    }

    /// Puts `work` in lane `id` of `lanes` (a runner starts on an idle lane); its outcome comes
    /// on the receiver.
    fn enqueue<W: LaneWork>(&self, lanes: &Lanes<W>, id: u32, work: W) -> oneshot::Receiver<Result<W::Outcome, StoreError>> {
        let (answer, receiver) = oneshot::channel();
        let start = {
            let mut lanes = lanes.lock().unwrap_or_else(PoisonError::into_inner);
            let idle = !lanes.contains_key(&id);
            lanes.entry(id).or_default().push_back((work, answer));
            idle
        };
        if start {
            tokio::spawn(run_lane(self.calls.clone(), lanes.clone(), id));
        }
        receiver
    }

    /// The lane of a shard: the shard in a cluster (a script touches one slot), else one lane.
    fn lane_of(&self, shard: u32) -> u32 {
        if matches!(self.calls.backend, Backend::Cluster { .. }) {
            shard
        } else {
            0
        }
    }

    /// Applies a plan (see `apply.lua`) and returns every distinct counter's totals. Each
    /// shard part waits in its lane and goes with the parts of other batches waiting there
    /// (module doc, "Merging"); the parts that succeed are applied whatever happens to the
    /// others, and a retry completes the rest.
    pub async fn apply(&self, plan: &Plan) -> Result<Outcome, StoreError> {
        if plan.groups.is_empty() {
            return Ok(Outcome {
                totals: Vec::new(),
                applied: 0,
                deduplicated: 0,
            });
        }
        let answers: Vec<_> = plan
            .groups
            .iter()
            .map(|group| self.enqueue(&self.batches, self.lane_of(group.shard), BatchPart { seq: plan.seq, group: group.clone() }))
            .collect();
        let work = async {
            let mut outcome = Outcome {
                totals: Vec::with_capacity(plan.distinct()),
                applied: 0,
                deduplicated: 0,
            };
            let mut first_error = None;
            for answer in answers {
                let part = answer.await.unwrap_or_else(|_| {
                    Err(StoreError::Reply("the lane's call ended without an answer".into()))
                });
                match part {
                    Ok(part) if first_error.is_none() => {
                        if part.applied {
                            outcome.applied = outcome.applied.saturating_add(1);
                        } else {
                            outcome.deduplicated = outcome.deduplicated.saturating_add(1);
                        }
                        outcome.totals.extend(part.totals);
                    }
                    Ok(_) => {}
                    Err(err) => {
                        first_error.get_or_insert(err);
                    }
                }
            }
            match first_error {
                Some(err) => Err(err),
                None => Ok(outcome),
            }
        };
        self.bounded("batch", work).await
    }

    /// The client's own timeouts (connection, response) are the service's: `--redis-timeout`.
    fn classify(&self, err: RedisError) -> StoreError {
        classify(self.calls.timeout, err)
    }

    /// Counts `proxies` among the senders of a second (a HyperLogLog per second, `keys[0]`,
    /// which lives [`crate::layout::FLEET_TTL_MS`]) and returns the distinct senders of all
    /// `keys` (that second and the ones before it): the fleet size. One pipelined round trip;
    /// every key shares the hash tag `{fleet}`, so one slot of a cluster.
    pub async fn fleet_size(&self, keys: &[String], proxies: &[String]) -> Result<u64, StoreError> {
        let Some(first) = keys.first() else { return Ok(0) };
        let mut pipe = redis::pipe();
        pipe.cmd("PFADD").arg(first).arg(proxies).ignore();
        pipe.cmd("PEXPIRE").arg(first).arg(crate::layout::FLEET_TTL_MS).ignore();
        pipe.cmd("PFCOUNT").arg(keys);
        let work = async {
            self.calls.metrics.redis_round_trip();
            let counted: (u64,) = match &self.calls.backend {
                Backend::Single(manager) => {
                    let mut conn = manager.clone();
                    pipe.query_async(&mut conn).await
                }
                Backend::Cluster { retrying, .. } => {
                    let mut conn = connected(retrying)?;
                    pipe.query_async(&mut conn).await
                }
            }
            .map_err(|err| self.classify(err))?;
            Ok(counted.0)
        };
        self.bounded("fleet size", work).await
    }

    /// PING, on every node of a cluster (masters and replicas); a failure is logged like the
    /// other Redis errors (so that a Redis that refuses the connection shows in the log before
    /// any proxy calls).
    pub async fn ping(&self) -> Result<(), StoreError> {
        let work = async {
            match &self.calls.backend {
                Backend::Single(manager) => {
                    let mut conn = manager.clone();
                    self.calls.metrics.redis_round_trip();
                    redis::cmd("PING")
                        .query_async::<Value>(&mut conn)
                        .await
                        .map_err(|err| self.classify(err))?;
                }
                Backend::Cluster { retrying, once } => {
                    // Ready once both connections are: leases and asks go on the one that does
                    // not retry, which connects on its own.
                    connected(once)?;
                    let mut conn = connected(retrying)?;
                    self.calls.metrics.redis_round_trip();
                    conn.route_command(
                        redis::cmd("PING"),
                        RoutingInfo::MultiNode((
                            MultipleNodeRoutingInfo::AllNodes,
                            Some(ResponsePolicy::AllSucceeded),
                        )),
                    )
                    .await
                    .map_err(|err| self.classify(err))?;
                }
            }
            Ok(())
        };
        self.bounded("readiness (PING)", work).await
    }

    /// `work` within `--redis-timeout`; its error logged (rate-limited) as `what`.
    async fn bounded<T>(&self, what: &str, work: impl Future<Output = Result<T, StoreError>>) -> Result<T, StoreError> {
        let result = match tokio::time::timeout(self.calls.timeout, work).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(self.calls.timeout)),
        };
        if let Err(err) = &result {
            self.calls.errors.log(what, err);
        }
        result
    }

    /// Grants the leases of a request (see `lease.lua`): one script call per entry (each entry's
    /// counters are on one slot), all at once, in request order; the asks of batched rules
    /// ([`PlannedLease::is_ask`]) wait in their shard's lane and go with the asks of other
    /// requests (`ask.lua`, module doc, "Merging"). One failure fails the whole: grants already
    /// counted stay counted, and give-backs already made stay made. Never retried (in a cluster,
    /// by a client of its own that does not retry): a script that timed out may have run, and
    /// running it again would grant or give back twice. With `--replica-acks`, a lease call is
    /// answered once that many replicas have its writes (module doc, "Acknowledged leases").
    pub async fn lease(&self, planned: &[PlannedLease]) -> Result<Vec<Grant>, StoreError> {
        let work = async {
            let calls = planned.iter().map(|lease| async move {
                if lease.is_ask() {
                    return self
                        .enqueue(&self.asks, self.lane_of(lease.shard), lease.clone())
                        .await
                        .unwrap_or_else(|_| Err(StoreError::Reply("the lane's call ended without an answer".into())));
                }
                let (keys, argv) = (lease.keys(), lease.argv());
                let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
                let call = self.calls.eval(false, &self.lease_script, LEASE_SOURCE, &keys, &argv, &[], self.replica_acks);
                parse_grant(call.await?.0)
            });
            join_all(calls).await.into_iter().collect()
        };
        self.bounded("lease", work).await
    }

    /// The counters `counters` (`(bucket, counter key)`, all of one key: one slot) with their
    /// holders, their units outstanding and their entries' expiry (`now_ms`: the caller's clock).
    pub async fn holders(&self, counters: &[(u64, String)], now_ms: u64) -> Result<Vec<BucketHolders>, StoreError> {
        let work = async {
            match &self.calls.backend {
                Backend::Single(manager) => self.read_holders(&mut manager.clone(), counters, now_ms).await,
                Backend::Cluster { retrying, .. } => {
                    self.read_holders(&mut connected(retrying)?, counters, now_ms).await
                }
            }
        };
        self.bounded("holders", work).await
    }

    async fn read_holders<C: ConnectionLike>(
        &self,
        conn: &mut C,
        counters: &[(u64, String)],
        now_ms: u64,
    ) -> Result<Vec<BucketHolders>, StoreError> {
        let mut pipe = redis::pipe();
        for (_, counter) in counters {
            let holders = holders_key(counter);
            pipe.get(counter).hgetall(&holders).pttl(&holders);
        }
        self.calls.metrics.redis_round_trip();
        let replies: Vec<HoldersReply> = {
            let flat: Vec<Value> = pipe.query_async(conn).await.map_err(|err| self.classify(err))?;
            flat.chunks(3)
                .map(|reply| match reply {
                    [count, holders, ttl] => Ok((
                        redis::from_redis_value(count.clone()).map_err(|err| StoreError::Reply(err.to_string()))?,
                        redis::from_redis_value(holders.clone()).map_err(|err| StoreError::Reply(err.to_string()))?,
                        redis::from_redis_value(ttl.clone()).map_err(|err| StoreError::Reply(err.to_string()))?,
                    )),
                    _ => Err(StoreError::Reply("a short pipeline answer".into())),
                })
                .collect::<Result<_, StoreError>>()?
        };
        Ok(counters
            .iter()
            .zip(replies)
            .map(|((bucket, counter), (count, holders, ttl))| {
                // PTTL: -1 without an expiry, -2 when the hash is gone.
                let expires_at_ms = u64::try_from(ttl).ok().map(|ttl| now_ms.saturating_add(ttl));
                let mut holders: Vec<Holder> = holders
                    .into_iter()
                    .map(|(holder, units)| Holder { holder, units: u64::try_from(units).unwrap_or(0), expires_at_ms })
                    .collect();
                holders.sort_by(|a, b| b.units.cmp(&a.units).then_with(|| a.holder.cmp(&b.holder)));
                BucketHolders { bucket: *bucket, counter: counter.clone(), count: count.unwrap_or(0), holders }
            })
            .collect())
    }
}

/// One bucket's counter, its holders hash and the hash's PTTL.
type HoldersReply = (Option<u64>, Vec<(String, i64)>, i64);

/// A client timeout is the service's (`--redis-timeout`); other errors as they are.
fn classify(timeout: Duration, err: RedisError) -> StoreError {
    if err.is_timeout() {
        StoreError::Timeout(timeout)
    } else {
        StoreError::from(err)
    }
}

/// Runs `script` as EVALSHA, and again as EVAL with its `source` on NOSCRIPT; returns its answer
/// and the values of `read`. With `read` not empty, an `MGET` of them follows the script in the
/// same round trip (module doc, "Merging": every key of a call is on the script's slot). With
/// `acks` > 0, `WAIT acks` follows them (a pipeline goes to the script's node in a cluster:
/// `WAIT` has no key), bounded by half of `timeout`; fewer replicas than `acks` acknowledging is
/// an error (module doc, "Acknowledged leases").
#[allow(clippy::too_many_arguments)]
async fn eval<C: ConnectionLike, K: redis::ToRedisArgs, A: redis::ToRedisArgs>(
    conn: &mut C,
    script: &Script,
    source: &str,
    keys: &[K],
    args: &[A],
    read: &[&str],
    metrics: &Metrics,
    timeout: Duration,
    acks: u32,
) -> Result<(Value, Vec<Value>), StoreError> {
    let classify = |err| classify(timeout, err);
    let call = |command: &str, script: &str| {
        let mut call = Cmd::new();
        call.arg(command)
            .arg(script)
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        call
    };
    let wait_ms = u64::try_from(timeout.as_millis() / 2).unwrap_or(u64::MAX).max(1);
    // The script's answer, the values read, and the replicas that acknowledged its writes (0
    // when not asked).
    let mut run = async |call: Cmd| -> Result<(Value, Vec<Value>, u32), RedisError> {
        if acks == 0 && read.is_empty() {
            return Ok((call.query_async::<Value>(conn).await?, Vec::new(), 0));
        }
        let mut pipe = redis::pipe();
        pipe.add_command(call);
        if !read.is_empty() {
            pipe.cmd("MGET").arg(read);
        }
        if acks > 0 {
            pipe.cmd("WAIT").arg(acks).arg(wait_ms);
        }
        let mut answers: VecDeque<Value> = pipe.query_async::<Vec<Value>>(conn).await?.into();
        let short = || RedisError::from((redis::ErrorKind::UnexpectedReturnType, "a short pipeline answer"));
        let value = answers.pop_front().ok_or_else(short)?;
        let values = if read.is_empty() {
            Vec::new()
        } else {
            redis::from_redis_value(answers.pop_front().ok_or_else(short)?)?
        };
        let acked = if acks > 0 { redis::from_redis_value(answers.pop_front().ok_or_else(short)?)? } else { 0 };
        Ok((value, values, acked))
    };
    metrics.redis_round_trip();
    let (value, values, acked) = match run(call("EVALSHA", script.get_hash())).await {
        Err(err) if err.kind() == redis::ErrorKind::Server(ServerErrorKind::NoScript) => {
            metrics.redis_round_trip();
            run(call("EVAL", source)).await.map_err(classify)?
        }
        other => other.map_err(classify)?,
    };
    if acked < acks {
        return Err(StoreError::Redis(format!("the writes acknowledged by {acked} of {acks} replicas within {wait_ms} ms (--replica-acks)")));
    }
    Ok((value, values))
}

/// Serves lane `id` of `lanes` until it is empty: after [`LaneWork::gather`], takes the work
/// waiting (whole units up to [`MAX_SCRIPT_COUNTERS`], at least one), runs it in one script call,
/// answers each unit; then the work that came meanwhile, at most one call per
/// [`LaneWork::pace`].
async fn run_lane<W: LaneWork>(calls: Calls, lanes: Lanes<W>, id: u32) {
    let mut started: Option<Instant> = None;
    let gather = W::gather(&calls);
    if !gather.is_zero() {
        tokio::time::sleep(gather).await;
    }
    loop {
        // At most one call per pace: the work arriving meanwhile merges into the next.
        if let Some(rest) = started.and_then(|at| W::pace(&calls).checked_sub(at.elapsed())) {
            tokio::time::sleep(rest).await;
        }
        let (work, answers): (Vec<W>, Vec<_>) = {
            let mut lanes = lanes.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(waiting) = lanes.get_mut(&id) else { return };
            let count = to_take(waiting.iter().map(|(work, _)| work.size()), MAX_SCRIPT_COUNTERS);
            if count == 0 {
                lanes.remove(&id);
                return;
            }
            waiting.drain(..count).unzip()
        };
        started = Some(Instant::now());
        let result = match tokio::time::timeout(calls.timeout, W::call(&calls, &work)).await {
            Ok(result) => result,
            Err(_) => Err(StoreError::Timeout(calls.timeout)),
        };
        match result {
            Ok(outcomes) => {
                for (answer, outcome) in answers.into_iter().zip(outcomes) {
                    let _ = answer.send(Ok(outcome));
                }
            }
            Err(err) => {
                calls.errors.log(W::WHAT, &err);
                for answer in answers {
                    let _ = answer.send(Err(err.clone()));
                }
            }
        }
    }
}

impl Calls {
    /// A script call on the lane's connection, and the values of `read` after it in the same
    /// round trip: the retrying connection for batches (their dedup makes a retry safe), the one
    /// that does not retry for asks and leases (a grant must not be counted twice); answered once
    /// `acks` replicas have its writes (0: at once).
    #[allow(clippy::too_many_arguments)]
    async fn eval(&self, retry: bool, script: &Script, source: &str, keys: &[&str], args: &[String], read: &[&str], acks: u32) -> Result<(Value, Vec<Value>), StoreError> {
        match &self.backend {
            Backend::Single(manager) => {
                let mut conn = manager.clone();
                eval(&mut conn, script, source, keys, args, read, &self.metrics, self.timeout, acks).await
            }
            Backend::Cluster { retrying, once } => {
                let mut conn = connected(if retry { retrying } else { once })?;
                eval(&mut conn, script, source, keys, args, read, &self.metrics, self.timeout, acks).await
            }
        }
    }

    /// The values of `keys` (`MGET`, on the retrying connection: a read is safe to repeat).
    async fn read(&self, keys: &[&str]) -> Result<Vec<Value>, StoreError> {
        let mut get = Cmd::new();
        get.arg("MGET").arg(keys);
        self.metrics.redis_round_trip();
        let values = match &self.backend {
            Backend::Single(manager) => get.query_async::<Vec<Value>>(&mut manager.clone()).await,
            Backend::Cluster { retrying, .. } => get.query_async::<Vec<Value>>(&mut connected(retrying)?).await,
        };
        values.map_err(|err| classify(self.timeout, err))
    }
}

impl LaneWork for BatchPart {
    type Outcome = GroupOutcome;
    const WHAT: &'static str = "batch";

    fn pace(calls: &Calls) -> Duration {
        calls.batch_pace
    }

    fn gather(calls: &Calls) -> Duration {
        calls.batch_gather
    }

    fn size(&self) -> usize {
        self.group.counters.len()
    }

    async fn call(calls: &Calls, parts: &[BatchPart]) -> Result<Vec<GroupOutcome>, StoreError> {
        let groups: Vec<(u64, &Group)> = parts.iter().map(|part| (part.seq, &part.group)).collect();
        let reads = reads(&groups);
        // Parts that change nothing (a proxy's refreshes) only read: no script, no dedup.
        if !groups.iter().any(|(_, group)| handed(group)) {
            let values = calls.read(&reads.keys).await?;
            return parse_reply(Value::Array(Vec::new()), values, &reads, &groups);
        }
        let (keys, args) = script_arguments(&groups);
        // The totals are read after the script, so that they see its writes (module doc,
        // "Merging").
        let (reply, values) = calls.eval(true, &calls.script, SCRIPT_SOURCE, &keys, &args, &reads.keys, 0).await?;
        let outcomes = parse_reply(reply, values, &reads, &groups)?;
        calls.metrics.batch_call();
        Ok(outcomes)
    }
}

impl LaneWork for PlannedLease {
    type Outcome = Grant;
    const WHAT: &'static str = "ask";

    fn pace(calls: &Calls) -> Duration {
        calls.ask_pace
    }

    /// A request waits for its ask: none.
    fn gather(_: &Calls) -> Duration {
        Duration::ZERO
    }

    fn size(&self) -> usize {
        1
    }

    async fn call(calls: &Calls, asks: &[PlannedLease]) -> Result<Vec<Grant>, StoreError> {
        let (keys, args) = ask_arguments(asks);
        let (reply, _) = calls.eval(false, &calls.ask_script, ASK_SOURCE, &keys, &args, &[], 0).await?;
        parse_grants(reply, asks.len())
    }
}

/// How many of the parts waiting (their sizes in counters, in order) one script call takes: whole
/// parts up to `max` counters in all, at least one (a larger part goes alone), so that a call
/// does not hold Redis for one long script.
fn to_take(sizes: impl Iterator<Item = usize>, max: usize) -> usize {
    let (mut taken, mut counters) = (0usize, 0usize);
    for size in sizes {
        if taken > 0 && counters.saturating_add(size) > max {
            break;
        }
        counters = counters.saturating_add(size);
        taken = taken.saturating_add(1);
    }
    taken
}

/// Whether the script is handed `counter`: it adds to it or gives back. The script answers the
/// value of each counter it is handed; the others, and every previous bucket, are read after it
/// ([`reads`]).
fn changes(counter: &PlannedCounter) -> bool {
    counter.delta > 0 || counter.refund > 0
}

/// The counters of `group` the script is handed ([`changes`]), in the group's order.
fn changed(group: &Group) -> impl Iterator<Item = &PlannedCounter> {
    group.counters.iter().filter(|c| changes(c))
}

/// Whether the script is handed `group`: it changes a counter. One that does not only reads,
/// and has nothing to keep exactly once.
fn handed(group: &Group) -> bool {
    changed(group).next().is_some()
}

/// Where a counter's total comes from: the script's answer (the n-th distinct key it was
/// handed) or the `MGET` after it (the n-th key read).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    Answered(usize),
    Read(usize),
}

/// Where each counter of the groups (in order) finds its current and previous totals: the keys
/// the script answers for (each distinct key handed once, in order of first appearance, as
/// `apply.lua` lists them) and those the `MGET` after it reads (each distinct key once).
struct Reads<'a> {
    keys: Vec<&'a str>,
    answered: usize,
    at: Vec<(Source, Option<usize>)>,
}

/// The totals of every counter of `groups`: its current bucket's from the script's answer when
/// the script is handed it, else, and its previous bucket's, from the `MGET` after the script,
/// each distinct key once: the parts a call merges share their hot counters.
fn reads<'a>(groups: &[(u64, &'a Group)]) -> Reads<'a> {
    let mut answered: HashMap<&'a str, usize> = HashMap::new();
    for counter in groups.iter().flat_map(|(_, group)| changed(group)) {
        let next = answered.len();
        answered.entry(counter.current_key.as_str()).or_insert(next);
    }
    let mut keys = Vec::new();
    let mut index: HashMap<&'a str, usize> = HashMap::new();
    let mut place = |key: &'a str| {
        *index.entry(key).or_insert_with(|| {
            keys.push(key);
            keys.len().saturating_sub(1)
        })
    };
    let at = groups
        .iter()
        .flat_map(|(_, group)| &group.counters)
        .map(|counter| {
            let current = counter.current_key.as_str();
            let source = match answered.get(current) {
                Some(&n) => Source::Answered(n),
                None => Source::Read(place(current)),
            };
            (source, counter.previous_key.as_deref().map(&mut place))
        })
        .collect();
    Reads { keys, answered: answered.len(), at }
}

/// The script's KEYS and ARGV for the groups of `groups` it is handed ([`handed`]), each with
/// its batch's seq (see `apply.lua`): the counters each group changes ([`changes`]), each as
/// one argument, its delta, unless it gives units back or expires at another time than the
/// group's first counter.
fn script_arguments<'a>(groups: &[(u64, &'a Group)]) -> (Vec<&'a str>, Vec<String>) {
    let groups: Vec<(u64, &Group)> = groups.iter().copied().filter(|(_, group)| handed(group)).collect();
    let counters: usize = groups.iter().map(|(_, group)| changed(group).count()).sum();
    let mut keys: Vec<&str> = Vec::with_capacity(groups.len().saturating_mul(2).saturating_add(counters));
    let mut args: Vec<String> = Vec::with_capacity(
        1usize
            .saturating_add(groups.len().saturating_mul(5))
            .saturating_add(counters),
    );
    args.push(groups.len().to_string());
    for (seq, group) in &groups {
        let expire_at_ms = changed(group).next().map_or(0, |c| c.expire_at_ms);
        keys.push(&group.seen_key);
        keys.push(&group.seen_before_key);
        args.push(seq.to_string());
        args.push(group.seen_field.clone());
        args.push(group.seen_expire_at_ms.to_string());
        args.push(changed(group).count().to_string());
        args.push(expire_at_ms.to_string());
        for counter in changed(group) {
            keys.push(&counter.current_key);
            args.push(if counter.refund == 0 && counter.expire_at_ms == expire_at_ms {
                counter.delta.to_string()
            } else {
                format!("{}:{}:{}", counter.delta, counter.refund, counter.expire_at_ms)
            });
        }
    }
    (keys, args)
}

/// The script's `{applied_1 .. applied_g, value_1 .. value_n}` (a flag per group it was handed:
/// those that change a counter; then the value of each distinct key it was handed) and the
/// values the `MGET` after it read ([`reads`]) into each group's outcome, its counters' totals in
/// the group's order; a group that changes nothing counts as applied. A call with no group
/// handed has no script: its `reply` is an empty array.
fn parse_reply(reply: Value, values: Vec<Value>, reads: &Reads, groups: &[(u64, &Group)]) -> Result<Vec<GroupOutcome>, StoreError> {
    let Value::Array(mut items) = reply else {
        return Err(StoreError::Reply(format!(
            "expected an array, got {reply:?}"
        )));
    };
    let flags = groups.iter().filter(|(_, group)| handed(group)).count();
    if items.len() != flags.saturating_add(reads.answered) {
        return Err(StoreError::Reply(format!(
            "expected {flags} flags and {} values, got {} items",
            reads.answered,
            items.len()
        )));
    }
    if values.len() != reads.keys.len() {
        return Err(StoreError::Reply(format!("{} keys read, {} values", reads.keys.len(), values.len())));
    }
    let answered: Vec<u64> = items.split_off(flags).into_iter().map(total).collect::<Result<_, _>>()?;
    let values: Vec<u64> = values.into_iter().map(total).collect::<Result<_, _>>()?;
    let out_of_range = || StoreError::Reply("a total out of range".into());
    let read = |at: usize| values.get(at).copied().ok_or_else(out_of_range);
    let value = |source: Source| match source {
        Source::Answered(at) => answered.get(at).copied().ok_or_else(out_of_range),
        Source::Read(at) => read(at),
    };
    let mut at = reads.at.iter();
    let mut flags = items.into_iter();
    let mut outcomes = Vec::with_capacity(groups.len());
    for (_, group) in groups {
        let applied = match handed(group).then(|| flags.next()) {
            None => true,
            Some(Some(Value::Int(1))) => true,
            Some(Some(Value::Int(0))) => false,
            Some(other) => return Err(StoreError::Reply(format!("applied flag {other:?}"))),
        };
        let mut totals = Vec::with_capacity(group.counters.len());
        for _ in &group.counters {
            let &(current, previous) = at.next().ok_or_else(|| StoreError::Reply("fewer reads than counters".into()))?;
            totals.push(Totals {
                current: value(current)?,
                previous: previous.map(read).transpose()?.unwrap_or(0),
            });
        }
        outcomes.push(GroupOutcome { applied, totals });
    }
    Ok(outcomes)
}

/// `{granted, current, previous}` (see `lease.lua`) into a [`Grant`].
fn parse_grant(reply: Value) -> Result<Grant, StoreError> {
    match reply {
        Value::Array(items) => match <[Value; 4]>::try_from(items) {
            Ok([granted, current, previous, reclaimed]) => Ok(Grant {
                granted: total(granted)?,
                current: total(current)?,
                previous: total(previous)?,
                reclaimed: total(reclaimed)?,
            }),
            Err(items) => Err(StoreError::Reply(format!(
                "expected 4 values, got {}",
                items.len()
            ))),
        },
        other => Err(StoreError::Reply(format!("expected an array, got {other:?}"))),
    }
}

/// The script's KEYS and ARGV for `asks` (see `ask.lua`).
fn ask_arguments(asks: &[PlannedLease]) -> (Vec<&str>, Vec<String>) {
    let mut keys: Vec<&str> = Vec::with_capacity(asks.len().saturating_mul(2));
    let mut args: Vec<String> = Vec::with_capacity(asks.len().saturating_mul(11).saturating_add(1));
    args.push(asks.len().to_string());
    for ask in asks {
        keys.push(&ask.current_key);
        let [window_ms, remaining_ms, limit, want, _, _, expire_at_ms, ..] = ask.args;
        args.extend([window_ms, remaining_ms, limit, want, expire_at_ms].iter().map(u64::to_string));
        match &ask.previous_key {
            Some(previous) => {
                keys.push(previous);
                args.push("1".into());
            }
            None => args.push("0".into()),
        }
        match &ask.carried {
            Some(carried) => {
                args.extend([
                    carried.units.to_string(),
                    carried.seen_field.clone(),
                    carried.seq.to_string(),
                    carried.seen_keys.len().to_string(),
                    carried.part_field.clone().unwrap_or_default(),
                ]);
                keys.extend(carried.seen_keys.iter().map(String::as_str));
            }
            None => args.extend(["0", "", "0", "0", ""].map(String::from)),
        }
    }
    (keys, args)
}

/// `{granted, current, previous}` per ask (see `ask.lua`) into its [`Grant`].
fn parse_grants(reply: Value, asks: usize) -> Result<Vec<Grant>, StoreError> {
    let Value::Array(items) = reply else {
        return Err(StoreError::Reply(format!("expected an array, got {reply:?}")));
    };
    if items.len() != asks.saturating_mul(3) {
        return Err(StoreError::Reply(format!("expected {} values, got {}", asks.saturating_mul(3), items.len())));
    }
    let mut items = items.into_iter();
    let mut grants = Vec::with_capacity(asks);
    while let (Some(granted), Some(current), Some(previous)) = (items.next(), items.next(), items.next()) {
        grants.push(Grant { granted: total(granted)?, current: total(current)?, previous: total(previous)?, reclaimed: 0 });
    }
    Ok(grants)
}

/// A counter's value: absent is 0; a negative one (written by someone else) reads as 0.
fn total(value: Value) -> Result<u64, StoreError> {
    match value {
        Value::Nil => Ok(0),
        Value::Int(n) => Ok(u64::try_from(n).unwrap_or(0)),
        Value::BulkString(bytes) => std::str::from_utf8(&bytes)
            .ok()
            .and_then(|text| text.parse::<i64>().ok())
            .map(|n| u64::try_from(n).unwrap_or(0))
            .ok_or_else(|| {
                StoreError::Reply(format!(
                    "a counter holds {:?}, not an integer",
                    String::from_utf8_lossy(&bytes)
                ))
            }),
        other => Err(StoreError::Reply(format!("counter value {other:?}"))),
    }
}

fn connected(
    receiver: &watch::Receiver<Option<ClusterConnection>>,
) -> Result<ClusterConnection, StoreError> {
    receiver
        .borrow()
        .clone()
        .ok_or_else(|| StoreError::NotConnected("no seed node has answered yet".into()))
}

/// Builds the cluster client's connection, retrying (with a growing pause up to 2 s) until a
/// seed node answers; the client then follows the cluster on its own.
async fn connect_cluster(
    client: ClusterClient,
    sender: watch::Sender<Option<ClusterConnection>>,
    errors: Arc<ErrorLog>,
) {
    let mut pause = Duration::from_millis(100);
    loop {
        match client.get_async_connection().await {
            Ok(conn) => {
                info!("redis: connected to the cluster");
                let _ = sender.send(Some(conn));
                return;
            }
            Err(err) => {
                errors.log("connecting to the cluster", &StoreError::from(err));
                tokio::time::sleep(pause).await;
                pause = pause.saturating_mul(2).min(Duration::from_secs(2));
            }
        }
    }
}

/// A Redis URL without its password, for logs.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let (head, tail) = url.split_at(scheme.saturating_add(3));
            let userinfo = tail.get(..at.saturating_sub(head.len())).unwrap_or("");
            let rest = url.get(at..).unwrap_or("");
            match userinfo.split_once(':') {
                Some((user, _password)) => format!("{head}{user}:***{rest}"),
                None => format!("{head}***{rest}"),
            }
        }
        _ => url.to_string(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::panic,
        clippy::indexing_slicing
    )]

    use super::*;
    use crate::layout::{plan, Layout};
    use crate::protocol::parse_batch;

    fn two_shard_plan() -> Plan {
        let body = r#"{"version": 1, "proxy": "0123456789abcdef", "seq": 5, "counters": [
            {"key": "00000001aaaaaaaaaaaaaaaaaaaaaaaa", "window_ms": 1000, "bucket": 7, "delta": 3, "refund": 2},
            {"key": "00000000bbbbbbbbbbbbbbbbbbbbbbbb", "window_ms": 1000, "bucket": 0, "delta": 0}
        ]}"#;
        plan(
            &Layout::new("fg:", 16),
            &parse_batch(body.as_bytes(), 10).unwrap(),
        )
    }

    #[test]
    fn script_arguments_follow_the_scripts_layout_and_reads_stay_out_of_it() {
        let plan = two_shard_plan();
        let groups: Vec<(u64, &Group)> = plan.groups.iter().map(|g| (plan.seq, g)).collect();
        let (keys, args) = script_arguments(&groups);
        // Shard 0's counter is only read (delta 0): its group does not go to the script (nothing
        // to keep exactly once). The counter shard 1's group changes gives units back: its
        // argument is the long form.
        assert_eq!(
            keys,
            vec![
                "fg:{1}:seen:600000:0",
                "fg:{1}:seen:600000:0",
                "fg:{1}:00000001aaaaaaaaaaaaaaaaaaaaaaaa:1000:7",
            ]
        );
        assert_eq!(args, vec!["1", "5", "0123456789abcdef", "1200000", "1", "69000", "3:2:69000"]);
        // The script answers for the counter it changes; the other and every previous bucket
        // are read after it.
        let reads = reads(&groups);
        assert_eq!(
            reads.keys,
            vec![
                "fg:{0}:00000000bbbbbbbbbbbbbbbbbbbbbbbb:1000:0",
                "fg:{1}:00000001aaaaaaaaaaaaaaaaaaaaaaaa:1000:6",
            ]
        );
        assert_eq!(reads.answered, 1);
        assert_eq!(reads.at, vec![(Source::Read(0), None), (Source::Answered(0), Some(1))]);
        // Two copies of the plan in one call (two proxies' parts merged): each key answered or
        // read once.
        let twice: Vec<(u64, &Group)> = groups.iter().chain(&groups).copied().collect();
        let merged = super::reads(&twice);
        assert_eq!((merged.keys.clone(), merged.answered), (reads.keys.clone(), 1));
        assert_eq!(merged.at, [reads.at.clone(), reads.at.clone()].concat());
    }

    #[test]
    fn a_counter_with_only_a_delta_is_one_argument_and_another_expiry_is_spelled_out() {
        let body = r#"{"version": 1, "proxy": "0123456789abcdef", "seq": 9, "counters": [
            {"key": "00000001aaaaaaaaaaaaaaaaaaaaaaaa", "window_ms": 1000, "bucket": 7, "delta": 3},
            {"key": "00000001bbbbbbbbbbbbbbbbbbbbbbbb", "window_ms": 1000, "bucket": 7, "delta": 4},
            {"key": "00000001cccccccccccccccccccccccc", "window_ms": 60000, "bucket": 7, "delta": 5}
        ]}"#;
        let plan = plan(&Layout::new("fg:", 16).single_node(), &parse_batch(body.as_bytes(), 10).unwrap());
        let groups: Vec<(u64, &Group)> = plan.groups.iter().map(|g| (plan.seq, g)).collect();
        let (keys, args) = script_arguments(&groups);
        assert_eq!(keys.len(), 2 + 3);
        assert_eq!(args, vec!["1", "9", "0123456789abcdef", &plan.groups[0].seen_expire_at_ms.to_string(), "3", "69000", "3", "4", "5:0:600000"]);
    }

    #[test]
    fn replies_parse_into_totals_and_flags() {
        let plan = two_shard_plan();
        let groups: Vec<(u64, &Group)> = plan.groups.iter().map(|g| (plan.seq, g)).collect();
        let reads = reads(&groups);
        // One flag: shard 0's group only reads, so it was not handed to the script and counts as
        // applied; then the value of the one counter the script was handed.
        let reply = Value::Array(vec![Value::Int(0), Value::Int(12)]);
        let values = || vec![Value::BulkString(b"3".to_vec()), Value::BulkString(b"40".to_vec())];
        let outcomes = parse_reply(reply.clone(), values(), &reads, &groups).unwrap();
        assert_eq!(
            outcomes,
            vec![
                GroupOutcome { applied: true, totals: vec![Totals { current: 3, previous: 0 }] },
                GroupOutcome { applied: false, totals: vec![Totals { current: 12, previous: 40 }] },
            ]
        );
        // A counter that does not exist (a nil answer) is at 0.
        let nil = parse_reply(Value::Array(vec![Value::Int(1), Value::Nil]), values(), &reads, &groups).unwrap();
        assert_eq!(nil[1].totals, vec![Totals { current: 0, previous: 40 }]);
        let short = Value::Array(vec![Value::Int(0)]);
        assert!(parse_reply(short, values(), &reads, &groups).is_err());
        assert!(parse_reply(reply.clone(), Vec::new(), &reads, &groups).is_err());
        assert!(parse_reply(reply.clone(), values()[..1].to_vec(), &reads, &groups).is_err());
        let mut more = values();
        more.push(Value::Nil);
        assert!(parse_reply(reply.clone(), more, &reads, &groups).is_err());
        let garbage = vec![Value::BulkString(b"3".to_vec()), Value::BulkString(b"x".to_vec())];
        assert!(parse_reply(reply.clone(), garbage, &reads, &groups).is_err());
        let not_a_number = Value::Array(vec![Value::Int(0), Value::BulkString(b"x".to_vec())]);
        assert!(parse_reply(not_a_number, values(), &reads, &groups).is_err());
        assert!(parse_reply(Value::Array(vec![Value::Int(0), Value::Int(1), Value::Int(12)]), values(), &reads, &groups).is_err());
        assert!(parse_reply(Value::Array(vec![Value::Int(2), Value::Int(12)]), values(), &reads, &groups).is_err());
        // A merged call: both copies take their totals from the one answer or read of each key.
        let twice: Vec<(u64, &Group)> = groups.iter().chain(&groups).copied().collect();
        let flags = Value::Array(vec![Value::Int(0), Value::Int(1), Value::Int(12)]);
        let merged = parse_reply(flags, values(), &super::reads(&twice), &twice).unwrap();
        assert_eq!(merged[2].totals, outcomes[0].totals);
        assert_eq!(merged[3].totals, outcomes[1].totals);
        let applied: Vec<bool> = merged.iter().map(|m| m.applied).collect();
        assert_eq!(applied, [true, false, true, true]);
    }

    #[test]
    fn a_call_takes_whole_parts_up_to_the_limit() {
        // Takes from the front, call after call, as a lane's runner does.
        let calls = |sizes: &[usize], max| -> Vec<Vec<usize>> {
            let mut left = sizes.to_vec();
            let mut calls = Vec::new();
            while !left.is_empty() {
                let n = to_take(left.iter().copied(), max);
                calls.push(left.drain(..n).collect());
            }
            calls
        };
        let sizes = [3, 4, 10, 1, 2];
        assert_eq!(calls(&sizes, 1000), vec![vec![3, 4, 10, 1, 2]]);
        assert_eq!(calls(&sizes, 7), vec![vec![3, 4], vec![10], vec![1, 2]]);
        assert_eq!(calls(&sizes, 1), vec![vec![3], vec![4], vec![10], vec![1], vec![2]]);
        assert_eq!(to_take(std::iter::empty(), 7), 0);
    }

    #[test]
    fn a_tls_failure_says_so_over_tls_only() {
        let refused = StoreError::Redis("invalid peer certificate: UnknownIssuer".into());
        assert!(tls_hint(true, &refused).contains("TLS: check --redis-ca"));
        assert_eq!(tls_hint(false, &refused), "");
        assert_eq!(tls_hint(true, &StoreError::Redis("Connection refused (os error 111)".into())), "");
        assert_eq!(tls_hint(true, &StoreError::Timeout(Duration::from_millis(5))), "");
    }

    #[test]
    fn tls_urls_and_certificates_go_together() {
        let config = |urls: &[&str], ca: bool| StoreConfig {
            urls: urls.iter().map(|u| u.to_string()).collect(),
            cluster: urls.len() > 1,
            timeout: Duration::from_secs(1),
            batch_pace: DEFAULT_BATCH_PACE,
            batch_gather: DEFAULT_BATCH_GATHER,
            ask_pace: DEFAULT_ASK_PACE,
            replica_acks: 0,
            tls: StoreTls {
                ca: ca.then(|| b"pem".to_vec()),
                client: None,
            },
        };
        assert!(is_tls("rediss://h:1") && is_tls("REDISS://h") && is_tls("valkeys://h"));
        assert!(!is_tls("redis://h:1") && !is_tls("redis"));
        assert!(tls_of(&config(&["redis://a"], false)).unwrap().is_none());
        assert!(tls_of(&config(&["rediss://a"], false)).unwrap().is_none());
        assert!(tls_of(&config(&["rediss://a", "rediss://b"], true)).unwrap().is_some());
        let error = |config: &StoreConfig| tls_of(config).err().unwrap_or_default();
        assert!(error(&config(&["rediss://a", "redis://b"], false)).contains("every URL"));
        assert!(error(&config(&["redis://a"], true)).contains("need rediss://"));
        assert_eq!(
            format!("{:?}", config(&["rediss://a"], true).tls),
            "StoreTls { ca: true, client certificate: false }"
        );
    }

    #[test]
    fn urls_lose_their_password_in_logs() {
        assert_eq!(redact("redis://127.0.0.1:6379"), "redis://127.0.0.1:6379");
        assert_eq!(
            redact("redis://user:secret@host:6379/0"),
            "redis://user:***@host:6379/0"
        );
        assert_eq!(redact("redis://:secret@host"), "redis://:***@host");
        assert_eq!(redact("redis://token@host"), "redis://***@host");
        assert_eq!(
            redact("rediss://floodgate:secret@redis.example:6380"),
            "rediss://floodgate:***@redis.example:6380"
        );
    }
}
