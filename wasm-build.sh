#!/usr/bin/env bash
# Builds the floodgate proxy-wasm module (release profile: LTO, one codegen unit, abort on panic),
# then trims it (floodgate-trim: no export of the callbacks it does not implement); and
# floodgate-llm.wasm, the module that reads response bodies (`cost.from: response_body`, token
# quotas for LLM APIs: docs/llm.md), built with the `response-body` feature in its own target
# directory and left untrimmed (Envoy calls it for every response body frame).
# Installs the wasm32-wasip1 target when missing. The last line of output is the module's path.
set -euo pipefail
cd "$(dirname "$0")"
target=wasm32-wasip1
if ! rustup target list --installed | grep -qx "$target"; then
  echo "installing the $target target" >&2
  rustup target add "$target" >&2
fi
# The two modules build at once (their own target directories; most of each build is the one
# long LTO compile of the module, on one core). Both target directories exist before either build
# starts: cargo creates a missing one through a temporary sibling and a rename, and two builds
# doing that at once under a missing target/ lose one of the two.
mkdir -p "$PWD/target/response-body"
cargo build --release --target "$target" -p floodgate --features response-body --target-dir "$PWD/target/response-body" >&2 &
llm_build=$!
cargo build --release --target "$target" -p floodgate >&2
module="$PWD/target/$target/release/floodgate.wasm"
# Remove the exports of callbacks floodgate does not implement, which Envoy would otherwise call
# on every request for nothing (trim/src/lib.rs; a trimmed module is left as it is).
cargo run --quiet -p floodgate-trim -- "$module" >&2
wait "$llm_build"
llm="$PWD/target/$target/release/floodgate-llm.wasm"
cp "$PWD/target/response-body/$target/release/floodgate.wasm" "$llm"
ls -l "$module" "$llm" >&2
echo "$module"
