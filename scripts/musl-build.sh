#!/usr/bin/env bash
# Builds one binary of the workspace as a static musl executable:
#
#   scripts/musl-build.sh PACKAGE BINARY
#
# (`cargo build -p PACKAGE --release --target <arch>-unknown-linux-musl`). Adds the musl target with
# rustup when missing. ring (rustls' cryptography, for floodgate-sync's rediss://) compiles some C:
# without a musl cross compiler, the host's cc builds it (its C is freestanding: no libc headers).
# The LAST line printed is the binary's path. Exits 3 when the musl target cannot be had (callers
# may fall back to a glibc build), 1 on any other failure.
# Used by scripts/sync-image.sh and scripts/release.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

[[ $# -eq 2 ]] || { echo "usage: scripts/musl-build.sh PACKAGE BINARY" >&2; exit 1; }
package=$1 binary=$2
musl=x86_64-unknown-linux-musl
case "$(uname -m)" in aarch64) musl=aarch64-unknown-linux-musl ;; esac
if ! rustup target list --installed 2>/dev/null | grep -qx "$musl" && ! rustup target add "$musl" >&2; then
  echo "scripts/musl-build.sh: no $musl target" >&2
  exit 3
fi
cc_var=CC_${musl//-/_}
if [[ -z "${!cc_var:-}" ]] && ! command -v "${musl%%-*}-linux-musl-gcc" >/dev/null && ! command -v musl-gcc >/dev/null; then
  export "$cc_var"=cc
fi
# A caller that cargo runs (an integration test) hands on the variables cargo sets for its own
# crate; build scripts that read them (ring's reads CARGO_MANIFEST_DIR) would see them change and
# rebuild their crates and everything above: the build runs without them.
while read -r name; do unset "$name"; done < <(compgen -e | grep -E '^CARGO_(MANIFEST_|PKG_|CRATE_NAME$|BIN_|PRIMARY_PACKAGE$|TARGET_TMPDIR$)' || true)
echo "scripts/musl-build.sh: cargo build -p $package --release --target $musl" >&2
cargo build -p "$package" --release --target "$musl" >&2
bin=$PWD/target/$musl/release/$binary
[[ -x "$bin" ]] || { echo "scripts/musl-build.sh: no binary at $bin" >&2; exit 1; }
echo "$bin"
