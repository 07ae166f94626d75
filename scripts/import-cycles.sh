#!/usr/bin/env bash
# Fails when the modules of one crate import each other in a circle.
#
# The rule, per workspace crate (the members of Cargo.toml):
#   * A node is a top-level module of the crate: src/x.rs, or the folder src/x/ (its mod.rs and every
#     file under it). src/lib.rs and src/main.rs are the crate's root; src/bin/ holds other crates'
#     roots and is not read.
#   * An edge x -> y is a path `crate::y...` written in a file of x: in a `use`, in a group such as
#     `use crate::{y, z::w}`, or inline (`crate::y::f()`). A name the root re-exports counts for the
#     module it comes from: `pub use y::{A, B}` in the root, or `pub use y::*` when y's own file
#     declares `pub ... A` at its top level.
#   * Not edges: the root declaring or using its modules, and a module using items defined in the
#     root itself (the root is every module's parent, so these are tree edges); `self::` and
#     `super::` paths (they stay inside one top-level module, or name the root's own items);
#     anything in a comment, so doc links do not count.
#   * Not looked for: circles among the files of one folder module (src/x/a.rs and src/x/b.rs), and
#     names a module re-exports from its own sub-modules.
# A circle of edges (x -> y -> x, or longer) fails the check: `tsort` finds it, and the script prints
# the modules in the circle and every import between them, as `path:line`.
#
#   scripts/import-cycles.sh              check the workspace this script is in; exits 1 on a circle
#   scripts/import-cycles.sh DIR          check the workspace at DIR
#   scripts/import-cycles.sh --edges      print every edge, as "crate: from -> to  path:line"
#   scripts/import-cycles.sh --self-test  plant a circle (one edge of each kind) in a scratch
#                                         workspace, check it is caught, then that it passes
#                                         once one edge is gone
set -euo pipefail

self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
mode=check
case ${1:-} in
  --edges) mode=edges; shift ;;
  --self-test)
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    mkdir -p "$tmp/a/src/y" "$tmp/b/src"
    printf '[workspace]\nmembers = ["a", "b"]\n' >"$tmp/Cargo.toml"
    printf 'mod x;\nmod y;\nmod z;\npub use x::*;\n' >"$tmp/a/src/lib.rs"
    printf 'pub const H: u8 = 1;\n// crate::z::k is only a comment\npub fn g() { crate::y::f() }\n' >"$tmp/a/src/x.rs"
    printf 'use crate::{\n    z::k,\n};\npub fn f() { k() }\n' >"$tmp/a/src/y/mod.rs"
    printf 'pub fn k() -> u8 { crate::H }\n' >"$tmp/a/src/z.rs"
    printf 'mod p;\nmod q;\n' >"$tmp/b/src/main.rs"
    printf 'use crate::q::r;\n' >"$tmp/b/src/p.rs"
    printf 'pub fn r() {}\n' >"$tmp/b/src/q.rs"
    out=$("$self" "$tmp" 2>&1) && { echo "import-cycles self-test: the circle x -> y -> z -> x was not caught" >&2; exit 1; }
    want="import-cycles: a: modules import each other in a circle: x y z
  x -> y  a/src/x.rs:3
  y -> z  a/src/y/mod.rs:1
  z -> x  a/src/z.rs:1"
    [[ "$out" == "$want" ]] || { printf 'import-cycles self-test: expected\n%s\ngot\n%s\n' "$want" "$out" >&2; exit 1; }
    sed -i 's/crate::H/1/' "$tmp/a/src/z.rs"
    out=$("$self" "$tmp" 2>&1) || { printf 'import-cycles self-test: no circle left, yet\n%s\n' "$out" >&2; exit 1; }
    echo "import-cycles self-test: the planted circle was caught, and its absence passed"
    exit 0
    ;;
esac
cd "${1:-$(dirname "$self")/..}"

members=$(sed -n 's/^members *= *\[\(.*\)\]/\1/p' Cargo.toml | tr -d '",')
[[ -n "$members" ]] || { echo "import-cycles: no workspace members in Cargo.toml" >&2; exit 2; }

# Prints "from to path:line" for each edge of the crate whose src/ is $1.
edges_of() {
  local src=$1 f name mods=() roots=() files=()
  for f in "$src"/*.rs "$src"/*/; do
    [[ -e "$f" ]] || continue
    name=$(basename "$f" .rs)
    case $name in lib | main | bin) continue ;; esac
    mods+=("$name")
  done
  for f in "$src"/lib.rs "$src"/main.rs; do [[ -f "$f" ]] && roots+=("$f"); done
  mapfile -t files < <(find "$src" -name '*.rs' ! -path "$src/lib.rs" ! -path "$src/main.rs" ! -path "$src/bin/*" | sort)
  ((${#files[@]} > 0)) || return 0
  awk -v src="$src" -v mods="${mods[*]}" '
    BEGIN { n = split(mods, m, " "); for (i = 1; i <= n; i++) ismod[m[i]] = 1 }
    # The line without its // comment (a "//" right after ":" is a URL, not a comment).
    function code(line,   p, q) {
      q = 0
      while ((p = index(substr(line, q + 1), "//")) > 0) {
        p += q
        if (p == 1 || substr(line, p - 1, 1) != ":") return substr(line, 1, p - 1)
        q = p + 1
      }
      return line
    }
    FNR == 1 { file = FILENAME; rel = substr(file, length(src) + 2); owner = rel; sub(/[\/.].*/, "", owner); order[++nfiles] = file }
    { line = code($0) }
    role == "root" && match(line, /^[ \t]*pub(\([a-z]+\))?[ \t]+use[ \t]+/) {
      rest = substr(line, RSTART + RLENGTH); sub(/^(crate|self)::/, "", rest)
      if (!match(rest, /^[A-Za-z_][A-Za-z0-9_]*::/)) next
      from = substr(rest, 1, RLENGTH - 2); rest = substr(rest, RLENGTH + 1)
      if (!ismod[from]) next
      if (rest ~ /^\*/) { glob[from] = 1; next }
      while (match(rest, /[A-Za-z_][A-Za-z0-9_]*/)) { reexport[substr(rest, RSTART, RLENGTH)] = from; rest = substr(rest, RSTART + RLENGTH) }
      next
    }
    role == "root" { next }
    (rel == owner ".rs" || rel == owner "/mod.rs") && match(line, /^pub(\([a-z]+\))? +((async|unsafe|extern "C") +)*(fn|struct|enum|trait|type|const|static|union|mod) +[A-Za-z_][A-Za-z0-9_]*/) {
      decl = substr(line, RSTART, RLENGTH); sub(/.* /, "", decl); declared[decl] = declared[decl] " " owner
    }
    { text[file] = text[file] line "\n"; ownerof[file] = owner; relof[file] = rel }
    # The module a name after `crate::` stands for, or "" when it is none (an item of the root).
    function target(name,   k, c, i, hit) {
      if (ismod[name]) return name
      if (name in reexport) return reexport[name]
      hit = ""; k = split(declared[name], c, " ")
      for (i = 1; i <= k; i++) if (glob[c[i]]) hit = c[i]
      return hit
    }
    function emit(f, name, at,   t, before) {
      t = target(name)
      if (t == "" || t == ownerof[f]) return
      before = substr(text[f], 1, at); gsub(/[^\n]/, "", before)
      print ownerof[f], t, relof[f] ":" (length(before) + 1)
    }
    END {
      for (j = 1; j <= nfiles; j++) {
        f = order[j]; if (!(f in text)) continue
        s = text[f]; base = 0
        while (match(s, /(^|[^A-Za-z0-9_$])crate[ \t\n]*::[ \t\n]*/)) {
          at = base + RSTART; s = substr(s, RSTART + RLENGTH); base += RSTART + RLENGTH - 1
          if (substr(s, 1, 1) != "{") {
            if (match(s, /^[A-Za-z_][A-Za-z0-9_]*/)) emit(f, substr(s, 1, RLENGTH), at)
            continue
          }
          # A group: the first name of each item at depth 1.
          depth = 0; want = 0
          for (i = 1; i <= length(s); i++) {
            ch = substr(s, i, 1)
            if (ch == "{") { depth++; if (depth == 1) want = 1; continue }
            if (ch == "}") { depth--; if (depth == 0) break; continue }
            if (ch == "," && depth == 1) { want = 1; continue }
            if (want && depth == 1 && match(substr(s, i), /^[A-Za-z_][A-Za-z0-9_]*/)) { emit(f, substr(s, i, RLENGTH), at); want = 0; i += RLENGTH - 1 }
          }
        }
      }
    }
  ' role=root "${roots[@]}" role=mod "${files[@]}"
}

status=0
for crate in $members; do
  [[ -d "$crate/src" ]] || continue
  edges=$(edges_of "$crate/src")
  [[ -n "$edges" ]] || continue
  if [[ $mode == edges ]]; then
    awk -v crate="$crate" '{ printf "%s: %s -> %s  %s/src/%s\n", crate, $1, $2, crate, $3 }' <<<"$edges"
    continue
  fi
  loops=$(awk '{ print $1, $2 }' <<<"$edges" | sort -u | tsort 2>&1 >/dev/null) && continue
  status=1
  # tsort reports each circle as "input contains a loop:" and then its members, one a line.
  while read -r -a circle; do
    echo "import-cycles: $crate: modules import each other in a circle: ${circle[*]}"
    awk -v set=" ${circle[*]} " 'index(set, " " $1 " ") && index(set, " " $2 " ") { printf "  %s -> %s  %s/src/%s\n", $1, $2, crate, $3 }' crate="$crate" <<<"$edges" | sort -u -V
  done < <(awk '/input contains a loop/ { if (c != "") print c; c = ""; next } { sub(/^tsort: /, ""); c = c (c == "" ? "" : " ") $0 } END { if (c != "") print c }' <<<"$loops")
done
[[ $mode == edges ]] && exit 0
((status == 0)) && echo "import-cycles: no module imports itself through others ($members)"
exit "$status"
