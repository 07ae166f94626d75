//! Epoch-aligned time windows: how far "now" is into one, and waiting until a timing-sensitive
//! test can start clear of a window boundary.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Time since the Unix epoch, from the system clock (the clock Envoy gives the filter).
pub fn since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("system clock after 1970")
}

/// How far "now" is into the current window, windows being aligned to multiples of `window`
/// since the Unix epoch.
pub fn window_phase(window: Duration) -> Duration {
    let w = window.as_nanos();
    assert!(w > 0, "window must be positive");
    Duration::from_nanos((since_epoch().as_nanos() % w) as u64)
}

/// Blocks until "now" is between `min_phase` and `max_phase` into an epoch-aligned window of
/// length `window` (so a test that starts now stays clear of a window boundary), and returns the
/// phase at that moment. Waits at most one window.
pub fn wait_for_window_phase(window: Duration, min_phase: Duration, max_phase: Duration) -> Duration {
    assert!(
        min_phase < max_phase && max_phase <= window,
        "need min_phase < max_phase <= window"
    );
    let deadline = Instant::now() + window + Duration::from_secs(1);
    let mut announced = false;
    loop {
        let phase = window_phase(window);
        if phase >= min_phase && phase <= max_phase {
            return phase;
        }
        let wait = if phase < min_phase {
            min_phase - phase
        } else {
            window - phase + min_phase
        };
        if !announced && wait > Duration::from_secs(1) {
            eprintln!(
                "waiting {:.1} s to be {:?}..{:?} into a {:?} window",
                wait.as_secs_f64(),
                min_phase,
                max_phase,
                window
            );
            announced = true;
        }
        assert!(
            Instant::now() < deadline,
            "wait_for_window_phase did not converge"
        );
        // Aim a little past the start of the range: sleeping overshoots by scheduling jitter only.
        std::thread::sleep(wait + Duration::from_millis(2));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_phase_is_below_window() {
        let w = Duration::from_secs(4);
        assert!(window_phase(w) < w);
        let p = wait_for_window_phase(w, Duration::from_millis(0), Duration::from_secs(4));
        assert!(p <= w);
    }
}
