#!/usr/bin/env bash
# test_model_cli.sh — kvq-dump and kvq-eval on good and bad input: exit
# codes (0 ok, 1 bad input, 2 usage), one line on stderr, atomic outputs, the
# eval columns and row counts; with ../shared/data/model present, the
# bundled model end to end.
#   test_model_cli.sh BUILD_DIR SOURCE_DIR
set -u
build=$1
src=$2
dump=$build/tools/kvq-dump
eval=$build/tools/kvq-eval
analyze=$build/tools/kvq-analyze
. "$src/tests/cli_lib.sh"

"$build/tests/make-models" "$tmp" || { echo "make-models failed"; exit 1; }
tiny=$tmp/tiny.gguf
qwen=$tmp/qwen2.gguf
echo "the cat at the inn. a cat." >"$tmp/text.txt"
: >"$tmp/empty.txt"
echo "1 5 9 30 12 7 7 2" >"$tmp/ids.txt"
echo "1 5 999" >"$tmp/bad-ids.txt"
echo "1 five" >"$tmp/word-ids.txt"
echo "not a model at all, just text" >"$tmp/garbage.gguf"
head -c 3000 "$tiny" >"$tmp/truncated.gguf"

# --- good runs
expect 0 -- "$dump" "$tiny" --text "$tmp/text.txt" -o "$tmp/tiny.h5"
expect 0 "kvq-dump/1" -- "$build/tools/kvq-info" "$tmp/tiny.h5"
expect 0 "tiny.h5,2,all,kivi" -- "$analyze" --format csv -q kivi:group=8,residual=8 "$tmp/tiny.h5"
expect 0 -- "$dump" "$qwen" --tokens "$tmp/ids.txt" --layers 1 -o "$tmp/qwen.h5"
expect 0 "model,tokens,quantizer,spec,policy,layer,k_bits,v_bits,nll_ref,nll,dnll,ppl_ratio,kl,top1" -- \
    "$eval" "$tiny" --text "$tmp/text.txt" -q none -q kivi:bits=2,group=8,residual=8 --policy prefill,decode --format csv
# -q none: dnll 0, kl 0, top1 1, 16 bits; one row per policy
"$eval" "$tiny" --text "$tmp/text.txt" -q none -q per-token:bits=3 --policy prefill,decode --format csv >"$tmp/e.csv" 2>/dev/null
awk -F, 'NR > 1 && $3 == "none" && $11 == 0 && $13 == 0 && $14 == 1 && $7 == 16 {n++} END {exit n != 2}' "$tmp/e.csv" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: -q none rows"; cat "$tmp/e.csv"; }
awk -F, 'NR > 1 && $3 == "per-token" {d[$5] = $10} END {x = d["prefill"] - d["decode"]; exit !(x < 1e-5 && x > -1e-5 && d["prefill"] > 0)}' "$tmp/e.csv" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: per-token prefill and decode differ"; cat "$tmp/e.csv"; }
# streamed tokenization: a 24 MB text with --max-tokens 8 reads only its start; NUL bytes
# (/dev/zero) are refused at the first block instead of being read until memory runs out
yes "the cat at the inn. a cat." | head -c 24000000 >"$tmp/big.txt"
expect 0 "8 tokens" -- "$eval" "$tiny" --text "$tmp/big.txt" --max-tokens 8 -q none --format table
expect 1 "not a text file (a NUL byte at offset 0)" -- timeout 60 "$eval" "$tiny" --text /dev/zero -q none
rm -f "$tmp/big.txt"
# reading stays bounded by what the tokens need (issue #36): a 40 MB line of words with
# --max-tokens 16 (before: read whole, 39 s and 1.55 GB); 70 MB without any place to cut
# is refused after 64 MB; ids from /dev/zero or /dev/urandom are refused at the first block;
# --chunk 8 --chunks 1 reads 8 tokens of a FIFO that never ends
yes "the cat sat at the inn a cat" | tr '\n' ' ' | head -c 40000000 >"$tmp/line.txt"
expect 0 "16 tokens" -- timeout 20 "$eval" "$tiny" --text "$tmp/line.txt" --max-tokens 16 -q none --format table
head -c 70000000 /dev/zero | tr '\0' 'a' >"$tmp/nocut.txt"
expect 1 "nocut.txt: 64 MB from byte 0 hold no place where tokens can be cut" -- timeout 60 "$eval" "$tiny" --text "$tmp/nocut.txt" -q none
rm -f "$tmp/line.txt" "$tmp/nocut.txt"
expect 1 "/dev/zero: not a text file (a NUL byte at offset 0)" -- timeout 20 "$eval" "$tiny" --tokens /dev/zero -q none
expect 1 "/dev/urandom: not a text file (a NUL byte" -- timeout 20 "$dump" "$tiny" --tokens /dev/urandom -o "$tmp/x.h5"
mkfifo "$tmp/endless.fifo"
(yes "the cat at the inn. a cat." >"$tmp/endless.fifo" 2>/dev/null &)
expect 0 "positions" -- timeout 20 "$eval" "$tiny" --text "$tmp/endless.fifo" --chunk 8 --chunks 1 -q none --format csv
(yes "1 5 9" >"$tmp/endless.fifo" 2>/dev/null &)
expect 0 "positions" -- timeout 20 "$eval" "$tiny" --tokens "$tmp/endless.fifo" --chunk 8 --chunks 2 -q none --format csv
# --chunk: corpus windows, the positions and dnll_se columns; bad window options
printf '%s ' 1 $(seq 5 40) >"$tmp/ids40.txt"
expect 0 "positions,dnll_se" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q per-token:bits=2 --chunk 16 --format csv
"$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none -q per-token:bits=2 --chunk 16 --format csv >"$tmp/ch.csv" 2>/dev/null
awk -F, 'NR > 1 && $2 == 32 && $15 == 14 {n++} NR > 1 && $3 == "none" && $16 == 0 {z++} NR > 1 && $3 == "per-token" && $16 > 0 {p++}
         END {exit !(n == 2 && z == 1 && p == 1)}' "$tmp/ch.csv" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: --chunk 16 rows (32 tokens, 14 positions, dnll_se)"; cat "$tmp/ch.csv"; }
expect 2 "--chunks needs --chunk" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --chunks 2
expect 2 "--chunk 3" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --chunk 3
expect 1 "fewer than one window" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --chunk 48
# --shard (docs/models.md#shards): three shards of the 4 windows of --chunk 8, merged, are the
# unsharded run byte for byte (any order of the shard files); --resume after a torn window
# continues to the same file; what --merge refuses
sq=(-q none -q per-token:bits=2 -q kivi:bits=2,group=4,residual=4 --policy prefill,decode --chunk 8 --progress never)
"$eval" "$tiny" --tokens "$tmp/ids40.txt" "${sq[@]}" -o "$tmp/un.csv" 2>/dev/null
for i in 0 1 2; do expect 0 "shard $i/3 complete" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" "${sq[@]}" --shard $i/3 -o "$tmp/sh$i.csv"; done
expect 0 "merged 4 windows of 6 configurations from 3 shards" -- "$eval" --merge "$tmp/sh2.csv" "$tmp/sh0.csv" "$tmp/sh1.csv" -o "$tmp/merged.csv"
cmp -s "$tmp/un.csv" "$tmp/merged.csv" && [ -s "$tmp/un.csv" ] \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: merged shards differ from the unsharded run"; diff "$tmp/un.csv" "$tmp/merged.csv" | head; }
cp "$tmp/sh2.csv" "$tmp/whole2.csv"
head -c $(($(head -n 7 "$tmp/sh2.csv" | wc -c) + 30)) "$tmp/whole2.csv" >"$tmp/sh2.csv" # window 2 and part of 3
expect 1 "sh2.csv: exists; continue its windows with --resume" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" "${sq[@]}" --shard 2/3 -o "$tmp/sh2.csv"
expect 1 "ends in an unfinished row" -- "$eval" --merge "$tmp/sh0.csv" "$tmp/sh1.csv" "$tmp/sh2.csv" -o "$tmp/m2.csv"
expect 0 "resuming: 1 of this shard's 2 windows" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" "${sq[@]}" --shard 2/3 --resume -o "$tmp/sh2.csv"
cmp -s "$tmp/sh2.csv" "$tmp/whole2.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a resumed shard differs"; }
expect 1 "line 4 is not window 3 of this run's shard" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --policy prefill,decode --chunk 8 --shard 2/3 --resume -o "$tmp/sh2.csv"
expect 1 "sh2.csv: line 2: of another run (fingerprint" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --chunk 8 --shard 2/3 --resume -o "$tmp/sh2.csv"
expect 1 "windows 2..3 of 4 are in no shard" -- "$eval" --merge "$tmp/sh0.csv" "$tmp/sh1.csv" -o "$tmp/m2.csv"
expect 1 "shard 2/3 is in" "duplicated" -- "$eval" --merge "$tmp/sh0.csv" "$tmp/sh1.csv" "$tmp/sh2.csv" "$tmp/whole2.csv" -o "$tmp/m2.csv"
expect 1 "un.csv: not a kvq-eval shard" -- "$eval" --merge "$tmp/un.csv" -o "$tmp/m2.csv"
"$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --chunk 8 --shard 1/3 --progress never -o "$tmp/other1.csv" 2>/dev/null
expect 1 "not shards of one run" -- "$eval" --merge "$tmp/sh0.csv" "$tmp/other1.csv" "$tmp/sh2.csv" -o "$tmp/m2.csv"
[ ! -e "$tmp/m2.csv" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a refused merge left a file"; }
expect 2 "--shard 1/3: needs --chunk N and -o OUT" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --shard 1/3 -o "$tmp/x.csv"
expect 2 "--shard 3/3: expected I/N" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --chunk 8 --shard 3/3 -o "$tmp/x.csv"
expect 2 "a shard is written as CSV" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --chunk 8 --shard 0/2 --format jsonl -o "$tmp/x.csv"
expect 2 "--resume continues a shard" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --chunk 8 --resume -o "$tmp/x.csv"
expect 2 "--merge pools finished shards" -- "$eval" --merge --chunk 8 "$tmp/sh0.csv"
# more shards than windows: empty shards anywhere in the list (first included) merge as one run
for i in 0 1 2 3 4 5 6; do "$eval" "$tiny" --tokens "$tmp/ids40.txt" "${sq[@]}" --shard $i/7 -o "$tmp/e7-$i.csv" 2>/dev/null; done
[ "$(wc -l <"$tmp/e7-0.csv")" = 1 ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: shard 0/7 of 4 windows is not empty"; }
expect 0 "merged 4 windows of 6 configurations from 7 shards" -- "$eval" --merge "$tmp"/e7-{0,1,2,3,4,5,6}.csv -o "$tmp/m7.csv"
cmp -s "$tmp/un.csv" "$tmp/m7.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: 7 shards (3 empty) merged differ from one run"; }
# what cannot come from one run: another text, another shard count, tampered sums, a shard twice
printf '%s ' 1 $(seq 6 41) >"$tmp/ids40b.txt"
"$eval" "$tiny" --tokens "$tmp/ids40b.txt" "${sq[@]}" --shard 1/3 -o "$tmp/b1.csv" 2>/dev/null
expect 1 "b1.csv: line 2: of another run than" -- "$eval" --merge "$tmp/sh0.csv" "$tmp/b1.csv" "$tmp/sh2.csv" -o "$tmp/m2.csv"
cp "$tmp/b1.csv" "$tmp/b1r.csv"
expect 1 "b1r.csv: line 2: of another run (fingerprint" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" "${sq[@]}" --shard 1/3 --resume -o "$tmp/b1r.csv"
cp "$tmp/sh1.csv" "$tmp/s1r.csv"
expect 1 "s1r.csv: line 2: a row of shard 1/3, this run is shard 0/3" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" "${sq[@]}" --shard 0/3 --resume -o "$tmp/s1r.csv"
expect 1 "e7-3.csv: line 2: shard 3/7 of a run in 7 shards" "has 3" -- "$eval" --merge "$tmp/sh0.csv" "$tmp/e7-3.csv" -o "$tmp/m2.csv"
cp "$tmp/sh1.csv" "$tmp/sh1copy.csv"
expect 1 "shard 1/3 is in" "duplicated" -- "$eval" --merge "$tmp/sh0.csv" "$tmp/sh1.csv" "$tmp/sh1copy.csv" "$tmp/sh2.csv" -o "$tmp/m2.csv"
# column 24 is kl_sum, 25 top1_sum, 29 d_n (a shard's columns: run and shard at 18 and 19)
for edit in '24=-1e300:negative KL' '25=1e308:top1_sum is not a count' '29=-5:d_n is not a count' '23=nan:expected a finite number' '32=-1:a negative cache_tokens_sum'; do
    col=${edit%%=*} rest=${edit#*=}; val=${rest%%:*} why=${rest#*:}
    awk -F, -v OFS=, -v c="$col" -v v="$val" 'NR == 3 {$c = v} {print}' "$tmp/sh1.csv" >"$tmp/tamper.csv"
    expect 1 "tamper.csv: line 3:" "$why" -- "$eval" --merge "$tmp/sh0.csv" "$tmp/tamper.csv" "$tmp/sh2.csv" -o "$tmp/m2.csv"
done
# a shard's meta file with a run that is not JSON is refused, not copied into the merged record
mkdir -p "$tmp/bm" && cp "$tmp/sh0.csv" "$tmp/sh0.csv.meta.json" "$tmp/bm/"
sed -i '1a {"tool": "kvq-eval", "broken' "$tmp/bm/sh0.csv.meta.json"
expect 1 "sh0.csv.meta.json: line 2: a run that is not JSON" -- "$eval" --merge "$tmp/bm/sh0.csv" "$tmp/sh1.csv" "$tmp/sh2.csv" -o "$tmp/m2.csv"
[ ! -e "$tmp/m2.csv" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a refused merge left a file"; }
# a text read from a FIFO: recorded without size and SHA-256, with a note saying why
mkfifo "$tmp/text.fifo"
(cat "$tmp/text.txt" >"$tmp/text.fifo" &)
expect 0 "text.fifo is not a regular file: its record has no size or SHA-256" -- "$eval" "$tiny" --text "$tmp/text.fifo" -q none -o "$tmp/fifo.csv"
grep -q '"size": null, "note": "not a regular file (a FIFO)' "$tmp/fifo.csv.meta.json" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a FIFO's record"; }
# the Slurm array script runs the same shards and merge (as tasks 0..2 of an array of 3; the
# suite slurm submits it to a real Slurm); a rerun with another task count in the same OUTDIR
# is refused, as is a merge over shards of two counts
export OUTDIR=$tmp/slurm KVQ_BIN=$build/tools
sargs=(kvq-eval "$tiny" --tokens "$tmp/ids40.txt" "${sq[@]}")
for i in 0 1 2; do SLURM_ARRAY_TASK_ID=$i SLURM_ARRAY_TASK_COUNT=3 bash "$src/tools/kvq-shards.slurm" "${sargs[@]}" 2>/dev/null; done
bash "$src/tools/kvq-shards.slurm" merge kvq-eval 2>/dev/null
cmp -s "$tmp/slurm/eval.csv" "$tmp/un.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-shards.slurm (kvq-eval) differs from one run"; }
SLURM_ARRAY_TASK_ID=0 SLURM_ARRAY_TASK_COUNT=3 expect 0 "shard 0/3 complete" -- bash "$src/tools/kvq-shards.slurm" "${sargs[@]}"
SLURM_ARRAY_TASK_ID=1 SLURM_ARRAY_TASK_COUNT=2 expect 1 "a shard of a run in 3 tasks; this array has 2" -- bash "$src/tools/kvq-shards.slurm" "${sargs[@]}"
cp "$tmp/slurm/shard-0-of-3.csv" "$tmp/slurm/shard-0-of-2.csv"
expect 1 "shards of runs in 2 and 3 tasks" -- bash "$src/tools/kvq-shards.slurm" merge kvq-eval
expect 2 "expected [merge] kvq-eval|kvq-alloc|kvq-sweep" -- bash "$src/tools/kvq-shards.slurm" kvq-dump
unset OUTDIR KVQ_BIN
flock "$tmp/sh0.csv" sleep 3 &
sleep 0.5
expect 1 "another kvq-eval run is writing it" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" "${sq[@]}" --shard 0/3 --resume -o "$tmp/sh0.csv"
wait
# none in a mix keeps those layers exact: mix(0-=none) is the exact cache (dnll exactly 0), and
# mix(0=none;1=per-token:bits=2) on the 2-layer project model equals per-token's layer-1 row
"$eval" "$src/data/kvq-retrieval.gguf" --text "$src/data/retrieval-main.txt" --max-tokens 128 -q 'mix(0-=none)' \
    -q 'mix(0=none;1=per-token:bits=2)' -q per-token:bits=2 --per-layer --format csv >"$tmp/mixnone.csv" 2>/dev/null
python3 - "$tmp/mixnone.csv" <<'PY' && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: none in a mix"; cat "$tmp/mixnone.csv"; }
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
allnone = [r for r in rows if r["quantizer"] == "mix" and r["spec"] == "none"]
pt = {r["layer"]: r["dnll"] for r in rows if r["quantizer"] == "per-token"}
mixpt = [r for r in rows if r["quantizer"] == "mix" and r["spec"] == "per-token:bits=2"]
sys.exit(not (len(allnone) == 3 and all(float(r["dnll"]) == 0 for r in allnone)
              and len(mixpt) == 1 and mixpt[0]["dnll"] == pt["1"]))
PY
# --per-layer: one row per layer
"$eval" "$tiny" --text "$tmp/text.txt" -q kivi:bits=2,group=8,residual=8 --per-layer -o "$tmp/pl.jsonl" 2>/dev/null
[ "$(grep -c '"layer":"[0-9]"' "$tmp/pl.jsonl")" = 3 ] && ! ls "$tmp"/pl.jsonl.tmp.* >/dev/null 2>&1 \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: --per-layer rows"; cat "$tmp/pl.jsonl"; }
expect 0 "decode" -- "$eval" "$qwen" --tokens "$tmp/ids.txt" -q absmax:bits=4 --policy decode --stride 3 --format table

# --- bad input: exit 1, one line
expect 1 "missing.gguf: cannot open" -- "$dump" "$tmp/missing.gguf" --text "$tmp/text.txt" -o "$tmp/x.h5"
expect 1 "garbage.gguf: not a model file" -- "$dump" "$tmp/garbage.gguf" --text "$tmp/text.txt" -o "$tmp/x.h5"
expect 1 "truncated.gguf" -- "$eval" "$tmp/truncated.gguf" --text "$tmp/text.txt" -q none
expect 1 "empty.txt" "nothing" -- "$dump" "$tiny" --text "$tmp/empty.txt" -o "$tmp/x.h5"
expect 1 "bad-ids.txt: token 2 \"999\": expected a token id 0..399" -- "$dump" "$tiny" --tokens "$tmp/bad-ids.txt" -o "$tmp/x.h5"
expect 1 "word-ids.txt: token 1 \"five\"" -- "$eval" "$tiny" --tokens "$tmp/word-ids.txt" -q none
expect 1 "not-there.h5: cannot open" -- "$eval" "$tiny" --text "$tmp/text.txt" -q cluster --calib "$tmp/not-there.h5"
[ ! -e "$tmp/x.h5" ] && ! ls "$tmp"/x.h5.tmp.* >/dev/null 2>&1 && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a failed dump left a file"; }

# --- usage errors: exit 2
expect 2 "no model given" -- "$dump" --text "$tmp/text.txt" -o "$tmp/x.h5"
expect 2 "exactly one of --text FILE and --tokens FILE" -- "$dump" "$tiny" -o "$tmp/x.h5"
expect 2 "exactly one of --text FILE and --tokens FILE" -- "$eval" "$tiny" --text "$tmp/text.txt" --tokens "$tmp/ids.txt"
expect 2 "no output given" -- "$dump" "$tiny" --text "$tmp/text.txt"
expect 2 "unknown option --bogus" -- "$eval" "$tiny" --bogus
expect 2 "--policy sometimes" -- "$eval" "$tiny" --text "$tmp/text.txt" --policy sometimes
expect 2 "--stride 0" -- "$eval" "$tiny" --text "$tmp/text.txt" --stride 0
expect 2 "--max-tokens 1" -- "$dump" "$tiny" --text "$tmp/text.txt" --max-tokens 1 -o "$tmp/x.h5"
expect 2 "unknown quantizer 'nope'" -- "$eval" "$tiny" --text "$tmp/text.txt" -q nope
expect 2 "cluster: needs a calibration dump" "--calib FILE" -- "$eval" "$tiny" --text "$tmp/text.txt" -q cluster
expect 2 "--tokens" -- "$dump" "$qwen" --text "$tmp/text.txt" -o "$tmp/x.h5"
expect 2 "layer 7: expected 0..2" -- "$dump" "$tiny" --text "$tmp/text.txt" --layers 7 -o "$tmp/x.h5"
expect 0 "usage: kvq-eval" -- "$eval" --help
expect 0 "kvq-dump" -- "$dump" --version

# -o that is an input (the model, the text) is a usage error; the input is kept
cp "$tiny" "$tmp/keep.gguf"
expect 2 "that is an input of this run" -- "$dump" "$tmp/keep.gguf" --text "$tmp/text.txt" -o "$tmp/keep.gguf"
expect 2 "that is an input of this run" -- "$eval" "$tmp/keep.gguf" --text "$tmp/text.txt" -q none -o "$tmp/text.txt"
# OUT.meta.json that is an input (a text named so) is refused too, before the run (issue #36)
cp "$tmp/text.txt" "$tmp/y.csv.meta.json"
expect 2 "y.csv.meta.json (the provenance record of -o): that is an input of this run" -- "$eval" "$tiny" --text "$tmp/y.csv.meta.json" --max-tokens 32 -q none -o "$tmp/y.csv"
expect 2 "y.csv.meta.json (the provenance record of -o): that is an input of this run" -- "$dump" "$tiny" --text "$tmp/y.csv.meta.json" -o "$tmp/y.csv"
grep -q "the cat" "$tmp/y.csv.meta.json" && [ ! -e "$tmp/y.csv" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a meta path overwrote the text"; }
# a symlink loop at -o is refused, never replaced (docs/tools.md)
ln -s loop-b "$tmp/loop-a" && ln -s loop-a "$tmp/loop-b"
expect 1 "loop-a: cannot write the output: a symlink loop" -- "$dump" "$tmp/keep.gguf" --text "$tmp/text.txt" -o "$tmp/loop-a"
expect 1 "loop-a: cannot write the output: a symlink loop" -- "$eval" "$tmp/keep.gguf" --text "$tmp/text.txt" -q none -o "$tmp/loop-a"
[ -L "$tmp/loop-a" ] && [ -L "$tmp/loop-b" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a symlink loop was replaced"; }
cmp -s "$tiny" "$tmp/keep.gguf" && grep -q "the cat" "$tmp/text.txt" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: an input was overwritten"; }
expect 2 "-o: expected a file name" -- "$dump" "$tiny" --text "$tmp/text.txt" -o ""

# --- the bundled model (skipped without ../shared/data/model)
shared=${KVQ_MODEL_DIR:-$src/../shared/data}
if [ -r "$shared/model/stories260K.gguf" ]; then
    expect 0 "mean NLL 1.3124" -- "$dump" "$shared/model/stories260K.gguf" --text "$shared/texts/story_main.txt" --max-tokens 512 -o "$tmp/s.h5"
    expect 0 "512 tokens" "mean NLL 1.3124" -- "$dump" "$shared/model/stories260K.bin" --tokenizer "$shared/model/tok512.bin" \
        --text "$shared/texts/story_main.txt" -o "$tmp/s2.h5"
    expect 2 "give --tokenizer" -- "$dump" "$shared/model/stories260K.bin" --text "$shared/texts/story_main.txt" -o "$tmp/x.h5"
    # KIVI 2-bit: the whole cache at once costs far more than the cache as generation holds it
    "$eval" "$shared/model/stories260K.gguf" --text "$shared/texts/story_main.txt" --max-tokens 512 -q kivi:bits=2 \
        --policy prefill,decode --format csv >"$tmp/k.csv" 2>/dev/null
    awk -F, 'NR > 1 {d[$5] = $11} END {exit !(d["prefill"] > 1.0 && d["prefill"] < 1.4 && d["decode"] > 0.03 && d["decode"] < 0.15)}' "$tmp/k.csv" \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kivi prefill/decode dnll"; cat "$tmp/k.csv"; }
    # results do not depend on the thread count: byte-identical CSV at 1, 2, 3 threads;
    # per-token groups give prefill == decode exactly (same nll text)
    for n in 1 2 3; do
        "$eval" "$shared/model/stories260K.gguf" --text "$shared/texts/story_main.txt" --max-tokens 512 -q per-token:bits=4 \
            -q kivi:bits=2 --policy prefill,decode --threads $n --format csv >"$tmp/t$n.csv" 2>/dev/null
    done
    cmp -s "$tmp/t1.csv" "$tmp/t2.csv" && cmp -s "$tmp/t1.csv" "$tmp/t3.csv" && [ -s "$tmp/t1.csv" ] \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-eval output differs between --threads 1, 2, 3"; cat "$tmp/t"?.csv; }
    # a weight tile's rows in one call (a BLAS core whose rows do not depend on the call's others)
    # or in calls of 256 rows (KVQ_BLAS_ROWS=tiles, as on Haswell's kernels): the same bytes
    KVQ_BLAS_ROWS=tiles "$eval" "$shared/model/stories260K.gguf" --text "$shared/texts/story_main.txt" --max-tokens 512 \
        -q per-token:bits=4 -q kivi:bits=2 --policy prefill,decode --threads 2 --format csv >"$tmp/tiles.csv" 2>/dev/null
    cmp -s "$tmp/t2.csv" "$tmp/tiles.csv" && pass=$((pass + 1)) \
        || { fail=$((fail + 1)); echo "FAIL: kvq-eval output differs with KVQ_BLAS_ROWS=tiles"; cat "$tmp/tiles.csv"; }
    awk -F, 'NR > 1 && $3 == "per-token" {d[$5] = $10} END {exit !(d["prefill"] != "" && d["prefill"] == d["decode"])}' "$tmp/t1.csv" \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: per-token prefill != decode"; cat "$tmp/t1.csv"; }
    # vq calibrated (docs/quantizers.md#vq): a token's code depends on that token alone, so prefill ==
    # decode; space=pre codes the model's own pre-RoPE keys; codebook=data cannot train on a 1-token cache
    "$eval" "$shared/model/stories260K.gguf" --text "$shared/texts/story_main.txt" --max-tokens 128 \
        -q vq:dims=4,bits=6,share=layer -q vq:dims=2,bits=4,space=pre --calib "$src/data/stories260K-calib.h5" \
        --policy prefill,decode --format csv >"$tmp/vq.csv" 2>/dev/null
    [ "$(tail -n +2 "$tmp/vq.csv" | wc -l)" = 4 ] && [ "$(tail -n +2 "$tmp/vq.csv" | sed 's/,prefill,/,P,/; s/,decode,/,P,/' | sort | uniq -d | wc -l)" = 2 ] \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: vq prefill != decode"; cat "$tmp/vq.csv"; }
    # decode with codebook=data: the cache of the first positions holds fewer distinct sub-vectors than
    # centres, each a centre (SPEC 3.10): said once as a note, not an error
    expect 0 "kvq-eval: note: vq: layer 0, key head 0, group 0 (channels 0-3), stage 1: 1 distinct" -- \
        "$eval" "$shared/model/stories260K.gguf" --text "$shared/texts/story_main.txt" --max-tokens 32 \
        -q vq:codebook=data,bits=4 --policy decode
    # mix (docs/quantizers.md#mix): one range is its spec (every column but quantizer and spec, both
    # policies); --per-layer rows name the layer's own spec; a layer in no range is exit 2
    m=$shared/model/stories260K.gguf
    t=$shared/texts/story_main.txt
    "$eval" "$m" --text "$t" --max-tokens 256 -q 'mix(0-=kivi:bits=2)' -q kivi:bits=2 --policy prefill,decode \
        --format csv >"$tmp/mix.csv" 2>/dev/null
    awk -F, 'NR > 1 {$3 = $4 = ""; row[NR] = $0} END {exit !(NR == 5 && row[2] == row[4] && row[3] == row[5])}' "$tmp/mix.csv" \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: mix(0-=kivi:bits=2) differs from kivi:bits=2"; cat "$tmp/mix.csv"; }
    "$eval" "$m" --text "$t" --max-tokens 128 -q 'mix(0-1=kivi:bits=4;2-=per-token:bits=2)' -q per-token:bits=2 \
        --per-layer --format csv >"$tmp/mixl.csv" 2>/dev/null
    awk -F, 'NR > 1 && $3 == "mix" {m[$6] = $4; d[$6] = $11} NR > 1 && $3 == "per-token" {p[$6] = $11}
             END {exit !(m[0] == "kivi:bits=4" && m[1] == "kivi:bits=4" && m[2] == "per-token:bits=2" &&
                         m[4] == "per-token:bits=2" && d[3] == p[3] && d[4] == p[4])}' "$tmp/mixl.csv" \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: mix --per-layer rows"; cat "$tmp/mixl.csv"; }
    expect 2 "mix(0-1=kivi;3-=fp8): layer 2 is in no range" -- "$eval" "$m" --text "$t" --max-tokens 64 -q 'mix(0-1=kivi;3-=fp8)'
    expect 2 "range 0-9: the model has 5 layers" -- "$eval" "$m" --text "$t" --max-tokens 64 -q 'mix(0-9=kivi)'
    expect 2 "layer 1 is in two ranges (0-1 and 1-)" -- "$eval" "$m" --text "$t" --max-tokens 64 -q 'mix(0-1=kivi;1-=fp8)'

    # kvq-alloc (docs/models.md#kvq-alloc): the sensitivities are kvq-eval --per-layer's rows, an allocation's
    # dnll_pred is the sum of its layers' entries and its bits the pooled bits, --resume after a torn pass
    # gives the same bytes, and bad input is exit 2
    alloc=$build/tools/kvq-alloc
    aargs=("$m" --text "$t" --max-tokens 192 --family kivi --grid kbits=2,4 --grid vbits=2,4 --fixed residual=0)
    expect 0 -- "$alloc" "${aargs[@]}" --budget 5,5.6,7 --progress never -o "$tmp/al.csv"
    "$eval" "$m" --text "$t" --max-tokens 192 --per-layer --format csv -q kivi:residual=0,kbits=2,vbits=2 \
        -q kivi:residual=0,kbits=2,vbits=4 -q kivi:residual=0,kbits=4,vbits=2 -q kivi:residual=0,kbits=4,vbits=4 \
        >"$tmp/al-eval.csv" 2>/dev/null
    /usr/bin/python3 - "$tmp/al.csv" "$tmp/al-eval.csv" <<'PY' && pass=$((pass + 1)) || fail=$((fail + 1))
import csv, sys
out, ev = sys.argv[1], sys.argv[2]
sens = {(r["spec"], int(r["layer"])): r for r in csv.DictReader(open(out + ".sensitivity.csv"))}
bad = []
for r in csv.DictReader(open(ev)):
    s = sens.get((r["spec"], int(r["layer"])))
    if not s or any(float(s[c]) != float(r[c]) for c in ("k_bits", "v_bits", "dnll", "dnll_se")):
        bad.append(f"sensitivity of {r['spec']} layer {r['layer']}: {s} vs kvq-eval {r}")
if len(sens) != 4 * 5:
    bad.append(f"{len(sens)} sensitivity rows, expected 20")
rows = list(csv.DictReader(open(out)))
for r in rows:
    if not r["spec"].startswith("mix("):
        continue
    pred, bits = 0.0, 0.0
    for item in r["spec"][4:-1].split(";"):
        rng, spec = item.split("=", 1)
        for part in rng.split(","):
            a, _, b = part.partition("-")
            for l in range(int(a), (int(b) if b else 4) + 1 if "-" in part else int(a) + 1):
                pred += float(sens[(spec, l)]["dnll"])
                bits += float(sens[(spec, l)]["bits"]) / 5
    if abs(pred - float(r["dnll_pred"])) > 1e-12 or abs(bits - float(r["mean_bits"])) > 1e-9 or \
            float(r["mean_bits"]) > float(r["budget"]):
        bad.append(f"allocation {r}: predicted {pred}, bits {bits}")
if [r["spec"].startswith("mix(") for r in rows[::2]] != [True] * 3:
    bad.append(f"rows: {rows}")
for b in bad:
    print("FAIL: kvq-alloc:", b)
sys.exit(1 if bad else 0)
PY
    # a tokens(...) template as the family: its selector's keys per layer, the sensitivities kvq-eval's rows
    tf='tokens(snapkv:obs=8; none; per-token:bits=2)'
    expect 0 "budget 11" -- "$alloc" "$m" --text "$t" --max-tokens 96 --family "$tf" --grid keep=0.25,0.5 --budget 11 \
        --progress never -o "$tmp/alt.csv"
    "$eval" "$m" --text "$t" --max-tokens 96 --per-layer --format csv -q 'tokens(snapkv:keep=0.25,obs=8; none; per-token:bits=2)' \
        -q 'tokens(snapkv:keep=0.5,obs=8; none; per-token:bits=2)' >"$tmp/alt-eval.csv" 2>/dev/null
    /usr/bin/python3 - "$tmp/alt.csv.sensitivity.csv" "$tmp/alt-eval.csv" <<'PY' && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-alloc --family tokens(...)"; }
import csv, sys
sens = {(r["spec"], int(r["layer"])): r for r in csv.DictReader(open(sys.argv[1]))}
ev = list(csv.DictReader(open(sys.argv[2])))
sys.exit(not (len(sens) == len(ev) == 10 and all(
    float(sens[(r["spec"], int(r["layer"]))][c]) == float(r[c]) for r in ev for c in ("k_bits", "v_bits", "dnll"))))
PY
    cp "$tmp/al.csv" "$tmp/al-full.csv"
    cp "$tmp/al.csv.sensitivity.csv" "$tmp/al-sens-full.csv"
    head -c "$(( $(head -n 11 "$tmp/al-sens-full.csv" | wc -c) + 20 ))" "$tmp/al-sens-full.csv" >"$tmp/al.csv.sensitivity.csv"
    expect 2 "al.csv.sensitivity.csv exists: --resume continues" -- "$alloc" "${aargs[@]}" --budget 5 -o "$tmp/al.csv"
    expect 0 "resuming: 2 of 4 sensitivity passes" -- "$alloc" "${aargs[@]}" --budget 5,5.6,7 --resume --progress never -o "$tmp/al.csv"
    cmp -s "$tmp/al.csv" "$tmp/al-full.csv" && cmp -s "$tmp/al.csv.sensitivity.csv" "$tmp/al-sens-full.csv" \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-alloc --resume after a torn pass differs"; }
    expect 2 "--budget 4: below the cheapest allocation of this grid, 4.5" -- "$alloc" "${aargs[@]}" --budget 4 --resume -o "$tmp/al.csv"
    expect 2 "--budget 4: below the cheapest allocation of this grid, 4.5" -- "$alloc" "${aargs[@]}" --budget 5,4 --progress always -o "$tmp/al3.csv"
    ! grep -q "pass" "$tmp/err" && [ ! -e "$tmp/al3.csv.sensitivity.csv" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a budget below the grid's cheapest ran passes first"; }
    expect 2 "--budget abc: expected positive numbers" -- "$alloc" "${aargs[@]}" --budget abc -o "$tmp/al2.csv"
    expect 2 "--budget B required" -- "$alloc" "${aargs[@]}" -o "$tmp/al2.csv"
    expect 2 "-o OUT required" -- "$alloc" "${aargs[@]}" --budget 5
    expect 2 "kbits" -- "$alloc" "$m" --text "$t" --family kivi --grid kbits= --budget 5 -o "$tmp/al2.csv"
    expect 2 "unknown quantizer" -- "$alloc" "$m" --text "$t" --family nope --grid bits=2 --budget 5 -o "$tmp/al2.csv"
    expect 2 "not a row of this run's grid" -- "$alloc" "$m" --text "$t" --max-tokens 64 --family kivi --grid bits=3 --budget 99 --resume -o "$tmp/al.csv"
    [ ! -e "$tmp/al2.csv.sensitivity.csv" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a refused kvq-alloc left a file"; }
    # an edited or foreign sensitivity table is refused at --resume, naming the line (issue #36)
    sens=$tmp/al.csv.sensitivity.csv
    edit() { # line column value: a copy of the full table with one cell changed (CSV quoting kept)
        /usr/bin/python3 -c 'import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
rows[int(sys.argv[2]) - 1][int(sys.argv[3]) - 1] = sys.argv[4]
csv.writer(open(sys.argv[5], "w"), lineterminator="\n").writerows(rows)' "$tmp/al-sens-full.csv" "$@" "$sens"
    }
    edit 3 6 inf; expect 1 "line 3: dnll 'inf': expected a finite number" -- "$alloc" "${aargs[@]}" --budget 5 --resume -o "$tmp/al.csv"
    edit 3 6 -inf; expect 1 "line 3: dnll '-inf'" -- "$alloc" "${aargs[@]}" --budget 5 --resume -o "$tmp/al.csv"
    edit 3 7 -0.5; expect 1 "line 3: dnll_se -0.5: a standard error is not negative" -- "$alloc" "${aargs[@]}" --budget 5 --resume -o "$tmp/al.csv"
    edit 2 1 2.5; expect 2 "line 2: not a row of this run's grid and model" -- "$alloc" "${aargs[@]}" --budget 5 --resume -o "$tmp/al.csv"
    edit 2 1 -0.9; expect 2 "line 2: not a row of this run's grid and model" -- "$alloc" "${aargs[@]}" --budget 5 --resume -o "$tmp/al.csv"
    edit 4 3 0; expect 1 "line 4: bits 0," "stores" -- "$alloc" "${aargs[@]}" --budget 5 --resume -o "$tmp/al.csv"
    edit 4 3 1e300; expect 1 "line 4: bits 1.0000000000000001e+300" -- "$alloc" "${aargs[@]}" --budget 5 --resume -o "$tmp/al.csv"
    { head -n 3 "$tmp/al-sens-full.csv"; printf '3,"kivi:bits=2\n4,x\n'; } >"$sens"
    expect 1 "line 4: a quoted field that never ends" -- "$alloc" "${aargs[@]}" --budget 5 --resume -o "$tmp/al.csv"
    cp "$tmp/al-sens-full.csv" "$sens"
    expect 2 "measured in another run" -- "$alloc" "$m" --text "$t" --max-tokens 160 --family kivi --grid kbits=2,4 \
        --grid vbits=2,4 --fixed residual=0 --budget 5 --resume -o "$tmp/al.csv"
    expect 2 "measured in another run" -- "$alloc" "${aargs[@]}" --policy decode --budget 5 --resume -o "$tmp/al.csv"
    cmp -s "$sens" "$tmp/al-sens-full.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a refused resume changed the table"; }
    # a torn line with no pass complete is cut (the header stays), and the passes run after it
    head -c 70 "$tmp/al-sens-full.csv" >"$sens"
    expect 0 -- "$alloc" "${aargs[@]}" --budget 5,5.6,7 --resume --progress never -o "$tmp/al.csv"
    cmp -s "$sens" "$tmp/al-sens-full.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: resume after a torn first line"; }
    # one run at a time: a second on the same OUT exits 1 at once; the table is not a FIFO or a directory
    flock "$sens" sleep 3 &
    sleep 0.5
    expect 1 "another kvq-alloc run is writing it" -- "$alloc" "${aargs[@]}" --budget 5 --resume -o "$tmp/al.csv"
    wait
    mkfifo "$tmp/fifo.csv.sensitivity.csv"
    expect 2 "fifo.csv.sensitivity.csv (the sensitivity table of -o): not a regular file (a FIFO)" -- timeout 20 "$alloc" "${aargs[@]}" --budget 5 --resume -o "$tmp/fifo.csv"
    mkfifo "$tmp/fu.csv.uniform.csv"
    expect 2 "fu.csv.uniform.csv (the uniform points of -o): not a regular file (a FIFO)" -- timeout 20 "$alloc" "${aargs[@]}" --budget 5 -o "$tmp/fu.csv"
    [ ! -e "$tmp/fu.csv.sensitivity.csv" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a refused kvq-alloc left its table"; }
    mkdir "$tmp/dir.csv.sensitivity.csv"
    expect 2 "dir.csv.sensitivity.csv (the sensitivity table of -o): not a regular file (a directory)" -- timeout 20 "$alloc" "${aargs[@]}" --budget 5 --resume -o "$tmp/dir.csv"
    expect 2 "--budget" "expected positive numbers" -- "$alloc" "${aargs[@]}" --budget "$(printf '5,%.0s' $(seq 300))x" -o "$tmp/al2.csv"
    # --shard (docs/models.md#shards): two shards' tables merged allocate as one run, byte for byte
    # (the allocations, the sensitivity table, the uniform points); a shard resumes like a run
    for i in 0 1; do
        expect 0 "shard $i/2 complete (2 of the grid's 4 points)" -- "$alloc" "${aargs[@]}" --shard $i/2 --progress never -o "$tmp/as$i.csv"
    done
    head -c "$(( $(head -n 6 "$tmp/as1.csv" | wc -c) + 9 ))" "$tmp/as1.csv" >"$tmp/as1-torn.csv"
    mv "$tmp/as1.csv" "$tmp/as1-full.csv" && mv "$tmp/as1-torn.csv" "$tmp/as1.csv"
    expect 1 "as1.csv: ends in an unfinished pass" -- "$alloc" --merge "${aargs[@]}" "$tmp/as0.csv" "$tmp/as1.csv" --budget 5,5.6,7 -o "$tmp/am.csv"
    expect 0 "shard 1/2 complete" -- "$alloc" "${aargs[@]}" --shard 1/2 --resume --progress never -o "$tmp/as1.csv"
    cmp -s "$tmp/as1.csv" "$tmp/as1-full.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a resumed kvq-alloc shard differs"; }
    expect 0 "joined 4 sensitivity passes from 2 shards" "budget 5:" -- "$alloc" --merge "${aargs[@]}" "$tmp/as1.csv" "$tmp/as0.csv" --budget 5,5.6,7 --progress never -o "$tmp/am.csv"
    cmp -s "$tmp/am.csv" "$tmp/al-full.csv" && cmp -s "$tmp/am.csv.sensitivity.csv" "$tmp/al-sens-full.csv" \
        && cmp -s "$tmp/am.csv.uniform.csv" "$tmp/al.csv.uniform.csv" \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: merged kvq-alloc shards differ from one run"; }
    expect 1 "in no shard" -- "$alloc" --merge "${aargs[@]}" "$tmp/as0.csv" --budget 5 -o "$tmp/am2.csv"
    expect 1 "twice" -- "$alloc" --merge "${aargs[@]}" "$tmp/as0.csv" "$tmp/as0.csv" --budget 5 -o "$tmp/am2.csv"
    expect 2 "measured in another run" -- "$alloc" --merge "$m" --text "$t" --max-tokens 160 --family kivi --grid kbits=2,4 \
        --grid vbits=2,4 --fixed residual=0 "$tmp/as0.csv" "$tmp/as1.csv" --budget 5 -o "$tmp/am2.csv"
    expect 2 "--shard 0/2 measures sensitivities only" -- "$alloc" "${aargs[@]}" --shard 0/2 --budget 5 -o "$tmp/as9.csv"
    [ ! -e "$tmp/am2.csv" ] && [ ! -e "$tmp/am2.csv.sensitivity.csv" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a refused merge left a file"; }
    # the Slurm array script: kvq-alloc's passes in 3 tasks, then the merge allocates as one run
    (export OUTDIR=$tmp/aslurm KVQ_BIN=$build/tools
     a=(kvq-alloc "$m" --text "$t" --max-tokens 192 --family kivi --grid kbits=2,4 --grid vbits=2,4 --fixed residual=0
        --budget 5,5.6,7)
     for i in 0 1 2; do SLURM_ARRAY_TASK_ID=$i SLURM_ARRAY_TASK_COUNT=3 bash "$src/tools/kvq-shards.slurm" "${a[@]}" 2>/dev/null; done
     bash "$src/tools/kvq-shards.slurm" merge "${a[@]}" 2>/dev/null)
    cmp -s "$tmp/aslurm/alloc.csv" "$tmp/al-full.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-shards.slurm (kvq-alloc) differs from one run"; }
    # kvq-eval --shard on the bundled model: two shards of --chunk 64 merged are one run
    "$eval" "$m" --text "$t" --chunk 64 -q none -q kivi:bits=2 -q per-token:bits=4 --progress never -o "$tmp/ec.csv" 2>/dev/null
    for i in 0 1; do "$eval" "$m" --text "$t" --chunk 64 -q none -q kivi:bits=2 -q per-token:bits=4 --shard $i/2 --progress never -o "$tmp/ec$i.csv" 2>/dev/null; done
    "$eval" --merge "$tmp/ec0.csv" "$tmp/ec1.csv" -o "$tmp/ecm.csv" 2>/dev/null
    cmp -s "$tmp/ec.csv" "$tmp/ecm.csv" && [ -s "$tmp/ec.csv" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: stories260K --chunk 64 shards merged differ"; }
    # every recorded row of kvq-dump, kvq-eval and kvq-alloc reaches OUT.meta.json, in the record of
    # the kind of run that records it (a shard, a --merge, a --tasks run; tests/check_option_record.py)
    "$build/tools/kvq-gen" --task kv --count 2 --context-tokens 40 -o "$tmp/rows.jsonl" 2>/dev/null
    "$eval" "$m" --tasks "$tmp/rows.jsonl" -q none --per-depth 0.5 --progress never -o "$tmp/rows-t.csv" 2>/dev/null
    recorded dump tiny.h5
    recorded eval ec1.csv ecm.csv rows-t.csv
    recorded alloc al.csv as0.csv
else
    echo "test_model_cli: bundled model checks skipped: $shared/model absent"
fi

# --- real models' architectures (skipped without ../shared/data/models-tiny)
if [ -r "$shared/models-tiny/tiny-gemma3.gguf" ]; then
    g3=$shared/models-tiny/tiny-gemma3.gguf
    awk -F'\t' '$1 == "01.txt" {print $2}' "$shared/models-tiny/tiny-gemma3.tokens.tsv" >"$tmp/g3.ids"
    awk -F'\t' '{printf "%s ", $2}' "$shared/models-tiny/tiny-gemma3.tokens.tsv" >"$tmp/g3-all.ids"
    expect 0 "gemma3, 6 layers" -- "$dump" "$g3" --tokens "$tmp/g3-all.ids" --max-tokens 150 -o "$tmp/g3.h5"
    # 400 KB of whitespace runs, cut by Gemma's user-defined whitespace tokens: linear now (was 38.6 s;
    # kvq-bench-tokenize times 100k..800k characters)
    /usr/bin/python3 -c 'import sys; sys.stdout.write("\r\n\t" * 133334)' >"$tmp/ws.txt"
    expect 0 "64 tokens" -- timeout 30 "$eval" "$g3" --text "$tmp/ws.txt" --max-tokens 64 -q none --format table
    # every architecture: --text through its own tokenizer, a dump kvq-info accepts
    for a in llama3 qwen3 phi3; do
        expect 0 "kvq tiny random" -- "$dump" "$shared/models-tiny/tiny-$a.gguf" --text "$shared/texts/tokenizer/03.txt" -o "$tmp/$a.h5"
        expect 0 "kvq-dump/1" -- "$build/tools/kvq-info" "$tmp/$a.h5"
    done
    expect 0 "5 layer(s) with a sliding window" -- "$build/tools/kvq-info" "$tmp/g3.h5"
    # the windows apply: KIVI's full-precision residual (128) covers a local layer's window (64)
    # for the last 64 query rows, so their outputs are exact there, not in the global layer 5
    "$analyze" -q kivi --format csv "$tmp/g3.h5" >"$tmp/g3.csv" 2>/dev/null
    awk -F, 'NR > 1 && $2 < 5 && $22 == 0 {loc++} NR > 1 && $2 == 5 && $22 > 0.01 {glob++} END {exit !(loc == 5 && glob == 1)}' "$tmp/g3.csv" \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: gemma3 dump: windows in the attention metrics"; cat "$tmp/g3.csv"; }
    for n in 1 2 3; do
        "$eval" "$g3" --tokens "$tmp/g3-all.ids" --max-tokens 150 -q per-token:bits=4 -q fp8:scale=token -q ggml \
            --policy prefill,decode --threads $n --format csv >"$tmp/g$n.csv" 2>/dev/null
    done
    cmp -s "$tmp/g1.csv" "$tmp/g2.csv" && cmp -s "$tmp/g1.csv" "$tmp/g3.csv" && [ -s "$tmp/g1.csv" ] \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: gemma3 kvq-eval differs between --threads 1, 2, 3"; cat "$tmp/g"?.csv; }
    awk -F, 'NR > 1 {d[$4 "/" $5] = $10} END {n = 0; for (k in d) if (k ~ /prefill/) {j = k; sub(/prefill/, "decode", j); n += d[k] == d[j]}
             exit n != 3}' "$tmp/g1.csv" \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: gemma3 prefill != decode"; cat "$tmp/g1.csv"; }
    # --context with sliding windows (the README's plumbing check): eviction and its combination
    # with KIVI move the output, a context kept whole does not, and --threads changes nothing
    for n in 1 2; do
        "$eval" "$g3" --tokens "$tmp/g3-all.ids" --max-tokens 150 --context 100 --policy prefill,decode \
            -q 'tokens(snapkv:keep=0.25,obs=16; none; drop)' -q 'tokens(h2o:keep=0.5; kivi:bits=4,group=32,residual=32; drop)' \
            -q 'tokens(window:sinks=4,recent=96; none; drop)' --threads $n --format csv >"$tmp/gc$n.csv" 2>/dev/null
    done
    cmp -s "$tmp/gc1.csv" "$tmp/gc2.csv" && awk -F, 'NR > 1 && $(NF-4) > 0 {moved++} NR > 1 && /recent=96/ && $(NF-4) == 0 {whole++}
        END {exit !(moved == 4 && whole == 2)}' "$tmp/gc1.csv" \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: gemma3 --context"; cat "$tmp/gc"?.csv; }
else
    echo "test_model_cli: tiny real-architecture checks skipped: $shared/models-tiny absent"
fi

# --- tokens(...) in the model (docs/quantizers.md#tokens): keep=1 is the spec
# under both policies; dropping moves the output (kl > 0); no result depends on --threads
for pol in prefill decode; do
    "$eval" "$tiny" --tokens "$tmp/ids40.txt" --policy $pol -q per-token:bits=2 \
        -q 'tokens(h2o:keep=1; per-token:bits=2; drop)' --format csv 2>/dev/null | cut -d, -f5- | tail -2 | uniq | wc -l |
        grep -qx 1 && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: tokens(h2o:keep=1; SPEC; drop) $pol differs from SPEC"; }
done
tq='tokens(snapkv:keep=0.5,obs=4; none; drop)'
"$eval" "$tiny" --tokens "$tmp/ids40.txt" --policy decode -q "$tq" -q 'tokens(window:sinks=2,recent=8; none; drop)' \
    --format csv --threads 1 >"$tmp/tok1.csv" 2>/dev/null
"$eval" "$tiny" --tokens "$tmp/ids40.txt" --policy decode -q "$tq" -q 'tokens(window:sinks=2,recent=8; none; drop)' \
    --format csv --threads 2 >"$tmp/tok2.csv" 2>/dev/null
cmp -s "$tmp/tok1.csv" "$tmp/tok2.csv" && awk -F, 'NR > 1 && $(NF-4) > 0 {n++} END {exit n != 2}' "$tmp/tok1.csv" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: tokens in kvq-eval (threads, kl > 0)"; cat "$tmp/tok1.csv"; }

# --- --context N (SPEC §3.11): a spec that keeps the context exact is the
# exact model on positions >= N; a per-token quantizer with --context and
# decode is plain decode where the context's keys are the same (only the last
# layer quantized: the context is prefilled exactly, so earlier layers differ
# by design); with --chunk each window's context is its own first N tokens;
# bits count the compressed context and the continuation; threads change nothing
"$eval" "$tiny" --tokens "$tmp/ids40.txt" --context 12 --policy prefill,decode -q none \
    -q 'tokens(window:sinks=2,recent=10; none; drop)' -q 'tokens(window:sinks=2,recent=4; none; drop)' \
    -q per-token:bits=4 --format csv >"$tmp/ctx.csv" 2>/dev/null
awk '{q = $0; gsub(/"[^"]*"/, "", q); split(q, f, ","); sp = $0; sub(/^[^,]*,[^,]*,[^,]*,/, "", sp)} # f: the cells, the quoted spec emptied
     NR > 1 && sp ~ /recent=10/ {n++; ok += f[11] == 0 && f[13] == 0 && f[15] == 24 && f[5] ~ /context=12$/}
     NR > 1 && sp ~ /recent=4/ {n++; ok += f[13] > 0}
     NR > 1 && sp ~ /^per-token/ && f[5] ~ /^prefill/ {n++; ok += f[7] == (12 * 8 + 25 * 16) / 37}
     NR > 1 && sp ~ /^per-token/ && f[5] ~ /^decode/ {n++; ok += f[7] == 8}
     END {exit !(n == 6 && ok == 6)}' "$tmp/ctx.csv" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: --context: exact context, eviction, bits"; cat "$tmp/ctx.csv"; }
for c in "" "--context 8"; do
    "$eval" "$tiny" --tokens "$tmp/ids40.txt" --chunk 16 $c --policy decode --per-layer -q per-token:bits=3 \
        --format csv 2>/dev/null | awk -F, 'NR > 1 {l = $6} END {print $10, $15}'
done | uniq | wc -l | grep -qx 1 && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: --context + decode != decode (per-token, last layer)"; }
printf '%s ' 1 $(seq 5 19) >"$tmp/w0.txt"
printf '%s ' 1 $(seq 21 35) >"$tmp/w1.txt"
q='tokens(snapkv:keep=0.5,obs=3; none; per-token:bits=2)'
{
    "$eval" "$tiny" --tokens "$tmp/ids40.txt" --chunk 16 --context 6 -q "$q" --format csv 2>/dev/null | tail -1
    for w in 0 1; do "$eval" "$tiny" --tokens "$tmp/w$w.txt" --context 6 -q "$q" --format csv 2>/dev/null | tail -1; done
} | awk '{q = $0; gsub(/"[^"]*"/, "", q); split(q, f, ","); nll[NR] = f[10]; pos[NR] = f[15]; ref[NR] = f[9]}
    function near(a, b) {return (a - b) ^ 2 < 1e-24 * (1 + b * b)}
    END {exit !(NR == 3 && pos[1] == pos[2] + pos[3] && pos[2] == 9 &&
                near(nll[1] * pos[1], nll[2] * pos[2] + nll[3] * pos[3]) && near(ref[1] * pos[1], ref[2] * pos[2] + ref[3] * pos[3]))}' \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: --chunk --context: each window's own context"; }
for n in 1 2; do
    "$eval" "$tiny" --tokens "$tmp/ids40.txt" --context 10 --policy decode --stride 3 -q "$q" -q kivi:bits=2,group=4,residual=4 \
        --threads $n --format csv >"$tmp/ctx$n.csv" 2>/dev/null
done
cmp -s "$tmp/ctx1.csv" "$tmp/ctx2.csv" && [ "$(wc -l <"$tmp/ctx1.csv")" = 3 ] \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: --context differs between --threads 1 and 2"; cat "$tmp/ctx"?.csv; }
# --- decode-time compression (SPEC §3.11 round 2, kvpress's DecodingPress):
# window with target=S,interval=1 is, row for row, the stateless decode of
# window with recent=S−sinks+1 (every cell but the spec); target >= T is the
# exact cache; LO none changes no number; cache_tokens is the hand count and
# at most target + interval; PrefillDecoding with a target never reached is
# the context compressed once; no result depends on --threads
dq=(-q none -q 'tokens(window:sinks=2,target=10,interval=1; none; drop)' -q 'tokens(window:sinks=2,recent=9; none; drop)'
    -q 'tokens(snapkv:obs=3,target=40,interval=4; none; drop)' -q 'tokens(h2o:target=8,interval=4; none; none)'
    -q 'tokens(knorm:target=8,interval=4; none; drop)' -q 'tokens(snapkv:obs=3,target=6,interval=3,buffer=2; per-token:bits=4; per-token:bits=2)')
for n in 1 3; do
    "$eval" "$tiny" --tokens "$tmp/ids40.txt" --policy decode "${dq[@]}" --threads $n --format csv >"$tmp/press$n.csv" 2>/dev/null
done
"$eval" "$tiny" --tokens "$tmp/ids40.txt" --context 12 --policy decode -q 'tokens(snapkv:keep=0.5,obs=3; none; drop)' \
    -q 'tokens(snapkv:keep=0.5,obs=3,target=99,interval=4; none; drop)' --format csv >"$tmp/pressctx.csv" 2>/dev/null
cmp -s "$tmp/press1.csv" "$tmp/press3.csv" && /usr/bin/python3 - "$tmp/press1.csv" "$tmp/pressctx.csv" <<'PY' \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: decode-time compression"; cat "$tmp/press1.csv" "$tmp/pressctx.csv"; }
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
num = ["k_bits", "v_bits", "nll", "dnll", "kl", "top1", "positions", "dnll_se", "cache_tokens"]
none, win, stateless, big, lonone, knorm, quant = rows
assert all(win[c] == stateless[c] for c in num), "window target=10,interval=1 != recent=9"
assert big["nll"] == big["nll_ref"] and float(big["kl"]) == 0 and big["cache_tokens"] == none["cache_tokens"], big
assert float(big["k_bits"]) == 16
assert lonone["nll"] == lonone["nll_ref"] and lonone["cache_tokens"] == none["cache_tokens"], lonone
T, S, I = 37, 8, 4
held, n = [], 0
for j in range(T):  # row j holds the n tokens kept before it and itself
    n += 1
    held.append(n)
    if (j + 1) % I == 0 and j + 1 < T and n > S:
        n = S
want = sum(held[:T - 1]) / (T - 1)
got = float(knorm["cache_tokens"])
assert abs(got - want) < 1e-12 * want and got <= S + I and float(knorm["kl"]) > 0, (got, want)
assert float(quant["kl"]) > 0 and quant["cache_tokens"] == none["cache_tokens"]  # LO stored: every token held
once, press = csv.DictReader(open(sys.argv[2]))
assert all(once[c] == press[c] for c in ["nll", "kl", "top1", "cache_tokens"]), (once, press)
PY
tq8='tokens(snapkv:target=8,interval=4; none; drop)'
expect 2 "target=8 compresses while decoding: expected --policy decode" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q "$tq8"
expect 2 "keep= with target= compresses a context once" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" --policy decode \
    -q 'tokens(snapkv:keep=0.5,target=8,interval=4; none; drop)'
expect 2 "adaptive= with target=: not supported" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" --policy decode \
    -q 'tokens(snapkv:adaptive=0.5,target=8,interval=4; none; drop)'
expect 2 "buffer=0 leaves h2o no queries" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" --policy decode \
    -q 'tokens(h2o:target=8,interval=4,buffer=0; none; drop)'
expect 2 "target without interval" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" --policy decode -q 'tokens(knorm:target=8; none; drop)'
expect 2 "interval=0: out of range" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" --policy decode \
    -q 'tokens(knorm:target=8,interval=0; none; drop)'
expect 2 "target=8 compresses while decoding" -- "$analyze" -q "$tq8" "$tmp/tiny.h5"
expect 2 "--context 0: expected a positive integer" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --context 0
expect 2 "--context 36: expected at most 35" -- "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --context 36
expect 2 "--context 15: expected at most 14 (a context and at least one scored position in each window of 16" -- \
    "$eval" "$tiny" --tokens "$tmp/ids40.txt" -q none --chunk 16 --context 15
expect 2 "--merge pools finished shards" -- "$eval" --merge --context 4 "$tmp/sh0.csv"

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
