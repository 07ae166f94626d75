//! The bulkhead end to end: the built module in
//! a real Envoy (2 workers) in front of 8 real upstream clusters.
//!
//! * Virtual partitions (`cluster_selection.partition`, 8 clusters in partitions of 2): each
//!   key's requests reach only its own 2 clusters, the same on both workers and after a restart;
//!   the partitions are uniform over the C(8, 2) = 28 subsets, so 1 key in 28 shares a poison
//!   key's whole partition; a poison key whose requests crash what serves them takes down only
//!   its own 2 clusters, and every key that keeps a healthy cluster succeeds (≥ 99.5 %), unlike
//!   the same load without partitions.
//! * Per-key caps (`load_shedding.per_key`): a key that hangs its requests holds at most its cap
//!   in flight, so it cannot fill its clusters' limits; the cap is exact across workers under a
//!   burst (N admitted, the rest refused fast with a 503 naming the cap), and comes back to
//!   zero after client hang-ups and upstream resets.
//!
//! Figures are printed (`--nocapture`) for the closing notes.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use floodgate::selection::partition::Partitioner;
use floodgate::config::Config;
use floodgate_integration::faults::{hang_up, HangUp, UpstreamProcess};
use floodgate_integration::*;

const ROUTE_HEADER: &str = "x-floodgate-cluster";
const CLIENT: &str = "x-client";
const POISON: &str = "poison";
const CLUSTERS: usize = 8;
const SIZE: usize = 2;
/// C(8, 2).
const SUBSETS: usize = 28;
/// Keys of the normal traffic: 30 per subset on average.
const KEYS: usize = 30 * SUBSETS;

fn cluster_name(index: usize) -> String {
    format!("pool-{index}")
}

fn key_name(index: usize) -> String {
    format!("client-{index}")
}

/// 8 upstreams counting requests per client key, poisoned as `effect` says by the key `poison`,
/// and the gauge of the poison requests hanging in them.
fn upstreams(effect: PoisonEffect) -> (Vec<Upstream>, Arc<HangingGauge>) {
    let gauge = Arc::new(HangingGauge::default());
    let upstreams = (0..CLUSTERS)
        .map(|_| {
            Upstream::with_options(UpstreamOptions {
                count_header: Some(CLIENT.into()),
                poison: Some(Poison { header: CLIENT.into(), value: POISON.into(), effect, gauge: gauge.clone() }),
                ..UpstreamOptions::default()
            })
        })
        .collect();
    (upstreams, gauge)
}

/// A key's partition as the module's own code computes it, natively (the hash is keyed by the
/// configuration alone, so a 64-bit build agrees with the 32-bit Wasm one in Envoy).
fn partitioner(config: &Value) -> Partitioner {
    let config = Config::parse(config.to_string().as_bytes()).expect("a valid configuration");
    Partitioner::new(config.cluster_selection.as_ref().expect("cluster_selection")).expect("a partition")
}

fn computed_partition(partitioner: &Partitioner, key: &str) -> BTreeSet<usize> {
    let hash = partitioner.key_hash(|_| Some(key.as_bytes())).expect("the key");
    partitioner.confine(hash).members.into_iter().collect()
}

fn selection(partition: bool, limit: Value) -> Value {
    let clusters: Vec<String> = (0..CLUSTERS).map(cluster_name).collect();
    let mut selection = json!({"route_header": ROUTE_HEADER, "clusters": clusters, "concurrency_limit": limit});
    if partition {
        selection["partition"] = json!({"key": [{"header": CLIENT}], "size": SIZE});
    }
    selection
}

fn start(config: &Value, upstreams: &[Upstream], route_timeout: Duration) -> Envoy {
    let mut builder = Envoy::builder(config).route_by_header(ROUTE_HEADER).route_timeout(route_timeout);
    for (index, upstream) in upstreams.iter().enumerate() {
        builder = builder.cluster(&cluster_name(index), &[upstream.addr()]);
    }
    builder.start()
}

/// Per upstream, the requests of each key so far.
fn snapshot(upstreams: &[Upstream]) -> Vec<HashMap<Vec<u8>, u64>> {
    upstreams.iter().map(Upstream::counts).collect()
}

/// The clusters each key reached between two snapshots.
fn reached(before: &[HashMap<Vec<u8>, u64>], after: &[HashMap<Vec<u8>, u64>]) -> HashMap<String, BTreeSet<usize>> {
    let mut reached: HashMap<String, BTreeSet<usize>> = HashMap::new();
    for (index, (b, a)) in before.iter().zip(after).enumerate() {
        for (key, count) in a {
            if *count > b.get(key).copied().unwrap_or(0) {
                reached.entry(String::from_utf8_lossy(key).into_owned()).or_default().insert(index);
            }
        }
    }
    reached
}

/// Statuses per key.
#[derive(Default, Debug, Clone)]
struct Outcomes {
    ok: u64,
    failed: u64,
    statuses: BTreeMap<u16, u64>,
    /// The 503s refused by load shedding's per-key cap (their problem+json names it).
    per_key_refused: u64,
}

impl Outcomes {
    fn add(&mut self, status: Option<u16>) {
        match status {
            Some(200) => self.ok += 1,
            _ => self.failed += 1,
        }
        *self.statuses.entry(status.unwrap_or(0)).or_default() += 1;
    }
    fn merge(&mut self, other: &Outcomes) {
        self.ok += other.ok;
        self.failed += other.failed;
        self.per_key_refused += other.per_key_refused;
        for (s, n) in &other.statuses {
            *self.statuses.entry(*s).or_default() += n;
        }
    }
    fn total(&self) -> u64 {
        self.ok + self.failed
    }
    fn rate(&self) -> f64 {
        self.ok as f64 / self.total().max(1) as f64
    }
}

/// `clients` keep-alive connections send requests of the keys in turn (each client its own
/// slice of the rotation), `rounds` times over the keys, or until `stop` is set; a pause of
/// `pause` after each request. Outcomes per key.
async fn drive(
    addr: SocketAddr,
    keys: Arc<Vec<String>>,
    clients: usize,
    rounds: Option<usize>,
    stop: Arc<AtomicBool>,
    pause: Duration,
) -> HashMap<String, Outcomes> {
    let next = Arc::new(AtomicU64::new(0));
    let limit = rounds.map(|r| (r * keys.len()) as u64);
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let (keys, next, stop) = (keys.clone(), next.clone(), stop.clone());
            tokio::spawn(async move {
                let mut seen: HashMap<String, Outcomes> = HashMap::new();
                let mut client: Option<Client> = None;
                while !stop.load(Ordering::Relaxed) {
                    let n = next.fetch_add(1, Ordering::Relaxed);
                    if limit.is_some_and(|l| n >= l) {
                        break;
                    }
                    let key = &keys[(n % keys.len() as u64) as usize];
                    if client.is_none() {
                        client = Client::connect(addr).await.ok();
                    }
                    let status = match client.as_mut() {
                        Some(c) => match c.get("/work", &[(CLIENT, key.as_str())]).await {
                            Ok(r) => Some(r.status),
                            Err(_) => {
                                client = None;
                                None
                            }
                        },
                        None => None,
                    };
                    seen.entry(key.clone()).or_default().add(status);
                    if !pause.is_zero() {
                        tokio::time::sleep(pause).await;
                    }
                }
                seen
            })
        })
        .collect();
    let mut all: HashMap<String, Outcomes> = HashMap::new();
    for task in tasks {
        for (key, outcomes) in task.await.expect("load task") {
            all.entry(key).or_default().merge(&outcomes);
        }
    }
    all
}

fn normal_keys() -> Arc<Vec<String>> {
    Arc::new((0..KEYS).map(key_name).collect())
}

/// Runs the normal keys (32 clients) and the poison key (`poison_clients`, each pausing
/// `poison_pause` between requests) together for `duration`.
async fn poison_phase(
    addr: SocketAddr,
    duration: Duration,
    poison_clients: usize,
    poison_pause: Duration,
) -> (HashMap<String, Outcomes>, Outcomes, Vec<String>) {
    let stop = Arc::new(AtomicBool::new(false));
    let poison_bodies = Arc::new(Mutex::new(Vec::new()));
    let poison_tasks: Vec<_> = (0..poison_clients)
        .map(|_| {
            let (stop, bodies) = (stop.clone(), poison_bodies.clone());
            tokio::spawn(async move {
                let mut outcomes = Outcomes::default();
                while !stop.load(Ordering::Relaxed) {
                    // One connection per request: a hanging request's connection goes with it.
                    let status = match Client::connect(addr).await {
                        Ok(mut c) => match c.get("/work", &[(CLIENT, POISON)]).await {
                            Ok(r) => {
                                if r.status == 503 {
                                    let body: Value = serde_json::from_slice(&r.body).unwrap_or(Value::Null);
                                    if body["cap"] == "load_shedding.per_key" {
                                        outcomes.per_key_refused += 1;
                                    }
                                    let mut bodies = bodies.lock().unwrap();
                                    if bodies.len() < 3 {
                                        bodies.push(r.text());
                                    }
                                }
                                Some(r.status)
                            }
                            Err(_) => None,
                        },
                        Err(_) => None,
                    };
                    outcomes.add(status);
                    tokio::time::sleep(poison_pause).await;
                }
                outcomes
            })
        })
        .collect();
    let normal = tokio::spawn(drive(addr, normal_keys(), 32, None, stop.clone(), Duration::ZERO));
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    let normal = normal.await.expect("normal load");
    let mut poison = Outcomes::default();
    for task in poison_tasks {
        poison.merge(&task.await.expect("poison task"));
    }
    let bodies = poison_bodies.lock().unwrap().clone();
    (normal, poison, bodies)
}

/// The normal keys' outcomes, split by whether the key's partition is the poison key's.
fn split(normal: &HashMap<String, Outcomes>, same_as_poison: &BTreeSet<String>) -> (Outcomes, Outcomes) {
    let (mut others, mut sharing) = (Outcomes::default(), Outcomes::default());
    for (key, outcomes) in normal {
        if same_as_poison.contains(key) {
            sharing.merge(outcomes);
        } else {
            others.merge(outcomes);
        }
    }
    (others, sharing)
}

/// Virtual partitions. Maps every key's partition through a real Envoy, checks they
/// are confined, stable and uniform, then lets a poison key crash the clusters it reaches.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_key_takes_down_only_its_own_partition() {
    let (upstreams, _) = upstreams(PoisonEffect::Crash(Duration::from_millis(300)));
    let limit = json!({"initial_limit": 100, "min_limit": 50, "max_limit": 200});
    let config = json!({"cluster_selection": selection(true, limit.clone())});
    let computed = partitioner(&config);

    // 1. The partitions, as the upstreams see them: 12 requests per key, on 2 workers.
    let envoy = start(&config, &upstreams, Duration::from_secs(5));
    let before = snapshot(&upstreams);
    let started = Instant::now();
    let mapping = drive(envoy.addr(), normal_keys(), 32, Some(12), Arc::new(AtomicBool::new(false)), Duration::ZERO).await;
    let poison_mapping = drive(envoy.addr(), Arc::new(vec![POISON.to_owned()]), 4, Some(24), Arc::new(AtomicBool::new(false)), Duration::ZERO).await;
    let partitions = reached(&before, &snapshot(&upstreams));
    let total: u64 = mapping.values().map(Outcomes::total).sum();
    println!("mapping: {total} requests of {KEYS} keys in {:?}", started.elapsed());
    assert!(mapping.values().all(|o| o.failed == 0), "every mapping request succeeds");
    assert_eq!(poison_mapping[POISON].total(), 24);
    let poison_partition = partitions[POISON].clone();
    assert_eq!(poison_partition.len(), SIZE, "the poison key's partition: {poison_partition:?}");
    let wider: Vec<_> = partitions.iter().filter(|(_, p)| p.len() > SIZE).collect();
    assert!(wider.is_empty(), "keys reached more than their {SIZE} clusters: {wider:?}");
    let seen_both = partitions.iter().filter(|(k, p)| *k != POISON && p.len() == SIZE).count();
    // With 12 requests a key misses one of its 2 clusters with probability 2⁻¹¹.
    assert!(KEYS - seen_both <= 2, "{seen_both} of {KEYS} keys seen on both clusters");
    // What Envoy's two workers did is what the module's code computes (here, natively).
    let disagree: Vec<_> = partitions
        .iter()
        .filter(|(k, p)| p.len() == SIZE && **p != computed_partition(&computed, k))
        .collect();
    assert!(disagree.is_empty(), "observed partitions differ from the computed ones: {disagree:?}");
    let mut per_subset: BTreeMap<Vec<usize>, usize> = BTreeMap::new();
    for (key, partition) in &partitions {
        if key != POISON && partition.len() == SIZE {
            *per_subset.entry(partition.iter().copied().collect()).or_default() += 1;
        }
    }
    let expected = seen_both as f64 / SUBSETS as f64;
    let chi2: f64 = per_subset.values().map(|n| (*n as f64 - expected).powi(2) / expected).sum::<f64>()
        + (SUBSETS - per_subset.len()) as f64 * expected;
    let same_as_poison: BTreeSet<String> =
        partitions.iter().filter(|(k, p)| *k != POISON && **p == poison_partition).map(|(k, _)| k.clone()).collect();
    let share = same_as_poison.len() as f64 / seen_both as f64;
    let sigma = (seen_both as f64 * (1.0 / SUBSETS as f64) * (1.0 - 1.0 / SUBSETS as f64)).sqrt();
    println!(
        "partitions: {} of {SUBSETS} subsets used, χ² = {chi2:.1} (27 degrees of freedom; p = 0.001 at 55.5); \
         {} of {seen_both} keys ({:.2} %) share the poison key's partition {poison_partition:?}, expected 1/{SUBSETS} = {:.2} % ({expected:.1} ± {sigma:.1} keys)",
        per_subset.len(),
        same_as_poison.len(),
        share * 100.0,
        100.0 / SUBSETS as f64
    );
    // The same share over 100 000 keys, computed with the module's code.
    let many = 100_000;
    let sharing_many = (0..many).filter(|i| computed_partition(&computed, &format!("key-{i}")) == poison_partition).count();
    let sigma_many = (many as f64 / SUBSETS as f64 * (1.0 - 1.0 / SUBSETS as f64)).sqrt();
    println!(
        "computed over {many} keys: {sharing_many} ({:.3} %) share it, expected {:.1} ± {sigma_many:.1}",
        sharing_many as f64 * 100.0 / many as f64,
        many as f64 / SUBSETS as f64
    );
    assert!((sharing_many as f64 - many as f64 / SUBSETS as f64).abs() <= 4.0 * sigma_many);
    assert_eq!(per_subset.len(), SUBSETS, "every subset is someone's partition");
    assert!(chi2 < 55.5, "the partitions are not uniform over the subsets: {per_subset:?}");
    assert!(
        (same_as_poison.len() as f64 - expected).abs() <= 4.0 * sigma,
        "{} keys share the poison key's partition, expected {expected:.1} ± {sigma:.1}",
        same_as_poison.len()
    );
    drop(envoy);

    // 2. A new Envoy (fresh shared data, same configuration): the poison key crashes what it
    //    reaches for 300 ms per request while the 840 keys send normal traffic.
    let envoy = start(&config, &upstreams, Duration::from_secs(5));
    let before = snapshot(&upstreams);
    let (normal, poison, _) = poison_phase(envoy.addr(), Duration::from_secs(6), 4, Duration::from_millis(40)).await;
    let during = reached(&before, &snapshot(&upstreams));
    let moved: Vec<_> = during
        .iter()
        .filter(|(k, p)| partitions.get(*k).is_some_and(|mapped| mapped.len() == SIZE && !p.is_subset(mapped)))
        .collect();
    assert!(moved.is_empty(), "after a restart, keys reached clusters outside their partition: {moved:?}");
    assert_eq!(during.get(POISON), Some(&poison_partition), "the poison key stays in its partition");
    let poisoned: u64 = upstreams.iter().map(Upstream::poisoned).sum();
    let (others, sharing) = split(&normal, &same_as_poison);
    println!(
        "with partitions: poison {} requests ({:?}), {poisoned} reached its clusters; keys with another partition {} requests, {:.3} % 200 ({:?}); \
         the {} keys sharing its partition {} requests, {:.1} % 200",
        poison.total(),
        poison.statuses,
        others.total(),
        others.rate() * 100.0,
        others.statuses,
        same_as_poison.len(),
        sharing.total(),
        sharing.rate() * 100.0
    );
    assert!(poisoned >= 50, "the poison key sent too little to judge: {poison:?}");
    assert!(others.total() >= 3000, "too little normal traffic to judge: {others:?}");
    assert!(others.rate() >= 0.995, "keys outside the poison key's partition: {others:?}");
    let stats = envoy.stats();
    let exhausted = stats.get(&format!("wasmcustom.{STAT_PREFIX}.cluster_selection.exhausted")).copied();
    println!("cluster_selection.exhausted {exhausted:?}");
    drop(envoy);

    // 3. The same without partitions: the poison key reaches every cluster.
    let config = json!({"cluster_selection": selection(false, limit)});
    let envoy = start(&config, &upstreams, Duration::from_secs(5));
    let before = snapshot(&upstreams);
    let (normal, poison, _) = poison_phase(envoy.addr(), Duration::from_secs(6), 4, Duration::from_millis(40)).await;
    let during = reached(&before, &snapshot(&upstreams));
    let (others_flat, _) = split(&normal, &same_as_poison);
    println!(
        "without partitions: poison {} requests reached {} clusters; the same keys {} requests, {:.3} % 200 ({:?})",
        poison.total(),
        during.get(POISON).map_or(0, BTreeSet::len),
        others_flat.total(),
        others_flat.rate() * 100.0,
        others_flat.statuses
    );
    assert!(during.get(POISON).map_or(0, BTreeSet::len) > SIZE, "without partitions the poison key reaches more clusters");
    assert!(
        others_flat.rate() < others.rate(),
        "the partitions made no difference: {:.4} with, {:.4} without",
        others.rate(),
        others_flat.rate()
    );
}

/// A poison key whose requests hang until the route timeout holds at most its per-key
/// cap in flight, so the clusters it shares keep room for everyone else; without the cap it
/// fills its partition's limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_poison_key_holds_no_more_than_its_cap() {
    const CAP: u64 = 4;
    const ROUTE_TIMEOUT: Duration = Duration::from_secs(1);
    let (upstreams, gauge) = upstreams(PoisonEffect::Hang);
    // Envoy holds a hanging request for the route timeout; one older than this may be torn
    // down already while the upstream has not yet seen its connection close.
    gauge.count_held_for(ROUTE_TIMEOUT - Duration::from_millis(100));
    // Fixed limits of 10 per cluster: room for the cap and for the others.
    let limit = json!({"initial_limit": 10, "min_limit": 10, "max_limit": 10});
    let mut results = Vec::new();
    for capped in [true, false] {
        let mut config = json!({"cluster_selection": selection(true, limit.clone())});
        if capped {
            config["load_shedding"] = json!({"per_key": {"key": [{"header": CLIENT}], "max_active_requests": CAP}});
        }
        let computed = partitioner(&config);
        let poison_partition = computed_partition(&computed, POISON);
        let same: BTreeSet<String> =
            normal_keys().iter().filter(|k| computed_partition(&computed, k) == poison_partition).cloned().collect();
        let envoy = start(&config, &upstreams, ROUTE_TIMEOUT);
        gauge.reset_most();
        let before = snapshot(&upstreams);
        let (normal, poison, bodies) = poison_phase(envoy.addr(), Duration::from_secs(6), 16, Duration::from_millis(20)).await;
        let during = reached(&before, &snapshot(&upstreams));
        let (others, sharing) = split(&normal, &same);
        let mut all = others.clone();
        all.merge(&sharing);
        let (most, most_seen) = (gauge.most_held(), gauge.most());
        println!(
            "per-key cap {}: poison {} requests ({:?}), at most {most} hanging at once on {poison_partition:?} \
             ({most_seen} counting those past {:?}, being torn down); \
             the {KEYS} other keys {} requests, {:.3} % 200 ({:?}); the {} sharing the poison key's partition {} requests, {:.1} % 200 ({:?})",
            if capped { CAP.to_string() } else { "none".into() },
            poison.total(),
            poison.statuses,
            ROUTE_TIMEOUT - Duration::from_millis(100),
            all.total(),
            all.rate() * 100.0,
            all.statuses,
            same.len(),
            sharing.total(),
            sharing.rate() * 100.0,
            sharing.statuses
        );
        assert_eq!(during.get(POISON), Some(&poison_partition), "the poison key stays in its partition");
        if capped {
            assert!(most <= CAP, "{most} poison requests hung at once, cap {CAP}");
            assert!(most >= CAP - 1, "the poison key did hold its cap: {most}");
            // The poison key's 503s are the cap's refusals, and any its clusters' limits gave it.
            let refused = poison.per_key_refused;
            assert!(refused > 100, "the cap refused the poison key's excess: {poison:?}");
            let body: Value = serde_json::from_str(&bodies[0]).expect("problem+json");
            assert_eq!(body["cap"], "load_shedding.per_key", "{body}");
            assert_eq!(body["max_active_requests"], CAP, "{body}");
            assert!(body["detail"].as_str().unwrap().contains("max_active_requests 4"), "{body}");
            assert!(all.total() >= 3000, "too little normal traffic to judge: {all:?}");
            assert!(all.rate() >= 0.995, "the other keys: {all:?}");
            let refused_stat = envoy.wait_for_stat(&format!("{STAT_PREFIX}.load_shedding.per_key.refused"), refused, Duration::from_secs(5));
            assert_eq!(refused_stat, Some(refused), "per_key.refused counts the cap's refusals of the poison key: {poison:?}");
        }
        results.push((most, all.rate(), sharing.rate()));
        drop(envoy);
    }
    let (capped, uncapped) = (results[0], results[1]);
    assert!(uncapped.0 > CAP, "without the cap the poison key holds more: {uncapped:?}");
    assert!(uncapped.2 < capped.2, "without the cap the keys sharing its clusters suffer: {results:?}");
}

fn upstream_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_floodgate-upstream"))
}

/// `n` concurrent requests of `key`, each on its own connection: (status, latency, body).
async fn burst(addr: SocketAddr, key: &'static str, n: usize) -> Vec<(u16, Duration, String)> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            tokio::spawn(async move {
                let started = Instant::now();
                let r = get(addr, "/work", &[(CLIENT, key)]).await;
                (r.status, started.elapsed(), r.text())
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.expect("request task"));
    }
    out
}

fn count(results: &[(u16, Duration, String)], status: u16) -> usize {
    results.iter().filter(|(s, _, _)| *s == status).count()
}

/// The per-key cap is exact across workers under a burst, refuses fast with a 503
/// naming the cap, leaves other keys alone, and is back to zero after hang-ups and resets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_key_cap_is_exact_and_comes_back_to_zero() {
    const CAP: usize = 5;
    let mut upstream = UpstreamProcess::start(upstream_bin(), Duration::from_millis(1500));
    let config = json!({"load_shedding": {"per_key": {"key": [{"header": CLIENT}], "max_active_requests": CAP}}});
    let envoy = Envoy::builder(config).upstream_at(upstream.addr()).start();
    let refused = |stat: &str| envoy.stat(&format!("{STAT_PREFIX}.load_shedding.per_key.{stat}")).unwrap_or(0);

    // A burst of 40 from one key, over both workers, with another key alongside.
    let (heavy, light) = tokio::join!(burst(envoy.addr(), "heavy", 40), burst(envoy.addr(), "light", 3));
    let workers = envoy.connections_per_worker();
    let fast = heavy.iter().filter(|(s, d, _)| *s == 503 && *d < Duration::from_millis(700)).count();
    println!(
        "burst: {} admitted, {} refused ({fast} within 700 ms, the upstream takes 1.5 s); another key {:?}; connections per worker {workers:?}",
        count(&heavy, 200),
        count(&heavy, 503),
        light.iter().map(|r| r.0).collect::<Vec<_>>()
    );
    assert_eq!(count(&heavy, 200), CAP, "exactly the cap is admitted: {:?}", heavy.iter().map(|r| r.0).collect::<Vec<_>>());
    assert_eq!(count(&heavy, 503), 40 - CAP);
    assert_eq!(fast, 40 - CAP, "refusals are fast");
    assert!(workers.iter().filter(|n| **n > 0).count() >= 2, "both workers took part: {workers:?}");
    assert_eq!(count(&light, 200), 3, "another key is not affected");
    let body: Value = serde_json::from_str(&heavy.iter().find(|r| r.0 == 503).unwrap().2).expect("problem+json");
    assert_eq!(body["cap"], "load_shedding.per_key");
    assert_eq!(body["in_flight"], CAP);
    assert_eq!(body["max_active_requests"], CAP);
    assert_eq!(refused("refused"), (40 - CAP) as u64);

    // Clients that hang up mid-request, with a FIN or a reset, after the headers or mid-body.
    let mut hang_ups = Vec::new();
    for (i, how) in [HangUp::AfterHeaders, HangUp::MidBody, HangUp::AfterHeaders, HangUp::MidBody, HangUp::AfterHeaders].into_iter().enumerate() {
        let addr = envoy.addr();
        hang_ups.push(tokio::spawn(async move { hang_up(addr, how, &[(CLIENT, "heavy")], Duration::from_millis(400), i % 2 == 0).await }));
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let during = burst(envoy.addr(), "heavy", 1).await;
    assert_eq!(during[0].0, 503, "the hung-up requests hold the cap while they are open");
    for t in hang_ups {
        t.await.expect("hang-up task").expect("hang-up");
    }
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Upstream resets: the upstream dies with the key's requests in flight.
    let in_flight: Vec<_> = (0..CAP)
        .map(|_| {
            let addr = envoy.addr();
            tokio::spawn(async move {
                let r = get(addr, "/work", &[(CLIENT, "heavy")]).await;
                (r.status, r.text())
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(400)).await;
    upstream.kill();
    let mut reset_statuses = Vec::new();
    for t in in_flight {
        reset_statuses.push(t.await.expect("request task"));
    }
    println!("after the upstream reset: {reset_statuses:?}");
    assert!(reset_statuses.iter().all(|(s, _)| *s >= 500), "{reset_statuses:?}");
    assert!(
        reset_statuses.iter().all(|(_, body)| !body.contains("load_shedding.per_key")),
        "the hung-up requests gave their units back: none of these was refused by the cap: {reset_statuses:?}"
    );
    upstream.restart();

    // Back to zero: exactly the cap is admitted again.
    let again = burst(envoy.addr(), "heavy", CAP + 2).await;
    println!("after hang-ups and resets: {:?}", again.iter().map(|r| r.0).collect::<Vec<_>>());
    assert_eq!(count(&again, 200), CAP, "the key's count came back to zero");
    assert_eq!(count(&again, 503), 2);
    assert_eq!(refused("untracked"), 0);
    assert_eq!(refused("unkeyed"), 0);
    let plain = get(envoy.addr(), "/work", &[]).await;
    assert_eq!(plain.status, 200, "a request without the key is not capped");
    assert_eq!(refused("unkeyed"), 1);
}
