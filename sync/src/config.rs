//! Command-line flags, each also read from an environment variable (for containers).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

/// floodgate-sync: the ambassador between floodgate proxies and Redis for global quotas.
///
/// Proxies POST batches of counter deltas to /v1/sync; this service adds them to Redis
/// atomically (exactly once per proxy and batch number, even when a batch is retried) and answers
/// with the fleet totals. It keeps no state: run as many instances as you like against the same
/// Redis, with the same --shards and --prefix. Other routes: GET /healthz, /readyz, /metrics.
/// Logs go to stderr, one line per event; RUST_LOG sets the filter (default
/// "info,redis=error"). See sync/README.md.
#[derive(Debug, Clone, Parser)]
#[command(name = "floodgate-sync", version, about, long_about)]
pub struct Args {
    /// The address to serve HTTP/1.1 and HTTP/2 (cleartext, prior knowledge) on.
    #[arg(long, env = "FLOODGATE_SYNC_LISTEN", default_value = "127.0.0.1:9090")]
    pub listen: SocketAddr,

    /// A Redis URL: redis://[user:password@]host:port[/db], or rediss://... for TLS (with an ACL
    /// user, or only a password: redis://:password@host). A single node takes exactly one; with
    /// --cluster, give one or more seed nodes (repeat the flag, or separate with commas), all
    /// redis:// or all rediss://. Put it in the environment rather than on the command line when
    /// it holds a password.
    #[arg(
        long,
        env = "FLOODGATE_SYNC_REDIS",
        default_value = "redis://127.0.0.1:6379",
        value_delimiter = ','
    )]
    pub redis: Vec<String>,

    /// Talk to a Redis Cluster (follows MOVED/ASK; one script per shard of a batch) instead of
    /// a single node.
    #[arg(long, env = "FLOODGATE_SYNC_CLUSTER")]
    pub cluster: bool,

    /// How many shards counters are spread over (each shard is one hash tag, so one cluster
    /// slot). Every instance serving one fleet MUST use the same value: it is part of the key
    /// names. More shards spread a cluster's load over more nodes; fewer mean fewer script calls
    /// per batch in cluster mode.
    #[arg(long, env = "FLOODGATE_SYNC_SHARDS", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=16384))]
    pub shards: u32,

    /// The prefix of every Redis key this service writes (no '{' or '}'). Every instance serving
    /// one fleet MUST use the same value.
    #[arg(long, env = "FLOODGATE_SYNC_PREFIX", default_value = "fg:", value_parser = parse_prefix)]
    pub prefix: String,

    /// The most counter entries a batch may carry; a larger batch is refused with 400.
    #[arg(long, env = "FLOODGATE_SYNC_MAX_COUNTERS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub max_counters: u64,

    /// The largest request body in bytes; a larger one is refused with 413.
    #[arg(long, env = "FLOODGATE_SYNC_MAX_BODY_BYTES", default_value_t = 1_048_576,
          value_parser = clap::value_parser!(u64).range(64..=268_435_456))]
    pub max_body_bytes: u64,

    /// The bound on what one request asks of Redis (connecting, retries and redirects
    /// included): past it the answer is 503. E.g. 1s, 250ms.
    #[arg(long, env = "FLOODGATE_SYNC_REDIS_TIMEOUT", default_value = "1s", value_parser = parse_duration)]
    pub redis_timeout: Duration,

    /// The least time between two script calls of one lane's batches (one lane on a single node,
    /// one per shard in a cluster): the batches that arrive meanwhile, from any proxies, go in
    /// the next call, their shared counters added once. Longer merges more batches per call
    /// (fewer Redis commands and less Redis CPU per request), shorter brings the fleet's counts
    /// back to the proxies sooner. 0ms: a call as soon as the one before returned. E.g. 25ms.
    #[arg(long, env = "FLOODGATE_SYNC_BATCH_PACE", default_value = "25ms", value_parser = parse_wait)]
    pub batch_pace: Duration,

    /// How long a batch that finds its lane idle waits for others before its script call (at
    /// most `--batch-pace`): the proxies send their batches at the same moments (each on the
    /// start of a slot of its `sync_interval` on the wall clock), so the batches of a fleet
    /// arrive within a few milliseconds of each other and go in one call. 0ms: at once. E.g. 5ms.
    #[arg(long, env = "FLOODGATE_SYNC_BATCH_GATHER", default_value = "5ms", value_parser = parse_wait)]
    pub batch_gather: Duration,

    /// The least time between two script calls of one shard's asks (the synchronous asks of
    /// batched rules' requests, merged): longer merges more asks per call (fewer Redis commands),
    /// shorter makes an ask wait less. 0ms: a call as soon as the one before returned. E.g. 20ms.
    #[arg(long, env = "FLOODGATE_SYNC_ASK_PACE", default_value = "20ms", value_parser = parse_wait)]
    pub ask_pace: Duration,

    /// Answer a lease (the leased rules' POST /v1/lease) only once this many replicas have its
    /// writes (Redis WAIT, in the script's round trip, within half of --redis-timeout; fewer is
    /// a 503). Redis replicates asynchronously: without it, a master that fails over loses the
    /// units it granted last, and the fleet grants them again. 0: answered as soon as the master
    /// ran the script. At most the replicas each master has.
    #[arg(long, env = "FLOODGATE_SYNC_REPLICA_ACKS", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=16))]
    pub replica_acks: u32,

    /// With rediss:// URLs: the CA certificates (PEM) that Redis's certificate must chain to,
    /// instead of the built-in public roots (Mozilla's, through webpki-roots).
    #[arg(long, env = "FLOODGATE_SYNC_REDIS_CA")]
    pub redis_ca: Option<PathBuf>,

    /// With rediss:// URLs: a client certificate (PEM, chain first) for Redis servers that ask
    /// for one (redis-server's tls-auth-clients, on by default). Needs --redis-key.
    #[arg(long, env = "FLOODGATE_SYNC_REDIS_CERT", requires = "redis_key")]
    pub redis_cert: Option<PathBuf>,

    /// The private key (PEM) of --redis-cert.
    #[arg(long, env = "FLOODGATE_SYNC_REDIS_KEY", requires = "redis_cert")]
    pub redis_key: Option<PathBuf>,

    /// A token the proxies must present (`authorization: Bearer TOKEN`, the filter's
    /// global.token) on POST /v1/sync and /v1/lease: without one the answer is 401, with
    /// another 403, and nothing reaches Redis. At most two (repeat the flag, or separate with a
    /// comma), so that a new token can be rolled out while the old one is still in use. 16 to
    /// 512 characters among A-Z a-z 0-9 - . _ ~ + / =. Without any token (nor --token-file),
    /// every caller that reaches the port may write counters.
    #[arg(long = "token", env = "FLOODGATE_SYNC_TOKEN", value_delimiter = ',',
          value_parser = parse_token, hide_env_values = true)]
    pub tokens: Vec<String>,

    /// A file of tokens, one per line (blank lines and lines starting with # skipped), taken
    /// with --token's (at most two in all); read at startup. E.g. a Kubernetes Secret mounted
    /// as a volume.
    #[arg(long, env = "FLOODGATE_SYNC_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// How long a shutdown (SIGTERM, SIGINT) waits for open requests to finish. E.g. 10s.
    #[arg(long, env = "FLOODGATE_SYNC_SHUTDOWN_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
}

/// The most tokens accepted at once: the one in use and the next.
pub const MAX_TOKENS: usize = 2;

/// A bearer token: 16 to 512 characters of RFC 6750's `b64token` (A-Z a-z 0-9 - . _ ~ + / and
/// `=`), the same rule as the filter's `global.token`.
pub fn parse_token(text: &str) -> Result<String, String> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-._~+/=".contains(c);
    if !(16..=512).contains(&text.len()) {
        Err(format!("a token has 16 to 512 characters, this one {}", text.len()))
    } else if !text.chars().all(allowed) {
        Err("a token has only the characters A-Z a-z 0-9 - . _ ~ + / =".into())
    } else {
        Ok(text.to_string())
    }
}

impl Args {
    /// The tokens of --token and --token-file together (empty: calls are not authenticated).
    pub fn all_tokens(&self) -> Result<Vec<String>, String> {
        let mut tokens = self.tokens.clone();
        if let Some(path) = &self.token_file {
            let text = std::fs::read_to_string(path)
                .map_err(|err| format!("--token-file {}: {err}", path.display()))?;
            for line in text.lines().map(str::trim) {
                if line.is_empty() || line.starts_with('#') {
                    continue;
                }
                tokens.push(
                    parse_token(line).map_err(|err| format!("--token-file {}: {err}", path.display()))?,
                );
            }
        }
        if tokens.len() > MAX_TOKENS {
            return Err(format!(
                "at most {MAX_TOKENS} tokens (the one in use and the next), got {}",
                tokens.len()
            ));
        }
        Ok(tokens)
    }
}

fn parse_prefix(text: &str) -> Result<String, String> {
    if text.contains(['{', '}']) {
        Err("must not contain '{' or '}' (the shard is the key's hash tag)".into())
    } else if text.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Err("must not contain whitespace or control characters".into())
    } else {
        Ok(text.to_string())
    }
}

/// `250ms`, `1s`, `1.5s`, `2m`: a positive duration of at most an hour.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(at) => text.split_at(at),
        None => {
            return Err(format!(
                "{text:?}: give a unit (ms, s or m), e.g. 1s or 250ms"
            ))
        }
    };
    let number: f64 = number
        .parse()
        .map_err(|_| format!("{text:?}: not a number followed by ms, s or m"))?;
    let seconds = match unit {
        "ms" => number / 1000.0,
        "s" => number,
        "m" => number * 60.0,
        _ => return Err(format!("{text:?}: unknown unit {unit:?} (ms, s or m)")),
    };
    if !(0.001..=3600.0).contains(&seconds) {
        return Err(format!("{text:?}: must be between 1ms and 1h"));
    }
    Ok(Duration::from_secs_f64(seconds))
}

/// A wait that may be none: `0ms` (or `0s`, `0m`), or a duration as [`parse_duration`] takes it.
pub fn parse_wait(text: &str) -> Result<Duration, String> {
    match text.trim() {
        "0ms" | "0s" | "0m" => Ok(Duration::ZERO),
        other => parse_duration(other).map_err(|err| format!("{err} (or 0ms)")),
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

    #[test]
    fn durations_need_a_unit_and_a_sane_size() {
        assert_eq!(parse_duration("1s").unwrap(), Duration::from_secs(1));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(parse_duration("1.5s").unwrap(), Duration::from_millis(1500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        for bad in ["1", "s", "0s", "-1s", "2h", "1 s", "1.2.3s", "61m"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        // The paces and the gather may be none.
        assert_eq!(parse_wait("0ms").unwrap(), Duration::ZERO);
        assert_eq!(parse_wait("25ms").unwrap(), Duration::from_millis(25));
        assert!(parse_wait("0").unwrap_err().contains("or 0ms"));
        let args = Args::try_parse_from(["floodgate-sync", "--batch-pace", "0ms", "--batch-gather", "0s", "--ask-pace", "0ms"]).unwrap();
        assert_eq!((args.batch_pace, args.batch_gather, args.ask_pace), (Duration::ZERO, Duration::ZERO, Duration::ZERO));
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let args = Args::try_parse_from(["floodgate-sync"]).unwrap();
        assert_eq!(args.listen, "127.0.0.1:9090".parse().unwrap());
        assert_eq!(args.redis, vec!["redis://127.0.0.1:6379".to_string()]);
        assert!(!args.cluster);
        assert_eq!(args.shards, 16);
        assert_eq!(args.prefix, "fg:");
        assert_eq!(args.max_counters, 10_000);
        assert_eq!(args.max_body_bytes, 1_048_576);
        assert_eq!(args.redis_timeout, Duration::from_secs(1));
        assert_eq!(args.ask_pace, Duration::from_millis(20));
        assert_eq!(args.ask_pace, crate::store::DEFAULT_ASK_PACE);
        assert_eq!(args.batch_pace, Duration::from_millis(25));
        assert_eq!(args.batch_gather, Duration::from_millis(5));
        assert!(args.tokens.is_empty() && args.token_file.is_none());
        assert!(args.redis_ca.is_none() && args.redis_cert.is_none());
    }

    #[test]
    fn tokens_come_from_flags_and_a_file_at_most_two() {
        let a = "a".repeat(16);
        let b = "Bb0-._~+/=".repeat(2);
        let args = Args::try_parse_from(["floodgate-sync", "--token", &format!("{a},{b}")]).unwrap();
        assert_eq!(args.all_tokens().unwrap(), vec![a.clone(), b.clone()]);
        for bad in ["short", &"x".repeat(513), &format!("{a} b"), &format!("{a}:")] {
            assert!(
                Args::try_parse_from(["floodgate-sync", "--token", bad]).is_err(),
                "{bad}"
            );
        }
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), format!("# rotation\n{b}\n\n")).unwrap();
        let path = file.path().to_str().unwrap();
        let args = Args::try_parse_from(["floodgate-sync", "--token", &a, "--token-file", path]).unwrap();
        assert_eq!(args.all_tokens().unwrap(), vec![a.clone(), b.clone()]);
        let args = Args::try_parse_from(["floodgate-sync", "--token", &format!("{a},{a}"), "--token-file", path]).unwrap();
        assert!(args.all_tokens().unwrap_err().contains("at most 2"));
        std::fs::write(file.path(), "bad token\n").unwrap();
        let args = Args::try_parse_from(["floodgate-sync", "--token-file", path]).unwrap();
        assert!(args.all_tokens().unwrap_err().starts_with("--token-file"));
        assert!(Args::try_parse_from(["floodgate-sync", "--redis-cert", "c.pem"]).is_err(), "--redis-cert needs --redis-key");
    }

    #[test]
    fn flags_parse_and_bad_values_are_refused() {
        let args = Args::try_parse_from([
            "floodgate-sync",
            "--cluster",
            "--redis",
            "redis://a:1,redis://b:2",
            "--redis",
            "redis://c:3",
            "--shards",
            "3",
            "--prefix",
            "x:",
            "--redis-timeout",
            "200ms",
        ])
        .unwrap();
        assert!(args.cluster);
        assert_eq!(
            args.redis,
            vec!["redis://a:1", "redis://b:2", "redis://c:3"]
        );
        assert_eq!(args.shards, 3);
        assert_eq!(args.redis_timeout, Duration::from_millis(200));
        for bad in [
            &["--shards", "0"][..],
            &["--prefix", "a{b"],
            &["--max-counters", "0"],
            &["--listen", "nowhere"],
            &["--redis-timeout", "5"],
        ] {
            let mut argv = vec!["floodgate-sync"];
            argv.extend_from_slice(bad);
            assert!(Args::try_parse_from(argv).is_err(), "{bad:?}");
        }
    }
}
