//! Command-line flags, each also read from an environment variable (for containers).

use std::net::SocketAddr;
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

    /// A Redis URL (redis://[user:password@]host:port[/db]). A single node takes exactly one;
    /// with --cluster, give one or more seed nodes (repeat the flag, or separate with commas).
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

    /// How long a shutdown (SIGTERM, SIGINT) waits for open requests to finish. E.g. 10s.
    #[arg(long, env = "FLOODGATE_SYNC_SHUTDOWN_GRACE", default_value = "10s", value_parser = parse_duration)]
    pub shutdown_grace: Duration,
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
