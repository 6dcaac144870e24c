#!/usr/bin/env bash
# test_sweep.sh — kvq-sweep end to end: grid order and point count, invalid
# points skipped, usage errors, rows equal to kvq-analyze's, SIGKILL part-way
# then --resume equal to an uninterrupted run, torn writes, shards merged
# equal to the unsharded run, --merge's checks and the Slurm example script.
#   test_sweep.sh BUILD_DIR SOURCE_DIR
set -u
build=$1
src=$2
sweep=$build/tools/kvq-sweep
analyze=$build/tools/kvq-analyze
gen=$build/tools/kvq-gen
real=$src/data/stories260K.h5
. "$src/tests/cli_lib.sh"

# check 'what' command...: one pass or fail for a shell condition
check() {
    local what=$1
    shift
    if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $what"; fi
}
# rows of a sweep file without its last N columns (the grid keys and point)
strip_cols() { sed -E "s/(,[^,]*){$2}\$//" "$1"; }

kivi=(--quant kivi --grid group=32,64 --grid residual=32,64,96 --grid bits=2,4)

# --- grid order and count: nested loops, the last --grid fastest
"$sweep" --list-points "${kivi[@]}" >"$tmp/points" 2>"$tmp/err"
check "12 points listed" [ "$(wc -l <"$tmp/points")" = 12 ]
check "point 0 first" grep -qx $'0\tkivi:bits=2,group=32,residual=32\tvalid' "$tmp/points"
check "last key varies fastest" grep -qx $'1\tkivi:bits=4,group=32,residual=32\tvalid' "$tmp/points"
check "first key slowest" grep -qx $'11\t-\tinvalid: kivi:bits=4,group=64,residual=96: residual=96 must be a multiple of group=64' "$tmp/points"
check "4 invalid points" [ "$(grep -c invalid "$tmp/points")" = 4 ]
"$sweep" --list-points --quant kivi --grid bits=2,3 --fixed group=32,residual=64 --shard 1/2 >"$tmp/points"
check "--shard 1/2 lists point 1 only" [ "$(cut -f1 "$tmp/points" | tr '\n' ' ')" = "1 " ]

# --- usage errors: exit 2, one line
expect 2 "--grid foo=1,2: kivi: unknown key 'foo' (keys: bits, group, residual" -- "$sweep" "$real" --quant kivi --grid foo=1,2 -o "$tmp/x.csv"
expect 2 "--grid bits=2,x: kivi: bits=x: expected an integer" -- "$sweep" "$real" --quant kivi --grid bits=2,x -o "$tmp/x.csv"
expect 2 "--grid bits=2,99: kivi: bits=99: out of range" -- "$sweep" "$real" --quant kivi --grid bits=2,99 -o "$tmp/x.csv"
# a long list is shortened in the message, which keeps its reason
expect 2 "--grid group=1,2,3,4,5," "...(1097 characters): more than 256 values" -- "$sweep" "$real" --quant kivi --grid "group=$(seq -s, 1 300)" -o "$tmp/x.csv"
expect 2 "...(116 characters): kivi: bits=17: out of range" -- "$sweep" "$real" --quant kivi --grid "bits=$(seq -s, 2 40),99" -o "$tmp/x.csv"
expect 2 "--grid bits=2,2: value '2' given twice" -- "$sweep" "$real" --quant kivi --grid bits=2,2 -o "$tmp/x.csv"
expect 2 "--grid bits=2,,3: empty value" -- "$sweep" "$real" --quant kivi --grid bits=2,,3 -o "$tmp/x.csv"
expect 2 "--grid bits=3: key 'bits' is already fixed" -- "$sweep" "$real" --quant kivi --fixed bits=2 --grid bits=3 -o "$tmp/x.csv"
expect 2 "--quant nope: unknown quantizer (known: per-token" -- "$sweep" "$real" --quant nope --grid bits=2 -o "$tmp/x.csv"
expect 2 "no -o OUT given" -- "$sweep" "$real" --quant kivi --grid bits=2
expect 2 "no --quant NAME given" -- "$sweep" "$real" --grid bits=2 -o "$tmp/x.csv"
expect 2 "--shard 3/3: expected I/N with 0 <= I < N" -- "$sweep" "$real" --quant kivi --shard 3/3 -o "$tmp/x.csv"
expect 2 "--format table: expected csv or jsonl" -- "$sweep" "$real" --quant kivi --format table -o "$tmp/x.csv"
expect 2 "cluster:centroids=4: needs a calibration dump" "give it with --calib FILE" -- "$sweep" "$real" --quant cluster --grid centroids=4,8 -o "$tmp/x.csv"
expect 2 "--expect-grid applies to --merge only" -- "$sweep" "$real" --quant kivi --expect-grid -o "$tmp/x.csv"
expect 2 "stories260K.h5: layer 7: expected 0..4" -- "$sweep" "$real" --quant kivi --layers 7 -o "$tmp/x.csv"
check "no output left by usage errors" [ ! -e "$tmp/x.csv" ]
expect 1 "missing.h5: cannot open" -- "$sweep" "$tmp/missing.h5" --quant kivi -o "$tmp/x.csv"

# --- invalid points are skipped and counted; rows equal kvq-analyze's
"$sweep" "$real" "${kivi[@]}" -o "$tmp/all.csv" 2>"$tmp/err"
check "sweep exits 0" [ $? = 0 ]
check "invalid point said" grep -q "skipping invalid point 6: kivi:bits=2,group=64,residual=32: residual=32 must be a multiple of group=64" "$tmp/err"
check "summary counts" grep -q "8 points written, 0 already complete, 4 invalid skipped (shard 0/1 of 12 grid points)" "$tmp/err"
check "one line per point without a terminal" [ "$(grep -c '^kvq-sweep: \[[0-9]*/8\] point' "$tmp/err")" = 8 ]
check "header: analyze columns + grid keys + point" \
    grep -qx "$("$analyze" -q kivi --format csv "$real" | head -1),group,residual,bits,point" <(head -1 "$tmp/all.csv")
check "8 points x 5 layers" [ "$(tail -n +2 "$tmp/all.csv" | wc -l)" = 40 ]
ok=1
while IFS=$'\t' read -r p spec status; do
    [ "$status" = valid ] || continue
    "$analyze" -q "$spec" --format csv "$real" | tail -n +2 >"$tmp/an.csv"
    awk -F, -v p="$p" '$NF == p' "$tmp/all.csv" >"$tmp/pt.csv"
    strip_cols "$tmp/pt.csv" 4 | cmp -s - "$tmp/an.csv" || { ok=0; echo "  point $p ($spec) differs from kvq-analyze"; }
done < <("$sweep" --list-points "${kivi[@]}")
check "every point's rows equal kvq-analyze -q SPEC" [ $ok = 1 ]
# --per head, --layers, --queries, --seed pass through the same way
"$sweep" "$real" --quant per-token --grid bits=2,3 --fixed span=layer --per head --layers 1,3 --queries random:9 --seed 5 \
    --progress never -o "$tmp/ph.csv" 2>/dev/null
"$analyze" -q per-token:bits=3,span=layer --per head --layers 1,3 --queries random:9 --seed 5 --format csv "$real" | tail -n +2 >"$tmp/an.csv"
check "options pass through (--per head --layers --queries --seed)" cmp -s <(awk -F, '$NF == 1' "$tmp/ph.csv" | strip_cols /dev/stdin 2) "$tmp/an.csv"

# one KV head on four threads: the points run four at a time (kvq_sweep_batch), the same bytes and a line per point
"$sweep" "$real" "${kivi[@]}" --heads 0 --threads 4 -o "$tmp/h4.csv" 2>"$tmp/err"
check "batched sweep: a line per point" [ "$(grep -c '^kvq-sweep: \[[0-9]*/8\] point' "$tmp/err")" = 8 ]
"$sweep" "$real" "${kivi[@]}" --heads 0 --threads 1 --progress never -o "$tmp/h1.csv" 2>/dev/null
check "points run four at a time equal one at a time" cmp -s "$tmp/h4.csv" "$tmp/h1.csv"

# --- no silent overwrite; resume of a finished sweep does nothing
expect 1 "all.csv: exists; continue it with --resume" -- "$sweep" "$real" "${kivi[@]}" -o "$tmp/all.csv"
cp "$tmp/all.csv" "$tmp/again.csv"
"$sweep" "$real" "${kivi[@]}" --resume -o "$tmp/again.csv" 2>"$tmp/err"
check "resume of a complete sweep" grep -q "0 points written, 8 already complete" "$tmp/err"
check "resume of a complete sweep leaves it as it was" cmp -s "$tmp/again.csv" "$tmp/all.csv"
expect 1 "again.csv: its columns are not this sweep's" -- "$sweep" "$real" --quant kivi --grid bits=2,3 --resume -o "$tmp/again.csv"
expect 1 "again.csv: point 0 (kivi:bits=2,group=32,residual=32) is not a pending point of this sweep and shard" -- \
    "$sweep" "$real" "${kivi[@]}" --shard 1/2 --resume -o "$tmp/again.csv"

# --- torn writes: a partial last row (and a partial point) is dropped and redone
for cut in 1 100 700; do
    head -c -$cut "$tmp/all.csv" >"$tmp/torn.csv"
    "$sweep" "$real" "${kivi[@]}" --resume --progress never -o "$tmp/torn.csv" 2>"$tmp/err"
    check "torn by $cut bytes: resumed equals uninterrupted" cmp -s "$tmp/torn.csv" "$tmp/all.csv"
    check "torn by $cut bytes: said" grep -q "dropped .* bytes of an interrupted point" "$tmp/err"
done
head -c 30 "$tmp/all.csv" >"$tmp/torn.csv" # killed while writing the header
"$sweep" "$real" "${kivi[@]}" --resume --progress never -o "$tmp/torn.csv" 2>/dev/null
check "torn header: resumed equals uninterrupted" cmp -s "$tmp/torn.csv" "$tmp/all.csv"
{ cat "$tmp/all.csv"; echo "x,y"; } >"$tmp/bad.csv"
expect 1 "bad.csv: line 42: expected 29 fields like the header, got 2" -- "$sweep" "$real" "${kivi[@]}" --resume -o "$tmp/bad.csv"

# --- SIGKILL part-way, then --resume: same bytes as an uninterrupted run
"$gen" --layers 2 --heads 8 --kv-heads 4 --head-dim 64 --tokens 2048 -o "$tmp/k.h5" 2>/dev/null
kill_args=("$tmp/k.h5" --quant kivi --grid group=32,64 --grid bits=2,3,4 --fixed residual=128 --queries all --progress never)
"$sweep" "${kill_args[@]}" -o "$tmp/k-full.csv" 2>/dev/null
"$sweep" "${kill_args[@]}" -o "$tmp/k.csv" 2>/dev/null &
pid=$!
for _ in $(seq 1 600); do # until two points (2 rows each) are durable
    [ "$(wc -l 2>/dev/null <"$tmp/k.csv" || echo 0)" -ge 5 ] && break
    sleep 0.05
done
kill -9 $pid 2>/dev/null
wait $pid 2>/dev/null
lines=$(wc -l <"$tmp/k.csv")
check "killed part-way ($lines lines of 13)" [ "$lines" -ge 5 ] && [ "$lines" -lt 13 ]
"$sweep" "${kill_args[@]}" --resume -o "$tmp/k.csv" 2>"$tmp/err"
check "resumed after SIGKILL: exit 0" [ $? = 0 ]
check "resumed after SIGKILL: same rows, none lost, none duplicated" cmp -s "$tmp/k.csv" "$tmp/k-full.csv"
check "resumed after SIGKILL: skipped the complete points" grep -q "already complete" "$tmp/err"

# --- shards 0/3, 1/3, 2/3 merged equal the unsharded run
for i in 0 1 2; do "$sweep" "$real" "${kivi[@]}" --shard $i/3 --progress never -o "$tmp/s$i.csv" 2>/dev/null; done
expect 0 "merged 8 points (40 rows) from 3 files" -- "$sweep" --merge "$tmp/s2.csv" "$tmp/s0.csv" "$tmp/s1.csv" -o "$tmp/m.csv"
check "merged shards equal the unsharded run" cmp -s "$tmp/m.csv" "$tmp/all.csv"
expect 0 "the grid is complete: 8 valid points (4 invalid ones skipped by design)" -- \
    "$sweep" --merge "$tmp"/s?.csv --expect-grid "${kivi[@]}" -o "$tmp/m2.csv"
check "merged with --expect-grid equals the unsharded run" cmp -s "$tmp/m2.csv" "$tmp/all.csv"
expect 1 "2 points of the expected grid are missing: 1, 4" -- \
    "$sweep" --merge "$tmp/s0.csv" "$tmp/s2.csv" --expect-grid "${kivi[@]}" -o "$tmp/m3.csv"
expect 1 "point 0 (kivi:bits=2,group=32,residual=32) is in" "duplicated" -- "$sweep" --merge "$tmp/s0.csv" "$tmp/all.csv" -o "$tmp/m3.csv"
expect 1 "columns differ from" -- "$sweep" --merge "$tmp/s0.csv" "$tmp/ph.csv" -o "$tmp/m3.csv"
expect 1 "point 2 is 'kivi:bits=2,group=32,residual=64'; the expected grid has another spec there" -- \
    "$sweep" --merge "$tmp"/s?.csv --expect-grid --quant kivi --grid group=32,64 --grid residual=32,128,96 --grid bits=2,4 -o "$tmp/m3.csv"
# a shard's meta file that is a FIFO is refused, not read forever (issue #36)
cp "$tmp/s1.csv" "$tmp/sf.csv" && mkfifo "$tmp/sf.csv.meta.json"
expect 1 "sf.csv.meta.json: not a regular file" -- timeout 20 "$sweep" --merge "$tmp/s0.csv" "$tmp/sf.csv" "$tmp/s2.csv" -o "$tmp/m3.csv"
head -c -5 "$tmp/s1.csv" >"$tmp/s1-torn.csv"
expect 1 "s1-torn.csv: ends in a partial row: an interrupted shard" -- "$sweep" --merge "$tmp/s0.csv" "$tmp/s1-torn.csv" -o "$tmp/m3.csv"
"$analyze" -q kivi --format csv "$real" >"$tmp/not-sweep.csv" # analyze rows: no point column
expect 1 "not-sweep.csv: line 1: expected a header with 'spec' and 'point' columns" -- "$sweep" --merge "$tmp/not-sweep.csv" -o "$tmp/m3.csv"
expect 2 "add --expect-grid" -- "$sweep" --merge "$tmp/s0.csv" "${kivi[@]}" -o "$tmp/m3.csv"
check "failed merges leave no output" [ ! -e "$tmp/m3.csv" ]

# --- JSON lines: numbers stay numbers, resume works the same way
"$sweep" "$real" --quant kivi --grid group=32,64 --fixed residual=64,bits=3 --per model --progress never -o "$tmp/j.jsonl" 2>/dev/null
check "jsonl rows" grep -q '"group":64,"point":1}$' "$tmp/j.jsonl"
head -c -20 "$tmp/j.jsonl" >"$tmp/j2.jsonl"
"$sweep" "$real" --quant kivi --grid group=32,64 --fixed residual=64,bits=3 --per model --progress never --resume -o "$tmp/j2.jsonl" 2>/dev/null
check "jsonl: torn then resumed equals uninterrupted" cmp -s "$tmp/j.jsonl" "$tmp/j2.jsonl"

# --- progress: a bar when asked, nothing with never
"$sweep" "$real" --quant kivi --grid bits=2,3 --progress always -o "$tmp/p.csv" 2>"$tmp/err"
check "progress bar" grep -q $'\r''kvq-sweep \[#*\.*\] 1/2 points  0:0[0-9] elapsed  ETA' "$tmp/err"
"$sweep" "$real" --quant kivi --grid bits=2,3 --progress never -o "$tmp/p2.csv" 2>"$tmp/err"
check "--progress never: only the summary" [ "$(wc -l <"$tmp/err")" = 1 ]

# --- fp8 and tender over their own keys: a choice key in a grid
"$sweep" "$real" --quant fp8 --grid format=e4m3,e5m2 --grid scale=none,tensor,token --per model --progress never \
    -o "$tmp/fp8.csv" 2>/dev/null
check "fp8 format x scale: 6 rows" [ "$(tail -n +2 "$tmp/fp8.csv" | wc -l)" = 6 ]
check "fp8 grid: choice values in the spec and key columns" grep -q ',"fp8:format=e5m2,scale=token",.*,e5m2,token,5$' "$tmp/fp8.csv"
"$sweep" "$real" --quant tender --grid groups=1,4,8 --grid chunk=0,64 --per model --progress never -o "$tmp/tender.csv" 2>/dev/null
check "tender groups x chunk: 6 rows" [ "$(tail -n +2 "$tmp/tender.csv" | wc -l)" = 6 ]
"$analyze" -q tender:groups=4,chunk=64 --per model --format csv "$real" | tail -1 >"$tmp/t-an.csv"
grep ',"tender:groups=4,chunk=64",' "$tmp/tender.csv" | sed -E 's/(,[^,]*){3}$//' >"$tmp/t-sw.csv"
check "tender sweep row equals kvq-analyze's" cmp -s "$tmp/t-an.csv" "$tmp/t-sw.csv"

# --- the frontier families: cache types and pre-rotation as grid keys
"$gen" --layers 2 --heads 4 --kv-heads 2 --head-dim 32 --tokens 64 -o "$tmp/d32.h5" 2>/dev/null
"$sweep" "$tmp/d32.h5" --quant ggml --grid ktype=q8_0,q4_0,iq4_nl --fixed vtype=q4_1 --per model --progress never \
    -o "$tmp/ggml.csv" 2>/dev/null
check "ggml ktype grid: 3 rows" [ "$(tail -n +2 "$tmp/ggml.csv" | wc -l)" = 3 ]
"$sweep" "$tmp/d32.h5" --quant fp4 --grid format=mxfp4,nvfp4 --per model --progress never -o "$tmp/fp4.csv" 2>/dev/null
check "fp4 format grid: 4.25 and 4.5 bits" \
    [ "$(grep -c ',fp4,fp4:format=mxfp4,4.25,4.25,' "$tmp/fp4.csv")" = 1 -a "$(grep -c ',fp4,fp4:format=nvfp4,4.5,4.5,' "$tmp/fp4.csv")" = 1 ]
# llama.cpp's block rule: on head_dim 8 a ggml or fp4 sweep is a usage error
expect 2 "stories260K.h5: ggml:ktype=q4_0,vtype=q4_1: ktype=q4_0: head_dim 8 is not a multiple of the 32-value blocks" -- \
    "$sweep" "$real" --quant ggml --grid ktype=q4_0 --fixed vtype=q4_1 -o "$tmp/ggml8.csv"
"$sweep" "$real" --quant per-token --grid prerotate=none,hadamard,qr --fixed bits=3 --per model --progress never \
    -o "$tmp/rot.csv" 2>/dev/null
check "prerotate grid: 3 rows, the spec names the rotation" grep -q ',"per-token:bits=3,prerotate=qr",' "$tmp/rot.csv"

# --- tokens(SELECT; HI; LO) templates: the selector's keys as grid keys (keys written in SELECT fixed)
tq=(--quant 'tokens(snapkv:obs=16; none; kivi:bits=2)' --grid keep=0.25,0.5 --grid pool=3,5)
"$sweep" --list-points "${tq[@]}" >"$tmp/tpoints"
check "tokens template: 4 points, SELECT's keys in each spec" \
    grep -qx $'1\ttokens(snapkv:keep=0.25,obs=16,pool=5; none; kivi:bits=2)\tvalid' "$tmp/tpoints"
"$sweep" "$real" "${tq[@]}" --progress never -o "$tmp/tok.csv" 2>/dev/null
ok=$([ "$(tail -n +2 "$tmp/tok.csv" | wc -l)" = 20 ] && echo 1 || echo 0)
while IFS=$'\t' read -r p spec status; do
    "$analyze" -q "$spec" --format csv "$real" | tail -n +2 >"$tmp/an.csv"
    awk -F, -v p="$p" '$NF == p' "$tmp/tok.csv" | strip_cols /dev/stdin 3 | cmp -s - "$tmp/an.csv" ||
        { ok=0; echo "  point $p ($spec) differs from kvq-analyze"; }
done <"$tmp/tpoints"
check "every tokens point's rows equal kvq-analyze -q SPEC" [ $ok = 1 ]
"$sweep" --list-points --quant 'tokens(window; none; drop)' --grid recent=0,8 --fixed sinks=0 >"$tmp/wpoints"
check "window template: a point that keeps nothing is invalid" \
    grep -q $'^0\t-\tinvalid: tokens(window:sinks=0,recent=0; none; drop): ' "$tmp/wpoints"
expect 2 "--quant tokens(foo; none; drop): unknown selector 'foo'" -- "$sweep" "$real" --quant 'tokens(foo; none; drop)' --grid keep=0.1 -o "$tmp/x.csv"
expect 2 "--quant tokens(snapkv; none; kivi:bits=99): LO: kivi:bits=99: bits=99: out of range" -- \
    "$sweep" "$real" --quant 'tokens(snapkv; none; kivi:bits=99)' --grid keep=0.1 -o "$tmp/x.csv"
expect 2 "--grid keep=0.1: key 'keep' is already fixed" -- "$sweep" "$real" --quant 'tokens(h2o:keep=0.2; none; drop)' --grid keep=0.1 -o "$tmp/x.csv"
expect 2 "expected tokens(SELECT; HI; LO)" -- "$sweep" "$real" --quant 'tokens(h2o' --grid keep=0.1 -o "$tmp/x.csv"

# --- the Slurm example: a 3-task array then the merge, run here without Slurm
export OUTDIR=$tmp/slurm KVQ_BIN=$(dirname "$sweep")
for i in 0 1 2; do SLURM_ARRAY_TASK_ID=$i SLURM_ARRAY_TASK_COUNT=3 bash "$src/tools/kvq-shards.slurm" kvq-sweep "$real" "${kivi[@]}" 2>/dev/null; done
bash "$src/tools/kvq-shards.slurm" merge kvq-sweep "$real" "${kivi[@]}" 2>"$tmp/err"
check "Slurm example: merged array equals the unsharded run" cmp -s "$tmp/slurm/sweep.csv" "$tmp/all.csv"

# shards carry the run's fingerprint (OUT.meta.json): a shard of other dumps is refused by --merge and
# by --resume, naming the file
calib=$src/data/stories260K-calib.h5
for i in 0 1; do "$sweep" "$real" "${kivi[@]}" --shard $i/2 --progress never -o "$tmp/fp$i.csv" 2>/dev/null; done
"$sweep" "$calib" "${kivi[@]}" --shard 1/2 --progress never -o "$tmp/fpx1.csv" 2>/dev/null
expect 1 "fpx1.csv: of another run than" "not shards of one sweep" -- "$sweep" --merge "$tmp/fp0.csv" "$tmp/fpx1.csv" -o "$tmp/fpm.csv"
expect 0 "merged" -- "$sweep" --merge "$tmp/fp0.csv" "$tmp/fp1.csv" --expect-grid "${kivi[@]}" -o "$tmp/fpm.csv"
expect 1 "fpx1.csv: written by another run (fingerprint" -- "$sweep" "$real" "${kivi[@]}" --shard 1/2 --resume -o "$tmp/fpx1.csv"

# one run at a time on an OUT (its lock): a second --resume exits 1 at once instead of
# tearing the file; a FIFO as OUT is refused, not waited on
"$gen" --layers 4 --heads 8 --kv-heads 4 --head-dim 64 --tokens 4096 -o "$tmp/lock.h5" 2>/dev/null
"$sweep" "$tmp/lock.h5" --quant gear --grid bits=2,3,4 --grid rank=1,2,4,8 --grid sparsity=0,0.01 --progress never \
    -o "$tmp/lock.csv" 2>"$tmp/first.err" &
first=$!
for _ in $(seq 50); do [ -s "$tmp/lock.csv" ] && break; sleep 0.1; done
"$sweep" "$tmp/lock.h5" --quant gear --grid bits=2,3,4 --grid rank=1,2,4,8 --grid sparsity=0,0.01 --resume \
    -o "$tmp/lock.csv" >/dev/null 2>"$tmp/lock.err"
rc=$?
kill -TERM $first 2>/dev/null
wait $first 2>/dev/null
first_rc=$?
check "second run on a locked OUT: exit 1, says so" [ $rc = 1 ]
# the interrupted run says what OUT keeps and how to go on (docs/tools.md)
check "SIGTERM: exit 143" [ $first_rc = 143 ]
check "SIGTERM: says what was kept" grep -Eq "kvq-sweep: interrupted: .*lock.csv keeps [0-9]+ of 24 points complete; the same command with --resume continues" "$tmp/first.err"
check "the lock message" grep -q "another kvq-sweep run is writing it" "$tmp/lock.err"
mkfifo "$tmp/fifo.csv"
timeout 20 "$sweep" "$tmp/lock.h5" --quant kivi --grid bits=2,4 --resume -o "$tmp/fifo.csv" >/dev/null 2>"$tmp/fifo.err"
rc=$?
check "a FIFO as OUT: refused at once (exit 1, not a timeout)" [ $rc = 1 ]
check "the FIFO message" grep -q "not a regular file" "$tmp/fifo.err"
echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
