//! Reading an Envoy's log: its last lines, the lines that show a Wasm VM failure or a panic in
//! the module, and the line that reports a refused filter configuration.

pub use floodgate_harness::tail;

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
