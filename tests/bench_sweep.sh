#!/usr/bin/env bash
# bench_sweep.sh — the shared work of kvq-sweep, measured: a 48-point KIVI grid
# (group 32,64,128,256 x residual 32,64,96,128 x bits 2,3,4; the points with
# residual % group != 0 are invalid and skipped) on the Llama-3-8B-shaped
# benchmark dump, against one kvq-analyze run per valid point.
#   bench_sweep.sh BUILD_DIR    (run by `meson test --benchmark`)
set -eu
build=$1
dump=$build/bench-llama3-8b.h5
[ -r "$dump" ] || "$build/tools/kvq-gen" --preset llama3-8b --dtype float16 -o "$dump"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
grid=(--quant kivi --grid group=32,64,128,256 --grid residual=32,64,96,128 --grid bits=2,3,4)
now() { date +%s.%N; }

t0=$(now)
"$build/tools/kvq-sweep" "$dump" "${grid[@]}" --progress never -o "$out/sweep.csv" 2>"$out/err"
t1=$(now)
grep -v '^kvq-sweep: skipping' "$out/err"
mapfile -t specs < <("$build/tools/kvq-sweep" --list-points "${grid[@]}" | awk -F'\t' '$3 == "valid" {print $2}')
for s in "${specs[@]}"; do "$build/tools/kvq-analyze" -q "$s" --format csv "$dump" >>"$out/separate.csv"; done
t2=$(now)
awk -v n="${#specs[@]}" -v a="$t0" -v b="$t1" -v c="$t2" 'BEGIN {
    sw = b - a; sep = c - b
    printf "kvq-sweep, 48 grid points (%d valid): %.1f s, %.2f s per valid point\n", n, sw, sw / n
    printf "%d separate kvq-analyze runs: %.1f s, %.2f s per point\n", n, sep, sep / n
    printf "shared work saves %.0f%% of the time (%.1fx faster)\n", 100 * (1 - sw / sep), sep / sw }'
