//! Reading an Envoy's log: its last lines, the lines that show a Wasm VM failure or a panic in
//! the module, and the line that reports a refused filter configuration.

use std::path::Path;

/// Envoy's log so far: `envoy.log` in the directory it was started in (see
/// [`crate::envoy::spawn_envoy`]).
pub(crate) fn read_logs(dir: &Path) -> String {
    let bytes = std::fs::read(dir.join("envoy.log")).unwrap_or_default();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The last `n` lines of `s`.
pub fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// Log lines that show a Wasm VM failure or a panic in the module: a Rust panic message, a V8
/// trap (`Uncaught RuntimeError`), a stream failed by a broken VM (`wasm_fail_stream`), or any
/// line at level error/critical from the `wasm` logger.
pub fn wasm_failures(log: &str) -> Vec<String> {
    const MARKERS: [&str; 5] = [
        "panicked",
        "Uncaught",
        "RuntimeError",
        "wasm_fail_stream",
        "Plugin configured to fail closed",
    ];
    log.lines()
        .filter(|l| {
            MARKERS.iter().any(|m| l.contains(m))
                || ((l.contains("][error][") || l.contains("][critical]["))
                    && (l.contains("[wasm]") || l.contains("wasm log")))
        })
        .map(str::to_string)
        .collect()
}

/// The first log line that reports a refused filter configuration (`invalid configuration: ...`),
/// from `invalid configuration` on.
pub fn config_error_line(log: &str) -> Option<String> {
    log.lines().find_map(|l| {
        l.find("invalid configuration")
            .map(|i| l[i..].to_string())
    })
}
