//! Replays every committed fuzz input through the fuzz entry points, natively, under plain
//! `cargo test -p floodgate`: the seed corpus (`fuzz/seeds/<target>/`) and every input a fuzzer
//! ever found failing (`fuzz/regressions/<target>/`, kept forever once fixed).
//!
//! The entry points are the very functions the cargo-fuzz targets call (`fuzz/src/lib.rs`,
//! included below), so a committed crash reproduces here without nightly or libFuzzer.
#![allow(
    clippy::arithmetic_side_effects,
    clippy::indexing_slicing,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    missing_docs
)]

#[path = "../../fuzz/src/lib.rs"]
mod targets;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz")
}

/// The files of `fuzz/<kind>/<target>/`, sorted (none if the folder does not exist).
fn inputs(kind: &str, target: &str) -> Vec<PathBuf> {
    let dir = fuzz_dir().join(kind).join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map(|entries| entries.flatten().map(|e| e.path()).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    files.sort();
    files
}

/// Runs every input of `kind` through its target; returns how many ran, and the failures.
fn replay(kind: &str) -> (usize, Vec<String>) {
    let mut ran = 0;
    let mut failures = Vec::new();
    for (target, entry) in targets::TARGETS {
        for file in inputs(kind, target) {
            let data = std::fs::read(&file).unwrap_or_else(|e| panic!("read {}: {e}", file.display()));
            ran += 1;
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| entry(&data))) {
                let message = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                    .unwrap_or_default();
                failures.push(format!("{target}: {}: {message}", file.display()));
            }
        }
    }
    (ran, failures)
}

#[test]
fn every_seed_input_passes() {
    for (target, _) in targets::TARGETS {
        assert!(
            !inputs("seeds", target).is_empty(),
            "fuzz target {target} has no seed inputs in fuzz/seeds/{target}/"
        );
    }
    let (ran, failures) = replay("seeds");
    println!("replayed {ran} seed inputs");
    assert!(failures.is_empty(), "failing seed inputs:\n{}", failures.join("\n"));
}

#[test]
fn every_regression_input_passes() {
    let (ran, failures) = replay("regressions");
    println!("replayed {ran} regression inputs");
    assert!(failures.is_empty(), "failing regression inputs:\n{}", failures.join("\n"));
}

/// Every entry point is a cargo-fuzz target: a `fuzz_targets/<name>.rs` calling it and a
/// `[[bin]]` in `fuzz/Cargo.toml`, so `fuzz/run.sh` runs them all.
#[test]
fn every_entry_point_is_a_fuzz_target() {
    let manifest = std::fs::read_to_string(fuzz_dir().join("Cargo.toml")).expect("fuzz/Cargo.toml");
    for (target, _) in targets::TARGETS {
        let source = fuzz_dir().join("fuzz_targets").join(format!("{target}.rs"));
        let text = std::fs::read_to_string(&source)
            .unwrap_or_else(|e| panic!("{}: {e}", source.display()));
        assert!(text.contains(&format!("floodgate_fuzz::{target}(")), "{} calls {target}", source.display());
        assert!(
            manifest.contains(&format!("name = \"{target}\"")),
            "fuzz/Cargo.toml lists the [[bin]] {target}"
        );
    }
}

/// Fuzz finding (design, fixed): an in-flight entry whose heartbeat lies in the future (a corrupt
/// or foreign record, or a dead VM's entry after the wall clock stepped back) counted until the
/// clock passed it plus `STALE_AFTER_MS`: with a heartbeat of `u64::MAX` the phantom count never
/// expired and the proxy shed everything. An entry more than `STALE_AFTER_MS` ahead of `now` is
/// not trusted (counted as dead and dropped at the next publish).
#[test]
fn an_in_flight_entry_from_the_future_does_not_count_forever() {
    use floodgate::primitives::inflight::{InFlight, VmEntry, STALE_AFTER_MS};
    use floodgate::primitives::time::MonoMillis;
    let now = MonoMillis(1_700_000_000_000);
    let record = InFlight {
        entries: vec![VmEntry { vm: 9, in_flight: 1_000, heartbeat: MonoMillis(u64::MAX) }],
    };
    let an_hour_later = now.plus_ms(3_600_000);
    assert_eq!(
        record.total(an_hour_later),
        0,
        "a heartbeat {} ms in the future still counts an hour later",
        u64::MAX - now.0
    );
    let skewed = InFlight {
        entries: vec![VmEntry { vm: 9, in_flight: 1_000, heartbeat: now.plus_ms(10 * STALE_AFTER_MS) }],
    };
    assert_eq!(skewed.total(now.plus_ms(2 * STALE_AFTER_MS)), 0, "an entry far ahead of the clock keeps counting");
}
