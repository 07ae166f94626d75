//! Load shedding on scheduling lag: overload seen from the proxy itself, with no limit to guess.
//! Each worker asks for a tick every `probe_ms` and measures how late it runs on the monotonic
//! clock; a worker whose event loop has more work queued than it can do runs it late by about that
//! much.
//!
//! ```text
//! lag = (now − previous tick) − probe_ms          (0 when on time)
//! shed c from when  median(last 3 lags) ≥ shed_at(c) × max_loop_lag
//! until             max(last 3 lags) < shed_at(c) × max_loop_lag / 2
//! ```
//!
//! Invariant: a hysteresis band. One late tick does not start shedding (the median of three filters
//! a spike out; not the least of three, since a saturated loop still runs some timers on time), and
//! shedding does not stop at the first tick on time, so it does not flap. Each worker sheds on its
//! own lag.
//!
//! Rationale: docs/design.md, section "On the loop lag".

use crate::config::LoadShedding;
use crate::primitives::time::MonoMillis;

/// The probes the rules look at (module doc).
pub const WINDOW: usize = 3;

/// One worker's view of its event loop's lag, and which classes it sheds.
#[derive(Clone, Debug)]
pub struct LagMonitor {
    probe_ms: u64,
    /// Per class, in configuration order: the lag from which it is shed, in milliseconds.
    thresholds_ms: Vec<u64>,
    /// `max_loop_lag`, in milliseconds.
    max_loop_lag_ms: u64,
    /// When the previous probe ran.
    last_probe: Option<MonoMillis>,
    /// The last [`WINDOW`] lags, newest last.
    recent: Vec<u64>,
    /// Per class: shed now.
    shedding: Vec<bool>,
    /// The largest lag since [`LagMonitor::take_max`] was last called.
    max_since: u64,
}

/// A class shed because the loop lags.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LagShed {
    /// Index of the class.
    pub class: usize,
    /// The loop's lag, in milliseconds (the median of the recent probes).
    pub lag_ms: u64,
    /// The class's threshold, in milliseconds.
    pub threshold_ms: u64,
}

impl LagMonitor {
    /// The monitor of `config`, if it sheds on lag (`max_loop_lag`).
    pub fn new(config: &LoadShedding) -> Option<LagMonitor> {
        let max = config.max_loop_lag.as_ref()?.get().get();
        let thresholds_ms = config
            .classes
            .iter()
            .map(|c| {
                let scaled = (c.shed_at.get() * max as f64).floor();
                // shed_at is in (0, 1]: the product fits in [0, max].
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let ms = scaled.clamp(1.0, max as f64) as u64;
                ms
            })
            .collect::<Vec<_>>();
        Some(LagMonitor {
            probe_ms: config.lag_probe_interval.get().get(),
            shedding: vec![false; thresholds_ms.len()],
            thresholds_ms,
            max_loop_lag_ms: max,
            last_probe: None,
            recent: Vec::with_capacity(WINDOW),
            max_since: 0,
        })
    }

    /// How often the worker must probe (its tick period), in milliseconds.
    pub fn probe_ms(&self) -> u64 {
        self.probe_ms
    }

    /// `max_loop_lag`, in milliseconds.
    pub fn max_loop_lag_ms(&self) -> u64 {
        self.max_loop_lag_ms
    }

    /// The lag threshold of class `class`, in milliseconds.
    pub fn threshold_ms(&self, class: usize) -> Option<u64> {
        self.thresholds_ms.get(class).copied()
    }

    /// One probe (a tick) at `now`: measures the lag since the previous probe and moves each
    /// class in or out of shedding. Returns the lag measured.
    pub fn probe(&mut self, now: MonoMillis) -> u64 {
        let lag = match self.last_probe {
            // A tick that comes early, or a clock that went back, is on time.
            Some(last) => now.saturating_since(last).saturating_sub(self.probe_ms),
            None => 0,
        };
        self.last_probe = Some(now);
        if self.recent.len() >= WINDOW {
            self.recent.remove(0);
        }
        self.recent.push(lag);
        self.max_since = self.max_since.max(lag);
        if self.recent.len() >= WINDOW {
            let typical = self.lag_ms();
            let most = self.recent.iter().copied().max().unwrap_or(0);
            for (shedding, threshold) in self.shedding.iter_mut().zip(&self.thresholds_ms) {
                if typical >= *threshold {
                    *shedding = true;
                } else if most < threshold / 2 {
                    *shedding = false;
                }
            }
        }
        lag
    }

    /// Whether a request of class `class` is shed now, and why.
    pub fn sheds(&self, class: usize) -> Option<LagShed> {
        if !*self.shedding.get(class)? {
            return None;
        }
        Some(LagShed {
            class,
            lag_ms: self.lag_ms(),
            threshold_ms: self.thresholds_ms.get(class).copied().unwrap_or(0),
        })
    }

    /// Whether any class is shed now.
    pub fn is_shedding(&self) -> bool {
        self.shedding.iter().any(|s| *s)
    }

    /// The loop's recent lag, in milliseconds: the median of the last [`WINDOW`] probes (of
    /// those there are).
    pub fn lag_ms(&self) -> u64 {
        let mut recent = self.recent.clone();
        recent.sort_unstable();
        recent.get(recent.len() / 2).copied().unwrap_or(0)
    }

    /// The largest lag measured since the last call (for the gauge), and starts over.
    pub fn take_max(&mut self) -> u64 {
        std::mem::take(&mut self.max_since)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::indexing_slicing)]
mod tests {
    use super::*;
    use crate::config::Config;

    fn monitor(json: &str) -> LagMonitor {
        let config = Config::parse(format!(r#"{{"load_shedding":{json}}}"#).as_bytes()).unwrap();
        LagMonitor::new(config.load_shedding.as_ref().unwrap()).unwrap()
    }

    /// Probes `lags` (each tick `probe + lag` after the previous), from `start`; returns the time.
    fn run(m: &mut LagMonitor, start: MonoMillis, lags: &[u64]) -> MonoMillis {
        let mut now = start;
        for lag in lags {
            now = now.plus_ms(m.probe_ms() + lag);
            m.probe(now);
        }
        now
    }

    const T0: MonoMillis = MonoMillis(1_000_000);

    #[test]
    fn thresholds_are_the_classes_shares_of_the_lag() {
        let m = monitor(r#"{"max_loop_lag":"100ms"}"#);
        // critical 1.0, normal 0.9, low 0.5
        assert_eq!((0..3).map(|c| m.threshold_ms(c).unwrap()).collect::<Vec<_>>(), vec![100, 90, 50]);
        assert_eq!(m.probe_ms(), 100, "the default probe");
        assert!(LagMonitor::new(
            Config::parse(br#"{"load_shedding":{"max_active_requests":5}}"#).unwrap().load_shedding.as_ref().unwrap()
        )
        .is_none());
    }

    #[test]
    fn a_single_late_tick_sheds_nothing() {
        let mut m = monitor(r#"{"max_loop_lag":"100ms"}"#);
        m.probe(T0);
        let now = run(&mut m, T0, &[0, 0, 500, 0, 0, 300, 10]);
        assert!(!m.is_shedding(), "one tick 500 ms late, another 300 ms late later");
        assert_eq!(m.take_max(), 500, "the histogram still sees it");
        assert_eq!(m.take_max(), 0);
        run(&mut m, now, &[0, 0, 0]);
        assert!(!m.is_shedding());
    }

    #[test]
    fn classes_are_shed_low_first_as_the_lag_grows_and_released_with_hysteresis() {
        let mut m = monitor(r#"{"max_loop_lag":"100ms"}"#);
        m.probe(T0);
        let (critical, normal, low) = (0, 1, 2);
        let now = run(&mut m, T0, &[60, 60, 60]);
        assert_eq!(m.sheds(low), Some(LagShed { class: low, lag_ms: 60, threshold_ms: 50 }));
        assert_eq!((m.sheds(normal), m.sheds(critical)), (None, None));
        let now = run(&mut m, now, &[95, 95, 95]);
        assert!(m.sheds(normal).is_some() && m.sheds(critical).is_none(), "normal from 90 ms");
        let now = run(&mut m, now, &[120, 120, 120]);
        assert!(m.sheds(critical).is_some(), "critical from 100 ms");
        // Back below the thresholds, but within the band: still shed.
        let now = run(&mut m, now, &[70, 70, 70]);
        assert!(m.sheds(critical).is_some() && m.sheds(normal).is_some() && m.sheds(low).is_some());
        // Below half of critical's and normal's thresholds, not low's.
        let now = run(&mut m, now, &[40, 40, 40]);
        assert_eq!((m.sheds(critical), m.sheds(normal)), (None, None));
        assert!(m.sheds(low).is_some(), "low stops below 25 ms only");
        // One probe under: not yet.
        let now = run(&mut m, now, &[10]);
        assert!(m.sheds(low).is_some());
        let now = run(&mut m, now, &[10, 10]);
        assert!(!m.is_shedding(), "three probes under half the threshold");
        // A saturated loop that runs one timer in three on time is still saturated.
        run(&mut m, now, &[0, 120, 130, 0, 110]);
        assert!(m.sheds(critical).is_some(), "two of three probes past 100 ms");
    }

    #[test]
    fn early_ticks_and_clock_oddities_count_as_on_time() {
        let mut m = monitor(r#"{"max_loop_lag":"50ms","lag_probe_interval":"20ms"}"#);
        assert_eq!(m.probe(T0), 0, "the first probe has nothing to compare with");
        assert_eq!(m.probe(T0.plus_ms(5)), 0, "early");
        assert_eq!(m.probe(MonoMillis(0)), 0, "backwards");
        assert_eq!(m.probe(MonoMillis(20 + 30)), 30);
    }
}
