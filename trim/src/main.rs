//! `floodgate-trim MODULE.wasm`: rewrites the module in place without the exports of the
//! callbacks floodgate does not implement (see the library's documentation). Run by
//! `wasm-build.sh`; running it again changes nothing.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [path] = args.as_slice() else {
        eprintln!("usage: floodgate-trim MODULE.wasm");
        return ExitCode::from(2);
    };
    match run(path) {
        Ok(message) => {
            eprintln!("floodgate-trim: {path}: {message}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("floodgate-trim: {path}: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(path: &str) -> Result<String, String> {
    let module = std::fs::read(path).map_err(|e| format!("cannot read: {e}"))?;
    let trimmed = floodgate_trim::trim(&module, floodgate_trim::UNUSED_CALLBACKS)?;
    if trimmed.removed.is_empty() {
        return Ok("no unused callback exported (already trimmed)".into());
    }
    // A new file renamed over the old one: a reader never sees half a module, and the file
    // cargo keeps under deps/ (the same inode before) stays as built.
    let staged = format!("{path}.trim");
    std::fs::write(&staged, &trimmed.module).map_err(|e| format!("cannot write {staged}: {e}"))?;
    if let Ok(metadata) = std::fs::metadata(path) {
        std::fs::set_permissions(&staged, metadata.permissions()).map_err(|e| format!("cannot set the permissions of {staged}: {e}"))?;
    }
    std::fs::rename(&staged, path).map_err(|e| format!("cannot replace the module: {e}"))?;
    Ok(format!("removed the export of {} (never called)", trimmed.removed.join(", ")))
}
