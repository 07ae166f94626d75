#!/usr/bin/env bash
# Fails when a tracked text file (*.md, *.rs, *.yaml, *.yml, *.json, *.sh, *.py, *.toml, *.lua)
# speaks of how the project was developed rather than of the product: what a user reads (docs,
# comments, messages, configurations) describes floodgate as it is.
#
# It refuses:
#   * issue references: "issue 17", "issue-17", "issues #3", and a bare "#17" standing as a word in
#     prose (not a Markdown anchor such as "(#5-global-scope)", not a Rust attribute "#[test]");
#   * "session" (work history);
#   * lab-run wording: "before the fix", "before the trim", "before the cuts", "not yet fixed",
#     "found 2026-...";
#   * generated seed file names (123_0123456789abcdef.txt), SPEC.md, and paths under notes/;
#   * a tracked file named SPEC.md or under notes/.
#
# The allowlist below is explicit and minimal: a path and a fixed piece of the line it allows. An
# entry that matches nothing any more is an error too, so it goes when its line goes.
#
#   scripts/history-check.sh               check the repository this script is in
#   scripts/history-check.sh DIR           check the git work tree DIR
#   scripts/history-check.sh --self-test   plant each kind of finding in a scratch repository
#                                          and check that every one is caught
# Prints what it found, one `path:line: text` per finding, and exits 1 if anything was found.
set -euo pipefail

self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")

# path <TAB> fixed text of the allowed line
ALLOW=$(cat <<'ALLOWLIST'
bench/src/envoy.rs	pid (comm) state ppid pgrp session tty
ALLOWLIST
)

# One Perl-compatible pattern per kind, matched case-insensitively.
PATTERNS=(
  'issue-ref|\bissues?[ -]#?[0-9]+\b'
  'issue-ref|(^|[\s(\[,;])#[0-9]{1,5}(?=[\s).,;:\]]|$)'
  'session|\bsessions?\b'
  'lab-wording|\bbefore the (fix|trim|cuts)\b|\bnot yet fixed\b|\bfound 20[0-9]{2}-'
  'seed-file|\b[0-9]{3}_[0-9a-f]{16}\.txt\b'
  'spec-file|\bSPEC\.md\b'
  'notes-path|(^|[^A-Za-z0-9_./-])notes/'
)

check() {
  local root=$1 findings=0 file kind pattern hits line allowed entry
  local -A used=()
  cd "$root"
  while IFS= read -r file; do
    case "$file" in
      SPEC.md | */SPEC.md | notes/* | */notes/*)
        echo "$file: a tracked development file"
        findings=$((findings + 1))
        ;;
    esac
  done < <(git ls-files)
  local -a files=()
  while IFS= read -r -d '' file; do
    # This script names the patterns it refuses.
    [[ "$root/$file" -ef "$self" ]] || files+=("$file")
  done < <(git ls-files -z -- '*.md' '*.rs' '*.yaml' '*.yml' '*.json' '*.sh' '*.py' '*.toml' '*.lua')
  ((${#files[@]} > 0)) || return 0
  for p in "${PATTERNS[@]}"; do
    kind=${p%%|*}
    pattern=${p#*|}
    hits=$(grep -HnIiP -- "$pattern" "${files[@]}" 2>/dev/null || true)
    [[ -n "$hits" ]] || continue
    while IFS= read -r line; do
      file=${line%%:*}
      line=${line#*:}
      allowed=0
      while IFS=$'\t' read -r apath atext; do
        [[ -n "$apath" ]] || continue
        if [[ "$file" == "$apath" && "${line#*:}" == *"$atext"* ]]; then
          allowed=1
          used["$apath	$atext"]=1
        fi
      done <<<"$ALLOW"
      if ((allowed == 0)); then
        echo "$file:${line%%:*}: [$kind] ${line#*:}"
        findings=$((findings + 1))
      fi
    done <<<"$hits"
  done
  if [[ "$root" -ef "$(dirname "$self")/.." ]]; then
    while IFS= read -r entry; do
      [[ -n "$entry" && -z "${used[$entry]:-}" ]] || continue
      echo "scripts/history-check.sh: the allowlist entry \"${entry/$'\t'/: }\" matches nothing: remove it"
      findings=$((findings + 1))
    done <<<"$ALLOW"
  fi
  if ((findings > 0)); then
    echo "history-check: $findings finding(s): describe the product as it is (see scripts/history-check.sh)" >&2
    return 1
  fi
  echo "history-check: ${#files[@]} tracked text files, nothing found"
}

self_test() {
  local dir out failed=0
  dir=$(mktemp -d)
  trap 'rm -rf "$dir"' RETURN
  git -C "$dir" init --quiet
  mkdir -p "$dir/docs" "$dir/src"
  # Each planted line must be found...
  local planted=(
    'docs/a.md|Fixed in issue 17.'
    'docs/b.md|See issue-17 for the details.'
    'docs/c.md|As reported in #17, the window drifts.'
    'src/d.rs|// session 4 measured this'
    'docs/e.md|The p99 was 3 ms before the fix.'
    'docs/f.md|Measured before the cuts.'
    'docs/g.md|This is not yet fixed.'
    'docs/h.md|A race, found 2026-11-02.'
    'src/i.rs|// replayed from 017_0123456789abcdef.txt'
    'docs/j.md|The requirements in SPEC.md say so.'
    'docs/k.md|See notes/benchmarks.md.'
  )
  # ...and none of these.
  local clean=(
    'docs/l.md|See [5. Global scope](#5-global-scope) and [the run](#2026-11-25-1728-utc).'
    'src/m.rs|#[test] fn t() { let label = "Wasm filter \"floodgate\" #2"; }'
    'docs/n.md|The color is #112233 and the notes of Envoy 1.36 are upstream.'
  )
  local entry
  for entry in "${planted[@]}" "${clean[@]}"; do
    printf '%s\n' "${entry#*|}" >"$dir/${entry%%|*}"
  done
  git -C "$dir" add -A
  out=$(check "$dir" 2>&1) && failed=1
  printf '%s\n' "$out"
  for entry in "${planted[@]}"; do
    if ! grep -qF -- "${entry%%|*}:1:" <<<"$out"; then
      echo "self-test: the planted line of ${entry%%|*} was not found: ${entry#*|}" >&2
      failed=1
    fi
  done
  for entry in "${clean[@]}"; do
    if grep -qF -- "${entry%%|*}:" <<<"$out"; then
      echo "self-test: ${entry%%|*} was flagged, wrongly: ${entry#*|}" >&2
      failed=1
    fi
  done
  if ((failed)); then
    echo "history-check self-test: FAILED" >&2
    return 1
  fi
  echo "history-check self-test: ${#planted[@]} planted findings caught, ${#clean[@]} clean lines passed"
}

case "${1:-}" in
  --self-test) self_test ;;
  "") check "$(cd "$(dirname "$self")/.." && pwd)" ;;
  -*) echo "usage: scripts/history-check.sh [DIR | --self-test]" >&2; exit 2 ;;
  *) check "$(cd "$1" && pwd)" ;;
esac
