//! `floodgate`: checks floodgate configurations with the module's own parser before they reach a
//! proxy (`floodgate validate FILE...`), tells what the module would do with a request
//! (`floodgate explain FILE --path ...`), and prints the configuration's JSON Schema
//! (`floodgate schema`). See `docs/configuration.md`.

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args_os()
        .skip(1)
        .map(|arg| arg.to_string_lossy().into_owned())
        .collect();
    let status = floodgate_cli::run(&args, &mut std::io::stdout(), &mut std::io::stderr());
    ExitCode::from(status)
}
