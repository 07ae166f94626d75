#!/usr/bin/env bash
# Builds the peers of `bench/run.sh peers` from their public sources: Kuadrant's wasm-shim (the
# proxy-wasm module) and Limitador (`limitador-server`). Not part of ./test.sh or CI: Limitador
# alone takes about 17 min on 2 cores.
#
#   bench/peers/build.sh [--dir DIR] [--lean] [--wasm-shim SRC] [--limitador SRC]
#                        [--cel-rust SRC] [--wasm-test-framework SRC]
#
# SRC is anything `git clone` takes: a URL (the default: the project's GitHub repository) or the
# path of a local clone or bare repository. DIR (default: target/peers) receives the clones and
# the builds. The last two lines printed are the variables `bench/run.sh peers` reads:
#
#   WASM_SHIM_WASM=DIR/target-wasm-shim/wasm32-wasip1/release/wasm_shim.wasm
#   LIMITADOR_BIN=DIR/target-limitador/release/limitador-server
#
# --lean builds limitador-server with limitador-lean.patch (next to this script): without its
# disk storage (RocksDB) and against the system's OpenSSL (Debian: libssl-dev) instead of a
# vendored copy. The storages measured (`redis`, `redis_cached`) and the request path are the
# same; the build skips compiling RocksDB and OpenSSL from C and C++, most of its time on a busy
# machine.
#
# Both compile under `nice -n 19`. Needs git, cargo with the wasm32-wasip1 target, `protoc`
# (Debian: protobuf-compiler) and, for RocksDB, clang and libclang (Debian: clang libclang-dev).
#
# wasm-shim's git dependencies are pointed at local clones through `[patch]`. One of them,
# Kuadrant's fork of the proxy-wasm Rust SDK, has no public source to build from; in its place
# stands the proxy-wasm crate 0.2.5 from crates.io with proxy-wasm-sdk.patch (next to this
# script) applied: the trait methods `get_grpc_call_response_body`, `get_plugin_configuration`,
# `set_tick_period`, `resume_http_request` and `resume_http_response` return the host call's
# `Result` instead of unwrapping it, and every host call returns `Err(status)` on a status it
# does not expect instead of panicking. That is what wasm-shim's code relies on of the fork.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cd "$here/../.."

dir=$PWD/target/peers
wasm_shim_src=https://github.com/Kuadrant/wasm-shim.git
limitador_src=https://github.com/Kuadrant/limitador.git
cel_src=https://github.com/cel-rust/cel-rust.git
framework_src=https://github.com/Kuadrant/wasm-test-framework.git
lean=
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --lean) lean=1; shift ;;
    --wasm-shim) wasm_shim_src=$2; shift 2 ;;
    --limitador) limitador_src=$2; shift 2 ;;
    --cel-rust) cel_src=$2; shift 2 ;;
    --wasm-test-framework) framework_src=$2; shift 2 ;;
    *) sed -n '2,/^set -euo/p' "$0" | sed '$d' >&2; exit 2 ;;
  esac
done
# The commits measured (docs/benchmarks.md, "Peers"); cel-rust's is the one wasm-shim pins.
wasm_shim_rev=af0f9b4
limitador_rev=2981b2b
cel_rev=d23d0a7

step() { printf '==> %s\n' "$*" >&2; }
missing=$(for tool in git cargo protoc clang; do command -v "$tool" >/dev/null || printf '%s ' "$tool"; done)
[[ -z $missing ]] || { echo "bench/peers/build.sh: needs ${missing}(Debian: apt-get install protobuf-compiler clang libclang-dev)" >&2; exit 1; }
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

# clone SRC NAME REV: a work tree of REV at DIR/NAME. A file whose content the source lacks
# (Limitador's snapshots can miss `default.profraw`, a stray profile, which breaks a checkout)
# is left out of the work tree, marked skip-worktree so that git sees the tree clean.
clone() {
  local src=$1 name=$2 rev=$3 path=$dir/$2
  if [[ ! -d $path/.git ]]; then
    step "clone $name from $src"
    git clone -q --no-checkout "$src" "$path"
  fi
  git -C "$path" reset -q "$rev"
  local missing
  missing=$(git -C "$path" ls-tree -r --format='%(objectname)' "$rev" | git -C "$path" cat-file --batch-check | awk '$2 == "missing" { print $1 }')
  for object in $missing; do
    git -C "$path" ls-tree -r --format='%(objectname) %(path)' "$rev" | awk -v o="$object" '$1 == o { print substr($0, length(o) + 2) }' |
      while read -r file; do
        echo "bench/peers/build.sh: $name: $file is missing from the source; left out of the work tree" >&2
        git -C "$path" update-index --skip-worktree -- "$file"
      done
  done
  git -C "$path" checkout -q -- .
}

clone "$wasm_shim_src" wasm-shim "$wasm_shim_rev"
clone "$limitador_src" limitador "$limitador_rev"
clone "$cel_src" cel-rust "$cel_rev"
# A dev-dependency of wasm-shim, not compiled into the module; the commit it pins may be gone.
clone "$framework_src" wasm-test-framework HEAD

step "the proxy-wasm SDK: the crate 0.2.5 from crates.io, patched (bench/peers/proxy-wasm-sdk.patch)"
sdk=$dir/proxy-wasm-sdk
if [[ ! -f $sdk/Cargo.toml ]]; then
  fetcher=$dir/proxy-wasm-fetch
  mkdir -p "$fetcher/src"
  printf '[package]\nname = "proxy-wasm-fetch"\nversion = "0.0.0"\nedition = "2021"\n\n[dependencies]\nproxy-wasm = "=0.2.5"\n\n[workspace]\n' >"$fetcher/Cargo.toml"
  : >"$fetcher/src/lib.rs"
  (cd "$fetcher" && cargo vendor --versioned-dirs -q vendor >/dev/null)
  cp -r "$fetcher/vendor/proxy-wasm-0.2.5" "$sdk"
  patch -s -p1 -d "$sdk" <"$here/proxy-wasm-sdk.patch"
fi

step "build wasm-shim $wasm_shim_rev (nice -n 19 cargo build --target wasm32-wasip1 --release)"
manifest=$dir/wasm-shim/Cargo.toml
if ! grep -q '^\[patch."https://github.com/Kuadrant/proxy-wasm-rust-sdk.git"\]' "$manifest"; then
  cat >>"$manifest" <<EOF

[patch."https://github.com/Kuadrant/proxy-wasm-rust-sdk.git"]
proxy-wasm = { path = "$sdk" }

[patch."https://github.com/cel-rust/cel-rust.git"]
cel = { path = "$dir/cel-rust/cel" }

[patch."https://github.com/Kuadrant/wasm-test-framework.git"]
proxy-wasm-test-framework = { path = "$dir/wasm-test-framework" }
EOF
fi
if ! rustup target list --installed | grep -qx wasm32-wasip1; then
  rustup target add wasm32-wasip1 >&2
fi
started=$(date +%s)
(cd "$dir/wasm-shim" && CARGO_TARGET_DIR=$dir/target-wasm-shim nice -n 19 cargo build --target wasm32-wasip1 --release >&2)
step "wasm-shim built in $(($(date +%s) - started)) s"

flags=(--locked)
if [[ -n $lean ]]; then
  step "limitador-server without disk storage, against the system's OpenSSL (bench/peers/limitador-lean.patch)"
  git -C "$dir/limitador" apply "$here/limitador-lean.patch"
  flags=(--no-default-features)
fi
step "build limitador-server $limitador_rev (nice -n 19 cargo build --release -p limitador-server ${flags[*]})"
started=$(date +%s)
(cd "$dir/limitador" && CARGO_TARGET_DIR=$dir/target-limitador nice -n 19 cargo build --release "${flags[@]}" -p limitador-server >&2)
step "limitador-server built in $(($(date +%s) - started)) s"

echo "WASM_SHIM_WASM=$dir/target-wasm-shim/wasm32-wasip1/release/wasm_shim.wasm"
echo "LIMITADOR_BIN=$dir/target-limitador/release/limitador-server"
