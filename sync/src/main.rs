//! `floodgate-sync`: see `floodgate-sync --help` and `sync/README.md`.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use tracing_subscriber::EnvFilter;

/// The log filter without RUST_LOG: this service's events at info; redis-rs's own messages only
/// at error (it logs every failed reconnection attempt; the service logs Redis errors itself,
/// at most one line a second).
const DEFAULT_LOG: &str = "info,redis=error";

fn main() -> ExitCode {
    let args = floodgate_sync::config::Args::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(DEFAULT_LOG));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            tracing::error!("cannot start the runtime: {err}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(floodgate_sync::run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            tracing::error!("{err}");
            ExitCode::FAILURE
        }
    }
}
