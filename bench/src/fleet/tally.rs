//! The fleet tool's ground truth: every decision of every simulated proxy, counted per key and
//! window bucket, against the limit. The filter's sliding window admits a request when
//! `previous × (w − elapsed) + (current + 1) × w ≤ limit × w` (filter/src/ratelimit/window.rs);
//! the same estimate over what the whole fleet admitted tells how far over the limit the fleet
//! went, and whether a refused request would have fitted. Pure.

use std::collections::{BTreeMap, HashMap};

/// One key's admissions.
#[derive(Default)]
struct KeyTally {
    /// Admitted per bucket (`unix ms / window`).
    buckets: BTreeMap<u64, u32>,
    /// The highest sliding estimate × w right after an admission.
    peak: u128,
}

/// What the fleet admitted and refused, per key.
pub struct Tally {
    limit: u32,
    window_ms: u64,
    keys: HashMap<u32, KeyTally>,
    /// Requests admitted.
    pub admitted: u64,
    /// Requests refused.
    pub refused: u64,
    /// Refused while the fleet's admissions so far left room for the request.
    pub refused_with_room: u64,
    /// The most units of room left at one of those refusals.
    pub largest_room: u64,
    /// How long each request that waited (an ask, a lease) waited, µs.
    waits_us: Vec<u64>,
    /// Each admission with where it came from and when (ms into its bucket), per key and
    /// bucket, when the caller said ([`Tally::admit_from`]): what [`Tally::overshoots`] reads.
    trail: HashMap<(u32, u64), Vec<Timed>>,
}

/// An admission and when it came, ms into its bucket.
type Timed = (u64, Admission);

/// Where one admission came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Admission {
    /// The proxy that admitted it.
    pub proxy: usize,
    /// Whether the VM that admitted it led its proxy's batches.
    pub leads: bool,
    /// Whether the request waited for the store (an ask, a lease) before it was admitted.
    pub waited: bool,
}

/// The summary of a run's decisions.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Summary {
    /// Keys that saw a request.
    pub keys: usize,
    /// (key, bucket) pairs that admitted more than the limit.
    pub windows_over: usize,
    /// Keys with a bucket over the limit.
    pub keys_over: usize,
    /// The largest admitted − limit of a (key, bucket) (0 when none is over).
    pub largest_over: u64,
    /// The highest sliding estimate (what the filter compares with the limit) of any key, minus
    /// the limit, in units (0 when none went over).
    pub peak_over: f64,
    /// Each key's fullest bucket, over the limit: median, p99, max (1.0: the limit exactly).
    pub fullest: [f64; 3],
    /// Waits: how many, p50, p99 and max in ms.
    pub waits: (usize, f64, f64, f64),
    /// The p99 of the latency the store added over every request decided (0 for those that did
    /// not wait), ms.
    pub added_p99: f64,
}

impl Tally {
    /// A tally for keys limited to `limit` per `window_ms`.
    pub fn new(limit: u32, window_ms: u64) -> Tally {
        Tally {
            limit,
            window_ms: window_ms.max(1),
            keys: HashMap::new(),
            admitted: 0,
            refused: 0,
            refused_with_room: 0,
            largest_room: 0,
            waits_us: Vec::new(),
            trail: HashMap::new(),
        }
    }

    /// The key's previous and current bucket counts at `wall_ms`, and the ms elapsed in the
    /// current bucket.
    fn counts(&self, key: u32, wall_ms: u64) -> (u128, u128, u128) {
        let bucket = wall_ms / self.window_ms;
        let elapsed = u128::from(wall_ms % self.window_ms);
        let Some(k) = self.keys.get(&key) else { return (0, 0, elapsed) };
        let get = |b: u64| u128::from(k.buckets.get(&b).copied().unwrap_or(0));
        (if bucket > 0 { get(bucket - 1) } else { 0 }, get(bucket), elapsed)
    }

    /// A request of `key` admitted at `wall_ms`.
    pub fn admit(&mut self, key: u32, wall_ms: u64) {
        let (previous, current, elapsed) = self.counts(key, wall_ms);
        let w = u128::from(self.window_ms);
        let estimate = previous * (w - elapsed) + (current + 1) * w;
        let k = self.keys.entry(key).or_default();
        *k.buckets.entry(wall_ms / self.window_ms).or_default() += 1;
        k.peak = k.peak.max(estimate);
        self.admitted += 1;
    }

    /// A request of `key` admitted at `wall_ms` by `proxy`, after waiting for the store or not:
    /// [`Tally::admit`], and the admission in the trail [`Tally::overshoots`] reads.
    pub fn admit_from(&mut self, key: u32, wall_ms: u64, admission: Admission) {
        self.admit(key, wall_ms);
        self.trail.entry((key, wall_ms / self.window_ms)).or_default().push((wall_ms % self.window_ms, admission));
    }

    /// The windows that admitted more than `at_least` × the limit, fullest first, each told in a
    /// line: the admissions past the limit (those that a limiter with a perfect view of the
    /// fleet would have refused), how many of them waited for the store, from how many proxies,
    /// how many on a VM leading its proxy's batches, and when in the window; and when the window
    /// reached its limit. Only for admissions counted with [`Tally::admit_from`].
    pub fn overshoots(&self, at_least: f64) -> Vec<String> {
        let limit = self.limit as usize;
        let mut over: Vec<(&(u32, u64), &Vec<Timed>)> =
            self.trail.iter().filter(|(_, a)| a.len() as f64 > at_least * limit as f64 && a.len() > limit).collect();
        over.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.0.cmp(b.0)));
        over.iter()
            .map(|((key, bucket), admissions)| {
                let mut by_time = admissions.to_vec();
                by_time.sort_by_key(|(offset_ms, _)| *offset_ms);
                let past = &by_time[limit..];
                let waited = past.iter().filter(|(_, a)| a.waited).count();
                let leading = past.iter().filter(|(_, a)| a.leads).count();
                let mut proxies: Vec<usize> = past.iter().map(|(_, a)| a.proxy).collect();
                proxies.sort_unstable();
                proxies.dedup();
                let tenths = past.iter().fold([0usize; 10], |mut t, (offset_ms, _)| {
                    t[usize::try_from(offset_ms * 10 / self.window_ms).unwrap_or(9).min(9)] += 1;
                    t
                });
                format!(
                    "key {key}, bucket {bucket}: {} admitted ({:.3} × L); the limit reached {} ms into the window; {} past it, {waited} of them waited for the store, from {} proxies, {leading} on a VM leading its proxy's batches, per tenth of the window {tenths:?}",
                    admissions.len(),
                    admissions.len() as f64 / limit.max(1) as f64,
                    by_time[limit - 1].0,
                    past.len(),
                    proxies.len(),
                )
            })
            .collect()
    }

    /// A request of `key` refused at `wall_ms`: whether the fleet had room for it.
    pub fn refuse(&mut self, key: u32, wall_ms: u64) -> bool {
        let (previous, current, elapsed) = self.counts(key, wall_ms);
        let w = u128::from(self.window_ms);
        let budget = u128::from(self.limit) * w;
        let used = previous * (w - elapsed);
        // Units n with used + (current + n) × w ≤ budget.
        let room = budget.saturating_sub(used) / w;
        let room = room.saturating_sub(current);
        self.keys.entry(key).or_default();
        self.refused += 1;
        if room >= 1 {
            self.refused_with_room += 1;
            self.largest_room = self.largest_room.max(u64::try_from(room).unwrap_or(u64::MAX));
            return true;
        }
        false
    }

    /// A request that waited `us` µs for the store before its decision.
    pub fn waited(&mut self, us: u64) {
        self.waits_us.push(us);
    }

    /// The window (ms) the tally counts in.
    pub fn window_ms(&self) -> u64 {
        self.window_ms
    }

    /// What was admitted per key and window bucket, the buckets numbered from `first_bucket`
    /// (`start unix ms / window`): two runs started at the same point of a window compare
    /// window by window.
    pub fn per_window(&self, first_bucket: u64) -> BTreeMap<(u32, u64), u32> {
        self.keys
            .iter()
            .flat_map(|(&key, k)| k.buckets.iter().map(move |(&b, &n)| ((key, b.saturating_sub(first_bucket)), n)))
            .collect()
    }

    /// The summary.
    pub fn summary(&self) -> Summary {
        let limit = u64::from(self.limit);
        let mut s = Summary { keys: self.keys.len(), ..Summary::default() };
        let mut fullest: Vec<f64> = Vec::with_capacity(self.keys.len());
        let w = self.window_ms as f64;
        for k in self.keys.values() {
            let mut over = false;
            let mut most = 0u32;
            for &n in k.buckets.values() {
                most = most.max(n);
                if u64::from(n) > limit {
                    over = true;
                    s.windows_over += 1;
                    s.largest_over = s.largest_over.max(u64::from(n) - limit);
                }
            }
            if over {
                s.keys_over += 1;
            }
            if !k.buckets.is_empty() {
                fullest.push(f64::from(most) / limit.max(1) as f64);
            }
            s.peak_over = s.peak_over.max(k.peak as f64 / w - limit as f64);
        }
        fullest.sort_by(f64::total_cmp);
        s.fullest = [quantile(&fullest, 0.5), quantile(&fullest, 0.99), fullest.last().copied().unwrap_or(0.0)];
        let mut waits = self.waits_us.clone();
        waits.sort_unstable();
        let ms: Vec<f64> = waits.iter().map(|&us| us as f64 / 1000.0).collect();
        s.waits = (ms.len(), quantile(&ms, 0.5), quantile(&ms, 0.99), ms.last().copied().unwrap_or(0.0));
        s.added_p99 = added_quantile(&ms, self.admitted.saturating_add(self.refused), 0.99);
        s
    }
}

/// The `q` quantile (nearest rank) of the added latency over `decided` requests, of which those
/// that waited waited `waits` ms (sorted) and the others nothing.
pub fn added_quantile(waits: &[f64], decided: u64, q: f64) -> f64 {
    let decided = usize::try_from(decided).unwrap_or(usize::MAX).max(waits.len());
    if decided == 0 {
        return 0.0;
    }
    let rank = ((q * decided as f64).ceil() as usize).clamp(1, decided);
    let zeros = decided - waits.len();
    if rank <= zeros {
        0.0
    } else {
        waits[rank - zeros - 1]
    }
}

/// The `q` quantile of sorted `values` (nearest rank; 0 for none).
pub fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A moment `ms` into bucket 1 000 of a 10 s window.
    fn at(ms: u64) -> u64 {
        1000 * 10_000 + ms
    }

    #[test]
    fn admissions_up_to_the_limit_are_not_over_and_one_more_is() {
        let mut t = Tally::new(5, 10_000);
        for i in 0..5 {
            t.admit(1, at(i));
        }
        let s = t.summary();
        assert_eq!((s.windows_over, s.keys_over, s.largest_over), (0, 0, 0));
        assert_eq!(s.peak_over, 0.0);
        assert_eq!(s.fullest, [1.0, 1.0, 1.0]);
        t.admit(1, at(9));
        t.admit(1, at(10));
        let s = t.summary();
        assert_eq!((s.windows_over, s.keys_over, s.largest_over), (1, 1, 2));
        assert_eq!(s.peak_over, 2.0);
    }

    #[test]
    fn a_refusal_has_room_while_the_fleet_is_under_its_limit() {
        let mut t = Tally::new(3, 10_000);
        t.admit(1, at(0));
        assert!(t.refuse(1, at(1)), "1 of 3 admitted");
        t.admit(1, at(2));
        t.admit(1, at(3));
        assert!(!t.refuse(1, at(4)), "3 of 3");
        assert_eq!((t.refused, t.refused_with_room, t.largest_room), (2, 1, 2));
    }

    #[test]
    fn the_previous_bucket_weighs_as_the_filter_weighs_it() {
        let mut t = Tally::new(10, 10_000);
        // 10 at the end of bucket 1 000.
        for i in 0..10 {
            t.admit(1, at(9_000 + i));
        }
        // A quarter into bucket 1 001 the previous bucket weighs 7.5: room for 2.
        let quarter = at(10_000 + 2_500);
        assert!(t.refuse(1, quarter));
        assert_eq!(t.largest_room, 2);
        t.admit(1, quarter);
        t.admit(1, quarter);
        assert!(!t.refuse(1, quarter), "7.5 + 2 + 1 > 10");
        // Per bucket nobody is over; at its peak the estimate was exactly the limit, then
        // 7.5 + 2 = 9.5 (under).
        let s = t.summary();
        assert_eq!((s.windows_over, s.largest_over), (0, 0));
        assert_eq!(s.peak_over, 0.0);
        // The fullest buckets: 10 of 10.
        assert_eq!(s.fullest[2], 1.0);
    }

    #[test]
    fn the_distribution_over_keys_and_the_waits() {
        let mut t = Tally::new(4, 10_000);
        for key in 0..4u32 {
            for i in 0..=u64::from(key) {
                t.admit(key, at(i));
            }
        }
        for us in [1_000, 2_000, 3_000, 50_000] {
            t.waited(us);
        }
        let s = t.summary();
        assert_eq!(s.keys, 4);
        assert_eq!(s.fullest, [0.5, 1.0, 1.0]);
        assert_eq!(s.waits, (4, 2.0, 50.0, 50.0));
        // 10 decided, 4 of them waited: the p99 over all is the longest wait.
        assert_eq!(s.added_p99, 50.0);
        // Over 1 000 requests of which the same 4 waited, 990 added nothing; the 991st to the
        // 996th nothing either; the 997th to the 1 000th the waits.
        assert_eq!(added_quantile(&[1.0, 2.0, 3.0, 50.0], 1_000, 0.99), 0.0);
        assert_eq!(added_quantile(&[1.0, 2.0, 3.0, 50.0], 1_000, 0.997), 1.0);
        assert_eq!(added_quantile(&[1.0, 2.0, 3.0, 50.0], 1_000, 1.0), 50.0);
        assert_eq!(added_quantile(&[], 0, 0.99), 0.0);
    }

    #[test]
    fn admissions_per_window_count_from_the_first_bucket() {
        let mut t = Tally::new(10, 10_000);
        t.admit(1, at(5));
        t.admit(1, at(6));
        t.admit(1, at(10_001));
        t.admit(2, at(20_000));
        t.refuse(3, at(7));
        let w = t.per_window(1000);
        assert_eq!(w.into_iter().collect::<Vec<_>>(), vec![((1, 0), 2), ((1, 1), 1), ((2, 2), 1)], "a key only refused has no window");
        assert_eq!(t.window_ms(), 10_000);
    }

    #[test]
    fn an_overshoot_names_the_admissions_past_the_limit() {
        let mut t = Tally::new(4, 10_000);
        let from = |proxy: usize, leads: bool, waited: bool| Admission { proxy, leads, waited };
        for proxy in [0, 1, 2, 3] {
            t.admit_from(1, at(1_000 * proxy as u64), from(proxy, false, false));
        }
        assert!(t.overshoots(1.0).is_empty(), "at the limit exactly");
        t.admit_from(1, at(9_600), from(6, true, false));
        t.admit_from(1, at(9_500), from(5, false, true));
        t.admit_from(1, at(8_000), from(5, true, false));
        t.admit_from(2, at(9_600), from(6, false, false));
        let lines = t.overshoots(1.01);
        assert_eq!(lines.len(), 1);
        assert_eq!(
            lines[0],
            "key 1, bucket 1000: 7 admitted (1.750 × L); the limit reached 3000 ms into the window; 3 past it, 1 of them waited for the store, from 2 proxies, 2 on a VM leading its proxy's batches, per tenth of the window [0, 0, 0, 0, 0, 0, 0, 0, 1, 2]"
        );
        assert!(t.overshoots(1.8).is_empty());
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&v, 0.5), 50.0);
        assert_eq!(quantile(&v, 0.99), 99.0);
        assert_eq!(quantile(&v, 1.0), 100.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
