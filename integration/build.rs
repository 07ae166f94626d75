//! Builds `wallshift/wallshift.c` into a shared library (`libwallshift.so` in `OUT_DIR`) that the
//! tests preload into Envoy to step its wall clock (see `src/wallclock.rs`). Uses the C compiler
//! the project already needs (`$CC`, else `cc`).

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let source = PathBuf::from("wallshift/wallshift.c");
    println!("cargo:rerun-if-changed={}", source.display());
    println!("cargo:rerun-if-env-changed=CC");
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR is set by cargo")).join("libwallshift.so");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-Wno-nonnull-compare", "-o"])
        .arg(&out)
        .arg(&source)
        .status()
        .unwrap_or_else(|e| panic!("cannot run the C compiler `{cc}` (a C compiler is a prerequisite, see docs/getting-started.md): {e}"));
    assert!(status.success(), "`{cc}` failed to build {}", source.display());
    println!("cargo:rustc-env=FLOODGATE_WALLSHIFT_SO={}", out.display());
}
