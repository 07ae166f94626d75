//! A wall clock that only the Envoy under test sees, and that a test can step, as an NTP step
//! or a resumed VM steps a real one: `wallshift` (`integration/wallshift/wallshift.c`, built by
//! this crate's build script) is preloaded into the Envoy process and shifts its
//! `CLOCK_REALTIME` by the seconds written in a file the test rewrites; the monotonic clock runs
//! on untouched. Nothing else on the machine is affected.
//!
//! Why not libfaketime, the usual tool: preloaded into Envoy it deadlocks at start-up (its
//! initialisation allocates, through Envoy's tcmalloc, which reads the clock while it
//! initialises). wallshift allocates nothing.

use std::path::PathBuf;
use std::time::Duration;

/// How often the process re-reads the shift: a step takes effect in Envoy within this long.
pub const REREAD: Duration = Duration::from_millis(100);

/// A wall clock for one process, shifted from the real one by what [`SteppedWallClock::step`]
/// set (initially nothing).
pub struct SteppedWallClock {
    dir: tempfile::TempDir,
    shift_secs: std::cell::Cell<i64>,
}

impl SteppedWallClock {
    /// A clock with no shift yet.
    pub fn new() -> SteppedWallClock {
        let dir = tempfile::Builder::new().prefix("floodgate-wallclock-").tempdir().expect("tempdir");
        let clock = SteppedWallClock { dir, shift_secs: std::cell::Cell::new(0) };
        clock.write();
        clock
    }

    fn file(&self) -> PathBuf {
        self.dir.path().join("shift")
    }

    fn write(&self) {
        let tmp = self.dir.path().join("shift.tmp");
        std::fs::write(&tmp, format!("{:+}\n", self.shift_secs.get())).expect("write the shift");
        std::fs::rename(&tmp, self.file()).expect("move the shift in place");
    }

    /// The environment that makes a process read this clock (for [`crate::EnvoyBuilder::env`]).
    pub fn env(&self) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), env!("FLOODGATE_WALLSHIFT_SO").into()),
            ("FLOODGATE_WALLSHIFT_FILE".into(), self.file().display().to_string()),
        ]
    }

    /// Steps the wall clock forward by `by` (whole seconds); the process sees it within
    /// [`REREAD`].
    pub fn step(&self, by: Duration) {
        let secs = i64::try_from(by.as_secs()).expect("a step of sane size");
        self.shift_secs.set(self.shift_secs.get() + secs);
        self.write();
    }
}

impl Default for SteppedWallClock {
    fn default() -> Self {
        SteppedWallClock::new()
    }
}
