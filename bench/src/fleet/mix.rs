//! The traffic mixes of the fleet tool: which key each request has, which proxy it reaches, and
//! when (an open loop at a fixed fleet-wide rate). Pure: the n-th arrival is a function of `n`
//! (and of the seed, for the Zipf mix).

use floodgate::primitives::hash::{Random, SplitMix64};

/// Which mix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MixKind {
    /// A few hot keys at 2× their limit, each key's requests round-robin over the proxies.
    Hot,
    /// Many users with a low limit (10 per minute), each user's requests round-robin over the
    /// proxies.
    Users,
    /// A long tail: 100 000 keys drawn by Zipf's law (exponent 1), each request on a proxy
    /// drawn at random.
    Zipf,
}

impl MixKind {
    /// By its name on the command line.
    pub fn parse(name: &str) -> Option<MixKind> {
        match name {
            "hot" => Some(MixKind::Hot),
            "users" => Some(MixKind::Users),
            "zipf" => Some(MixKind::Zipf),
            _ => None,
        }
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            MixKind::Hot => "hot",
            MixKind::Users => "users",
            MixKind::Zipf => "zipf",
        }
    }
}

/// Hot keys in the hot mix.
pub const HOT_KEYS: u32 = 4;
/// Users' limit in the users mix (per minute).
pub const USER_LIMIT: u32 = 10;
/// Each user's rate in the users mix, as a multiple of its limit.
pub const USER_OVER: f64 = 4.0;
/// Keys of the Zipf mix.
pub const ZIPF_KEYS: u32 = 100_000;
/// Each key's limit in the Zipf mix (per 10 s).
pub const ZIPF_LIMIT: u32 = 50;

/// One request: when (µs from the run's start), on which proxy, with which key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arrival {
    /// µs from the start.
    pub at_us: u64,
    /// The proxy.
    pub proxy: usize,
    /// The key (an index).
    pub key: u32,
}

/// A mix at a fleet-wide rate over `proxies`.
#[derive(Clone, Debug)]
pub struct Mix {
    /// Which.
    pub kind: MixKind,
    /// Requests per second over the fleet.
    pub rate: f64,
    /// Proxies.
    pub proxies: usize,
    /// Distinct keys.
    pub keys: u32,
    /// Every key's limit per window.
    pub limit: u32,
    /// The rules' window, ms.
    pub window_ms: u64,
    /// The Zipf mix's cumulative weights (empty for the others).
    cdf: Vec<f64>,
    rng: SplitMix64,
}

impl Mix {
    /// The mix `kind` at `rate` requests per second over `proxies`.
    pub fn new(kind: MixKind, rate: f64, proxies: usize, seed: u64) -> Mix {
        let proxies = proxies.max(1);
        let (keys, limit, window_ms, cdf) = match kind {
            // Each key at 2× its limit: limit = (rate per key) × window / 2.
            MixKind::Hot => {
                let window_ms = 10_000;
                let per_key = rate / f64::from(HOT_KEYS);
                let limit = (per_key * window_ms as f64 / 1000.0 / 2.0).round().max(1.0) as u32;
                (HOT_KEYS, limit, window_ms, Vec::new())
            }
            // Each user at USER_OVER × 10 per minute.
            MixKind::Users => {
                let per_user = f64::from(USER_LIMIT) * USER_OVER / 60.0;
                let users = (rate / per_user).round().max(1.0) as u32;
                (users, USER_LIMIT, 60_000, Vec::new())
            }
            MixKind::Zipf => (ZIPF_KEYS, ZIPF_LIMIT, 10_000, zipf_cdf(ZIPF_KEYS, 1.0)),
        };
        Mix { kind, rate, proxies, keys, limit, window_ms, cdf, rng: SplitMix64::new(seed) }
    }

    /// The `n`-th arrival (0-based). The Zipf mix draws from its generator: call it with
    /// `n` in order.
    pub fn arrival(&mut self, n: u64) -> Arrival {
        let at_us = (n as f64 * 1e6 / self.rate) as u64;
        let p = self.proxies as u64;
        let (proxy, key) = match self.kind {
            MixKind::Hot | MixKind::Users => {
                let keys = u64::from(self.keys);
                let key = n % keys;
                // The key's own round n / keys, shifted by the key: every proxy in turn.
                ((key + n / keys) % p, key as u32)
            }
            MixKind::Zipf => {
                let u = self.rng.next_unit();
                let key = self.cdf.partition_point(|&c| c < u).min(self.cdf.len().saturating_sub(1));
                (self.rng.next_u64() % p, key as u32)
            }
        };
        Arrival { at_us, proxy: proxy as usize, key }
    }

    /// How the mix reads in a table.
    pub fn describe(&self) -> String {
        match self.kind {
            MixKind::Hot => format!("{} keys, L = {} per {} s, {:.0} req/s each (2 × L)", self.keys, self.limit, self.window_ms / 1000, self.rate / f64::from(self.keys)),
            MixKind::Users => format!("{} users, L = {} per min, {:.2} req/s each ({} × L)", self.keys, self.limit, self.rate / f64::from(self.keys), USER_OVER),
            MixKind::Zipf => format!("{} keys (Zipf, s = 1), L = {} per {} s", self.keys, self.limit, self.window_ms / 1000),
        }
    }
}

/// The cumulative weights of Zipf's law over `n` ranks with exponent `s`, normalised to 1.
fn zipf_cdf(n: u32, s: f64) -> Vec<f64> {
    let mut cdf: Vec<f64> = Vec::with_capacity(n as usize);
    let mut sum = 0.0;
    for k in 1..=n {
        sum += 1.0 / f64::from(k).powf(s);
        cdf.push(sum);
    }
    for c in &mut cdf {
        *c /= sum;
    }
    cdf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hot_keys_are_at_twice_their_limit_and_round_robin_over_every_proxy() {
        let mut mix = Mix::new(MixKind::Hot, 2000.0, 10, 1);
        assert_eq!(mix.keys, 4);
        // 500 req/s per key over 10 s is 5 000: twice L.
        assert_eq!(mix.limit, 2500);
        let arrivals: Vec<Arrival> = (0..400).map(|n| mix.arrival(n)).collect();
        for key in 0..4 {
            let proxies: Vec<usize> = arrivals.iter().filter(|a| a.key == key).map(|a| a.proxy).take(10).collect();
            let mut sorted = proxies.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..10).collect::<Vec<_>>(), "key {key} visits every proxy once per round");
        }
        assert_eq!(arrivals[200].at_us, 100_000, "the 200th arrival at 2 000 req/s is at 0.1 s");
        assert_eq!(mix.arrival(2000).at_us, 1_000_000);
    }

    #[test]
    fn each_user_visits_every_proxy_in_turn_at_four_times_its_limit() {
        let mut mix = Mix::new(MixKind::Users, 1000.0, 100, 1);
        assert_eq!(mix.limit, 10);
        assert_eq!(mix.keys, 1500, "1 000 req/s at 40 per minute each");
        let per_user: Vec<usize> = (0..1500 * 100).map(|n| mix.arrival(n)).filter(|a| a.key == 7).map(|a| a.proxy).collect();
        assert_eq!(per_user.len(), 100);
        let mut sorted = per_user.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        // Successive requests of a user land on successive proxies.
        assert_eq!(per_user[1], (per_user[0] + 1) % 100);
    }

    #[test]
    fn zipf_ranks_are_drawn_most_often_first_and_reach_the_tail() {
        let mut mix = Mix::new(MixKind::Zipf, 1000.0, 10, 42);
        let mut counts = vec![0u32; ZIPF_KEYS as usize];
        let mut proxies = [0u32; 10];
        for n in 0..200_000 {
            let a = mix.arrival(n);
            counts[a.key as usize] += 1;
            proxies[a.proxy] += 1;
        }
        // Rank 1 about 1 / H(100 000) ≈ 8.3 % of the draws, rank 2 half of it.
        let first = f64::from(counts[0]) / 200_000.0;
        assert!((0.075..0.092).contains(&first), "{first}");
        assert!(counts[0] > counts[1] && counts[1] > counts[3] && counts[3] > counts[20]);
        assert!(counts.iter().filter(|&&c| c > 0).count() > 30_000, "the tail is reached");
        assert!(proxies.iter().all(|&p| (18_000..22_000).contains(&p)), "{proxies:?}");
    }

    #[test]
    fn the_zipf_weights_add_up_to_one() {
        let cdf = zipf_cdf(1000, 1.0);
        assert!((cdf[999] - 1.0).abs() < 1e-12);
        assert!(cdf.windows(2).all(|w| w[0] < w[1]));
    }
}
