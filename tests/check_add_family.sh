#!/bin/bash
# check_add_family.sh — the proof that a quantizer family is one file and one
# table line (docs/adding-a-quantizer.md): in a copy of the source tree it adds
# lib/quant/absmax_copy.c (absmax under the name absmax-copy) and its line in
# lib/quant/families.def, checks that exactly those two files changed, then
# builds the copy and runs its test suites, which find the new family through
# the registry (--list-quantizers, the default set, test_registry,
# test_python, the sweeps).  Takes the build's time plus the suites' (about
# 10 minutes on 2 cores for all of them); `meson test add-family` (suite
# house, run by CI) runs it with the unit suites, under a minute idle.
# With --default first, the copy stays in the default set: adding a family to
# kvq-analyze's default set is the same one file and one line (the unit suites
# pass; only the documented default output, which the examples test compares,
# would change, as docs/adding-a-quantizer.md says).
#   tests/check_add_family.sh [--default] [MESON TEST ARGS...]   e.g. --suite unit --suite cli
set -euo pipefail
in_default=0
[ "${1:-}" = --default ] && { in_default=1; shift; }
src=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvq-add-family.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
say() { printf 'check_add_family: %s\n' "$*" >&2; }

# the tree as git sees it (tracked and untracked, not ignored), beside ../shared as the tests expect
mkdir "$tmp/kvq"
(cd "$src" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - 2>/dev/null) | tar -xf - -C "$tmp/kvq"
[ -e "$src/../shared" ] && ln -s "$(cd "$src/../shared" && pwd)" "$tmp/shared"
cd "$tmp/kvq"
git init -q && git add -A && git -c user.name=check -c user.email=check@localhost commit -qm base

# the new family: its file and its line, nothing else
# (out of the default set: a family in it also changes the default output the README
# shows, which the examples test compares: documentation, as docs/adding-a-quantizer.md says)
sed -e 's/kvq_q_absmax\b/kvq_q_absmax_copy/' -e 's/\.name = "absmax"/.name = "absmax-copy"/' \
    -e "s/\\.in_default_set = 1/.in_default_set = $in_default/" \
    -e 's/^\(\/\* \)absmax\.c —/\1absmax_copy.c — a copy of absmax.c under a new name (tests\/check_add_family.sh):/' \
    lib/quant/absmax.c >lib/quant/absmax_copy.c
grep -q 'kvq_q_absmax_copy = {' lib/quant/absmax_copy.c && grep -q '"absmax-copy"' lib/quant/absmax_copy.c
echo 'KVQ_FAMILY(kvq_q_absmax_copy, "absmax_copy.c")' >>lib/quant/families.def
git add -A
changed=$(git diff --cached --name-only | sort | tr '\n' ' ')
if [ "$changed" != "lib/quant/absmax_copy.c lib/quant/families.def " ]; then
    say "FAIL: expected exactly the family's file and the table changed, got: $changed"
    exit 1
fi
say "added absmax-copy: $changed"

say "configuring and building the copy"
meson setup -Dtests=enabled -Dcuda=disabled "$tmp/build" >"$tmp/setup.log" 2>&1 || { cat "$tmp/setup.log"; exit 1; }
ninja -C "$tmp/build" >"$tmp/ninja.log" 2>&1 || { tail -40 "$tmp/ninja.log"; exit 1; }
# into a file: grep -q would close the pipe at its match, and the tool rightly fails on a write that
# cannot be made (pipefail then fails the check although the family is listed)
"$tmp/build/tools/kvq-analyze" --list-quantizers >"$tmp/list.txt"
grep -q '^absmax-copy ' "$tmp/list.txt" || { say "FAIL: absmax-copy not listed"; exit 1; }
if [ $in_default = 1 ]; then # the default set runs it: one row per layer of the bundled dump
    "$tmp/build/tools/kvq-analyze" --format csv "$tmp/kvq/data/stories260K.h5" >"$tmp/default.csv"
    grep -q ',absmax-copy,' "$tmp/default.csv" || { say "FAIL: absmax-copy not in the default set's rows"; exit 1; }
fi
say "running the suites ($*)"
meson test -C "$tmp/build" --print-errorlogs "$@"
say "OK: a family added with one file and one table line passes"
