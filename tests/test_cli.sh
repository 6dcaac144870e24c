#!/usr/bin/env bash
# test_cli.sh — the tools' behaviour on good and bad input: exit codes (0 ok,
# 1 runtime, 2 usage), exactly one line on stderr naming the file, the object
# and the expectation, and atomic output files.
#   test_cli.sh BUILD_DIR SOURCE_DIR
set -u
build=$1
src=$2
analyze=$build/tools/kvq-analyze
info=$build/tools/kvq-info
gen=$build/tools/kvq-gen
sweep=$build/tools/kvq-sweep
real=$src/data/stories260K.h5
. "$src/tests/cli_lib.sh"

"$build/tests/make-dumps" "$tmp" || { echo "make-dumps failed"; exit 1; }
echo "this is not HDF5" >"$tmp/not-hdf5.h5"
: >"$tmp/empty.h5"
head -c 300000 "$real" >"$tmp/truncated.h5"

# --- malformed dumps: exit 1, one line naming file, object, expectation
expect 1 "$tmp/missing.h5: cannot open: No such file" -- "$analyze" "$tmp/missing.h5"
expect 1 "not-hdf5.h5: not an HDF5 file" -- "$analyze" "$tmp/not-hdf5.h5"
expect 1 "empty.h5: not an HDF5 file" -- "$analyze" "$tmp/empty.h5"
expect 1 "truncated.h5" "truncated" -- "$analyze" "$tmp/truncated.h5"
expect 1 'bad-tag.h5: /kvq_format: expected "kvq-dump/1", got "kvq-dump/2"' -- "$analyze" "$tmp/bad-tag.h5"
expect 1 "missing-attr.h5: /head_dim: missing required attribute" -- "$analyze" "$tmp/missing-attr.h5"
expect 1 "attr-type.h5: /num_heads: expected an integer attribute" -- "$analyze" "$tmp/attr-type.h5"
expect 1 "zero-dim.h5: /seq_len: expected a positive integer, got -5" -- "$analyze" "$tmp/zero-dim.h5"
expect 1 "gqa.h5: /num_heads: expected a multiple of num_kv_heads (4), got 6" -- "$analyze" "$tmp/gqa.h5"
expect 1 "missing-group.h5: /layer_002: missing group" -- "$analyze" "$tmp/missing-group.h5"
expect 1 "missing-key.h5: /layer_001/key: missing required dataset (expected [4,16,8])" -- "$analyze" "$tmp/missing-key.h5"
expect 1 "bad-shape.h5: /layer_003/key: expected [4,16,8], got [4,15,8]" -- "$analyze" "$tmp/bad-shape.h5"
expect 1 "nan.h5: /layer_002/value: expected finite float32 values, got nan at [" -- "$analyze" "$tmp/nan.h5"
expect 1 "f64-overflow.h5: /layer_000/key: expected finite float32 values, got inf" -- "$analyze" "$tmp/f64-overflow.h5"
expect 1 "int-key.h5: /layer_000/key: expected a float16/32/64 dataset" -- "$analyze" "$tmp/int-key.h5"
expect 1 "query-partial.h5: /layer_001/query: expected a dataset, as in /layer_000" -- "$analyze" "$tmp/query-partial.h5"
expect 1 'bad-style.h5: /rope_style: expected "interleaved" or "half", got "sideways"' -- "$analyze" "$tmp/bad-style.h5"
expect 1 "bad-prescaled.h5: /query_prescaled: expected 0 or 1, got 2" -- "$analyze" "$tmp/bad-prescaled.h5"
for f in not-hdf5 truncated bad-shape nan; do
    expect 1 "$f.h5" -- "$info" "$tmp/$f.h5"
done
expect 1 "nan.h5: /layer_002/value" -- "$info" --channels "$tmp/nan.h5"
expect 1 "not-hdf5.h5: not an HDF5 file" -- "$analyze" --calib "$tmp/not-hdf5.h5" "$real"
# hostile-input audit (issue 16): every dataset read is checked when it is read, with the
# standard message (the sign of an infinity kept); a failing kvq-info prints no partial report
expect 1 "query-inf.h5: /layer_001/query: expected finite float32 values, got -inf at [0,0,7]" -- "$info" "$tmp/query-inf.h5"
[ ! -s "$tmp/out" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-info printed a report for a bad dump"; }
expect 1 "query-inf.h5: /layer_001/query: expected finite float32 values, got -inf" -- "$analyze" "$tmp/query-inf.h5"
expect 1 "nan-late.h5: /layer_003/value: expected finite float32 values, got nan" -- "$info" "$tmp/nan-late.h5"
[ ! -s "$tmp/out" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-info printed layers 0-2 before failing at layer 3"; }
expect 1 "huge-seq.h5: /seq_len: expected at most 2147483647, got 68719476736" -- "$info" "$tmp/huge-seq.h5"
expect 0 "dump,layer" -- "$analyze" -q kivi --format csv "$tmp/pre-rope-nan.h5" # key_pre_rope not read: fine
expect 1 "pre-rope-nan.h5: /layer_000/key_pre_rope: expected finite float32 values, got nan" -- "$info" "$tmp/pre-rope-nan.h5"
expect 1 "pre-rope-nan.h5: /layer_000/key_pre_rope: expected finite float32 values, got nan" -- \
    "$analyze" -q cluster --calib "$tmp/pre-rope.h5" "$tmp/pre-rope-nan.h5"
expect 1 "rope-table-nan.h5: /rope_cos: expected finite float32 values, got nan" -- \
    "$analyze" -q cluster --calib "$tmp/pre-rope.h5" "$tmp/rope-table-nan.h5"
expect 0 "dump,layer" -- "$analyze" -q kivi --format csv "$tmp/rope-table-nan.h5" # RoPE not needed: fine
expect 1 "odd-dim.h5: /head_dim: expected an even head_dim to re-apply RoPE (it rotates channel pairs), got 7" -- \
    "$analyze" -q cluster --calib "$tmp/odd-dim.h5" "$tmp/odd-dim.h5"
# a progress line for long analyses: on a terminal after a second, or when asked
expect 0 "kvq-analyze: $real: layer 5/5, metrics" -- "$analyze" --progress always -q kivi -o "$tmp/p.csv" "$real"
expect 2 "--progress sometimes: expected auto, always or never" -- "$analyze" --progress sometimes "$real"
"$analyze" -q kivi -o "$tmp/p.csv" "$real" 2>"$tmp/p.err" # not a terminal: no progress line
[ ! -s "$tmp/p.err" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: progress line without a terminal"; }

# --- valid variants: fixed/variable strings, any integer width, float16 LE/BE
expect 0 "dump,layer" -- "$analyze" --format csv "$tmp/ok-fixed.h5"
expect 0 "dump,layer" -- "$analyze" --format csv "$tmp/ok-vlen-f16.h5"
expect 0 "dump,layer" -- "$analyze" --format csv "$tmp/ok-f16-be.h5"
"$analyze" --format csv "$tmp/ok-vlen-f16.h5" 2>/dev/null | cut -d, -f2- >"$tmp/le.csv"
"$analyze" --format csv "$tmp/ok-f16-be.h5" 2>/dev/null | cut -d, -f2- >"$tmp/be.csv"
if cmp -s "$tmp/le.csv" "$tmp/be.csv" && [ -s "$tmp/le.csv" ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: float16 big- and little-endian dumps disagree"; fi
expect 0 "float16" -- "$info" "$tmp/ok-vlen-f16.h5"

# --- usage errors: exit 2
expect 2 "unknown quantizer 'nope'" -- "$analyze" -q nope "$real"
expect 2 "kivi:foo=1: unknown key 'foo' for kivi (keys: bits, group, residual, kbits, vbits, prerotate)" -- "$analyze" -q kivi:foo=1 "$real"
expect 2 "kivi:bits=99: bits=99: out of range 1..16" -- "$analyze" -q kivi:bits=99 "$real"
expect 2 "residual=100 must be a multiple of group=32" -- "$analyze" -q kivi:residual=100 "$real"
expect 2 "span=x: expected one of head|layer" -- "$analyze" -q per-token:span=x "$real"
expect 2 "unknown option --bogus" -- "$analyze" --bogus "$real"
expect 2 "option -q needs a value" -- "$analyze" "$real" -q
expect 2 "--threads 0: expected an integer" -- "$analyze" --threads 0 "$real"
expect 2 "--threads abc" -- "$analyze" --threads abc "$real"
expect 2 "--seed -1: expected a non-negative integer" -- "$analyze" --seed -1 "$real"
expect 2 "--queries first:3: expected all, last:N, every:N or random:N" -- "$analyze" --queries first:3 "$real"
expect 2 "--queries last:0" -- "$analyze" --queries last:0 "$real"
expect 2 "--per x: expected head, layer or model" -- "$analyze" --per x "$real"
expect 2 "--format xml" -- "$analyze" --format xml "$real"
expect 2 "--layers 3-1" -- "$analyze" --layers 3-1 "$real"
expect 2 "--layers 1,1" -- "$analyze" --layers 1,1 "$real"
expect 2 "stories260K.h5: layer 7: expected 0..4 (the dump has 5)" -- "$analyze" --layers 7 "$real"
expect 2 "stories260K.h5: KV head 4: expected 0..3" -- "$analyze" --heads 4 "$real"
expect 2 "no dump given" -- "$analyze"
expect 2 "--device gpu: expected cpu or cuda" -- "$analyze" --device gpu "$real"
# --device cuda: on a GPU the CSV equals the CPU's to the digits printed
# where the metrics agree (the cuda suite checks 1e-4); elsewhere one line
# saying why, exit 1 -- and the usage errors still come first.
if "$analyze" --device cuda -q kivi --per model --format csv "$real" >"$tmp/gpu.csv" 2>"$tmp/gpu.err"; then
    "$analyze" -q kivi --per model --format csv "$real" >"$tmp/cpu.csv"
    if [ "$(cut -d, -f1-7 "$tmp/gpu.csv")" = "$(cut -d, -f1-7 "$tmp/cpu.csv")" ]; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: --device cuda bits differ"; fi
else
    expect 1 "--device cuda: " "use --device cpu" -- "$analyze" --device cuda "$real"
    grep -qE "no CUDA GPU found|built without CUDA" "$tmp/err" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: --device cuda reason"; }
    expect 1 "--device cuda: " -- "$sweep" --device cuda -q kivi -g bits=2,4 -o "$tmp/gpu-sweep.csv" "$real"
    [ ! -e "$tmp/gpu-sweep.csv" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-sweep left an output without a GPU"; }
fi
# a CUDA build loads its module (libkvq-cuda.so) only for --device cuda: a
# missing module is one clear line, and a CPU run never maps the CUDA runtime
if KVQ_CUDA_MODULE=$tmp/no-such-module.so "$analyze" --device cuda "$real" 2>"$tmp/mod.err" >/dev/null; then
    fail=$((fail + 1)); echo "FAIL: --device cuda with a missing module succeeded"
else
    grep -qE "cannot load the CUDA module \($tmp/no-such-module.so: .*\); set KVQ_CUDA_MODULE|built without CUDA" "$tmp/mod.err" \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: missing CUDA module message"; cat "$tmp/mod.err"; }
fi
if command -v ldd >/dev/null; then
    ! ldd "$analyze" | grep -qE 'libcudart|libcublas' && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-analyze links the CUDA runtime"; }
fi
expect 2 "--device gpu: expected cpu or cuda" -- "$sweep" --device gpu -q kivi -g bits=2,4 -o "$tmp/x.csv" "$real"
expect 2 "unknown key 'nope'" -- "$sweep" --device cuda -q kivi -g nope=1 -o "$tmp/x.csv" "$real"
expect 2 "unknown option --bogus" -- "$info" --bogus "$real"
expect 2 "no dump given" -- "$info"
expect 2 "kvq-gen: error: synthetic dump: 7 heads: expected a multiple of the KV heads (2)" -- "$gen" --heads 7 --kv-heads 2 -o "$tmp/g.h5"
expect 0 "progress.h5: layer 1/2, generating and writing" "layer 2/2" -- "$gen" --layers 2 --progress always -o "$tmp/progress.h5"
expect 2 "--progress sometimes: expected auto, always or never" -- "$gen" --progress sometimes -o "$tmp/g.h5"
expect 2 "kvq-gen: error: synthetic dump: head_dim 7: expected an even number" -- "$gen" --head-dim 7 -o "$tmp/g.h5"
expect 2 "kvq-gen: error: synthetic dump: 99 outlier channels: expected 0..head_dim/2 (32)" -- "$gen" --outliers 99 -o "$tmp/g.h5"
expect 2 "no output given" -- "$gen"
expect 2 "--dtype float8" -- "$gen" --dtype float8 -o "$tmp/g.h5"
[ ! -e "$tmp/g.h5" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-gen left $tmp/g.h5 after a usage error"; }
# kvq-gen's options are rows (tools/kvq-gen.c, cli_optrow): --help lists every row, OUT.meta.json records
# every recorded row as it took effect, and each kind of argument is refused with its one message
"$gen" --help >"$tmp/gen-help.txt"
"$gen" --preset llama3-8b --layers 1 --tokens 64 -o "$tmp/rows.h5" 2>/dev/null
/usr/bin/python3 - "$src/tools/kvq-gen.c" "$tmp/gen-help.txt" "$tmp/rows.h5.meta.json" <<'PY' \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-gen's option rows in --help and OUT.meta.json"; }
import json, re, sys
src, helptext = open(sys.argv[1]).read(), open(sys.argv[2]).read()
rows = re.findall(r'ROW\("([\w-]+)",[^;]*?\.help', src, flags=re.S)
opts = json.load(open(sys.argv[3]))["runs"][-1]["options"]
assert len(rows) >= 20 and all(f"--{n} " in helptext or f"--{n}\n" in helptext for n in rows), rows
assert opts["heads"] == 32 and opts["layers"] == 1 and opts["rope-style"] == "half"  # the preset, then --layers
PY
# every recorded row reaches OUT.meta.json, in the record of the kind of run that records it
# (tests/check_option_record.py; kvq-dump's, kvq-eval's and kvq-alloc's in test_model_cli.sh)
"$gen" --task kv --count 2 --context-tokens 40 -o "$tmp/rows.jsonl" 2>/dev/null
"$analyze" -q kivi --per model -o "$tmp/rows-a.csv" "$real" 2>/dev/null
"$build/tools/kvq-info" --values 0:0 -o "$tmp/rows-i.csv" "$real" 2>/dev/null
for i in 0 1; do
    "$build/tools/kvq-sweep" --quant kivi --grid bits=2,4 --fixed group=8 --shard $i/2 --progress never \
        -o "$tmp/rows-s$i.csv" "$real" 2>/dev/null
done
"$build/tools/kvq-sweep" --merge --expect-grid --quant kivi --grid bits=2,4 --fixed group=8 -o "$tmp/rows-sm.csv" \
    "$tmp/rows-s0.csv" "$tmp/rows-s1.csv" 2>/dev/null
recorded gen rows.h5 rows.jsonl
recorded analyze rows-a.csv
recorded info rows-i.csv
recorded sweep rows-s0.csv rows-sm.csv
# every tool's options are rows (cli_optrow): no tool keeps a getopt switch of its own, and --help lists each row
for t in analyze info sweep dump eval alloc gen; do "$build/tools/kvq-$t" --help >"$tmp/help-$t.txt"; done
/usr/bin/python3 - "$src/tools" "$tmp" <<'PY' && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: option rows"; }
import re, sys
for t in "analyze info sweep dump eval alloc gen".split():
    src, helptext = open(f"{sys.argv[1]}/kvq-{t}.c").read(), open(f"{sys.argv[2]}/help-{t}.txt").read()
    assert "static const cli_optrow rows[]" in src and "switch (c)" not in src, t
    names = re.findall(r'(?:ROW\(|\.name = )"([\w-]+)"', src)
    assert len(names) >= 2, (t, names)
    missing = [n for n in names if f"--{n} " not in helptext and f"--{n}\n" not in helptext]
    assert not missing, (t, missing)
PY
expect 2 "kvq-gen: error: --dtype float8: expected float16, float32 or float64" -- "$gen" --dtype float8 -o "$tmp/g.h5"
expect 2 "kvq-gen: error: --peak -1: expected a positive number" -- "$gen" --peak -1 -o "$tmp/g.h5"
expect 2 "kvq-gen: error: --count 0: expected an integer 1..1000000" -- "$gen" --task kv --count 0 -o "$tmp/g.jsonl"
expect 2 "kvq-gen: error: --seed x: expected a non-negative integer" -- "$gen" --seed x -o "$tmp/g.h5"

# --- help, version, listing
expect 0 "usage: kvq-analyze" -- "$analyze" --help
expect 0 "kvq-analyze 0." "BLAS: OpenBLAS" -- "$analyze" --version
# the BLAS kernels (docs/performance.md#blas-kernels): a core below the CPU's
# (here as if OpenBLAS had detected Prescott) restarts the tool with the
# CPU's; a core the user set is kept
cpu_core=$(env -u OPENBLAS_CORETYPE "$analyze" --version | sed -n 's/.*this CPU runs \([A-Za-z]*\).*/\1/p')
if [ -n "$cpu_core" ] && [ "$cpu_core" != Prescott ]; then
    expect 0 "core $cpu_core, chosen by kvq (OPENBLAS_CORETYPE=$cpu_core; OpenBLAS detected Prescott)" -- \
        env -u OPENBLAS_CORETYPE KVQ_TEST_BLAS_DETECTED=Prescott "$analyze" --version
    expect 0 "core Prescott, OPENBLAS_CORETYPE=Prescott" -- env OPENBLAS_CORETYPE=Prescott "$analyze" --version
    expect 0 "core Prescott, OPENBLAS_CORETYPE=Prescott" -- \
        env OPENBLAS_CORETYPE=Prescott KVQ_TEST_BLAS_DETECTED=Prescott "$analyze" --version
    env -u OPENBLAS_CORETYPE KVQ_TEST_BLAS_DETECTED=Prescott "$analyze" -q kivi -o "$tmp/blas.csv" "$real" 2>/dev/null
    if grep -qF "\"blas_core\": \"$cpu_core\", \"blas_core_source\": \"chosen by kvq (OPENBLAS_CORETYPE=$cpu_core; OpenBLAS detected Prescott)\"" "$tmp/blas.csv.meta.json"; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1)); echo "FAIL: meta of a restarted run does not name the BLAS core"; grep -o '"blas_core[^,]*' "$tmp/blas.csv.meta.json"
    fi
else
    echo "skip: BLAS core checks (no x86-64 core for this CPU: ${cpu_core:-none})"
fi
expect 0 "per-token" "per-channel" "kivi" "kcvt" "absmax" "residual=128" -- "$analyze" --list-quantizers
expect 0 "usage: kvq-info" -- "$info" --help
expect 0 "usage: kvq-gen" -- "$gen" --help

# --- output files: atomic, nothing half-written
expect 0 -- "$analyze" -q kivi -o "$tmp/out.csv" "$real"
head -1 "$tmp/out.csv" | grep -q '^dump,layer,head,quantizer,spec,k_bits,v_bits,k_rel_fro,k_rmse,k_mae,k_max_abs,k_sqnr_db,v_rel_fro,v_rmse,v_mae,v_max_abs,v_sqnr_db,score_rel,attn_rel,attn_kl,attn_top1,out_rel,out_rel_joint,static_bytes,attn_mass$' \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: CSV header"; }
[ "$(wc -l <"$tmp/out.csv")" = 6 ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: expected 5 layer rows"; }
expect 0 -- "$analyze" -q kivi --per model -o "$tmp/out.jsonl" "$real"
grep -q '^{"dump":"stories260K.h5","layer":"all","head":"all","quantizer":"kivi","spec":"kivi","k_bits":3,' "$tmp/out.jsonl" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: JSONL row"; cat "$tmp/out.jsonl"; }
# an error on the second dump: no output file, no temporary left behind
rm -f "$tmp/out2.csv"
expect 1 "nan.h5: /layer_002/value" -- "$analyze" -q kivi -o "$tmp/out2.csv" "$real" "$tmp/nan.h5"
if [ ! -e "$tmp/out2.csv" ] && ! ls "$tmp" | grep -q 'out2.csv.tmp'; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: partial output left"; fi
expect 1 "cannot create output" -- "$analyze" -q kivi -o "$tmp/no/such/dir/out.csv" "$real"

# --- a dump without queries: attention columns are empty, not zero
expect 0 -- "$gen" --no-query --layers 1 --tokens 40 --head-dim 8 -o "$tmp/noq.h5"
"$analyze" -q per-token --format csv "$tmp/noq.h5" | tail -1 | grep -q ',,,,,,,0,$' \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: empty attention cells"; }
# values beyond the fp16 range: a clear error for fp16 scales, fine with fp32
expect 0 -- "$gen" --outlier-scale 100000 --layers 1 --tokens 40 --head-dim 8 -o "$tmp/huge.h5"
expect 1 "huge.h5: /layer_000, key head 0: per-token: scale or zero overflows fp16" "use scale=fp32" -- "$analyze" -q per-token "$tmp/huge.h5"
expect 0 -- "$analyze" -q per-token:scale=fp32 "$tmp/huge.h5"
# ggml's blocks: a q8_0 scale beyond fp16 (values of about 2e7), named with its head
expect 0 -- "$gen" --outlier-scale 10000000 --layers 1 --tokens 40 --head-dim 32 -o "$tmp/huge32.h5"
expect 1 "huge32.h5: ggml: /layer_000, key head 0: a block's fp16 scale overflows (values too large for q8_0)" \
    -- "$analyze" -q ggml "$tmp/huge32.h5"
# the first spec that fails names the error, whether it runs head by head (per-token) or on the layer (tender)
expect 1 "huge.h5: /layer_000, key head 0: per-token: scale or zero overflows fp16" -- "$analyze" -q per-token -q tender "$tmp/huge.h5"
expect 1 "huge.h5: /layer_000, key head 0: tender: scale or zero overflows fp16" -- "$analyze" -q tender -q per-token "$tmp/huge.h5"
# --- calibrated quantizers (issue 3)
calib=$src/data/stories260K-calib.h5
expect 0 "gear" "gear-l" "cluster" "lloydmax" "[needs --calib]" "codebook=sphere" -- "$analyze" --list-quantizers
expect 2 "cluster: needs a calibration dump of the same model" "give it with --calib FILE" -- "$analyze" -q cluster "$real"
expect 2 "lloydmax:codebook=data: needs a calibration dump" -- "$analyze" -q lloydmax:codebook=data "$real"
expect 2 "gear-l:sparsity=0.1: sparsity: gear-l has no outliers" -- "$analyze" -q gear-l:sparsity=0.1 "$real"
expect 2 "gear:lowrank=qr: lowrank=qr: expected one of power|svd" -- "$analyze" -q gear:lowrank=qr "$real"
expect 0 -- "$gen" --layers 1 --tokens 40 --head-dim 12 -o "$tmp/d12.h5"
expect 2 "d12.h5" "rotate=hadamard: head_dim 12 is not a power of two" -- "$analyze" -q lloydmax:rotate=hadamard "$tmp/d12.h5"
expect 1 "d12.h5: /num_layers: expected 5 as in" -- "$analyze" -q cluster --calib "$tmp/d12.h5" "$real"
# --- vq (docs/quantizers.md#vq): each refusal one line naming the key; 2 usage, 1 the data's
expect 0 "vq " "dims=4" "codebook=calib" "[needs --calib]" -- "$analyze" --list-quantizers
expect 2 "stories260K.h5: vq:dims=3: dims=3 does not divide head_dim 8" -- "$analyze" -q vq:dims=3 "$real"
expect 2 "vq: needs a calibration dump of the same model" "give it with --calib FILE" -- "$analyze" -q vq "$real"
expect 2 "vq:bits=13: bits=13: out of range 1..12" -- "$analyze" -q vq:bits=13 "$real"
# at most 2^bits distinct training sub-vectors (layer 0's values repeat with the token): each is a
# centre, k-means' optimum, said once (SPEC 3.10): not an error
expect 0 "kvq-analyze: note: vq: layer 0, value head 0, group 0 (channels 0-3), stage 1: 150 distinct training sub-vectors for the 2^bits = 256 centres: each is a centre (k-means' optimum) (and" \
    -- "$analyze" -q vq --calib "$calib" --format csv "$real"
[ "$(grep -c "note: vq:" "$tmp/err")" = 1 ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: the vq note not said once"; }
expect 0 "note: vq: layer 0, value head 0, group 0 (channels 0-3), stage 1: 144 distinct" -- "$analyze" -q vq:codebook=data --format csv "$real"
# the bar: the bundled dump's layer 0 at vq:dims=8,bits=8 with --calib
expect 0 "vq:dims=8,bits=8" -- "$analyze" -q vq:dims=8,bits=8 --calib "$calib" --layers 0 --per layer --format csv "$real"
python3 -c 'import csv, sys; r = list(csv.DictReader(open(sys.argv[1]))); sys.exit(not (len(r) == 1 and 0 < float(r[0]["v_rel_fro"]) < 1))' "$tmp/out" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: vq:dims=8,bits=8 on layer 0: $(cat "$tmp/out")"; }
expect 1 "ok-fixed.h5: vq:bits=4,codebook=data,space=pre: space=pre codes the keys before RoPE: expected key_pre_rope in the dump" \
    -- "$analyze" -q vq:bits=4,codebook=data,space=pre "$tmp/ok-fixed.h5"
expect 0 "vq:share=layer" -- "$analyze" -q vq:share=layer --calib "$calib" "$real"
# --- fp8 and tender (docs/quantizers.md): listed, in the default set, usage errors name the key
expect 0 "fp8 " "format=e4m3" "none|tensor|head|token|channel" "tender " "alpha=2" "chunk=256" "span=layer" -- "$analyze" --list-quantizers
expect 2 "fp8:format=e4m4: format=e4m4: expected one of e4m3|e5m2" -- "$analyze" -q fp8:format=e4m4 "$real"
expect 2 "fp8:scale=block: scale=block: expected one of none|tensor|head|token|channel" -- "$analyze" -q fp8:scale=block "$real"
expect 2 "tender:alpha=1: alpha=1: out of range 2..256" -- "$analyze" -q tender:alpha=1 "$real"
expect 2 "tender:groups=65: groups=65: out of range 1..64" -- "$analyze" -q tender:groups=65 "$real"
expect 2 "tender:groups=0: groups=0: out of range 1..64" -- "$analyze" -q tender:groups=0 "$real"
expect 2 "tender:bits=1: bits=1: out of range 2..16" -- "$analyze" -q tender:bits=1 "$real"
expect 2 "tender:chunk=-1: chunk=-1: out of range 0..1000000000" -- "$analyze" -q tender:chunk=-1 "$real"
expect 1 "huge.h5: /layer_000, key head 0: tender: scale or zero overflows fp16" "use scale=fp32" -- "$analyze" -q tender "$tmp/huge.h5"
expect 0 -- "$analyze" -q tender:scale=fp32 -q fp8 "$tmp/huge.h5"
# --- the frontier families (docs/quantizers.md)
expect 0 "ggml " "ktype=q8_0" "iq4_nl" "fp4 " "format=mxfp4" "global=none" "kvquant " "codebook=nuq" "turboquant " "variant=prod" "prerotate=none" -- "$analyze" --list-quantizers
expect 2 "kvquant: needs a calibration dump" -- "$analyze" -q kvquant "$real"
expect 0 "kvquant" -- "$analyze" -q kvquant --calib "$calib" --per model "$real"
expect 0 "kvquant:codebook=uniform" -- "$analyze" -q kvquant:codebook=uniform --per model "$real"
expect 2 "turboquant:bits=1: bits=1: variant=prod needs bits >= 2" -- "$analyze" -q turboquant:bits=1 "$real"
expect 2 "ggml:ktype=q3_K: ktype=q3_K: expected one of q8_0|q4_0|q4_1|q5_0|q5_1|iq4_nl|f16|bf16" -- "$analyze" -q ggml:ktype=q3_K "$real"
expect 2 "per-token:prerotate=fwht: prerotate=fwht: expected one of none|hadamard|qr" -- "$analyze" -q per-token:prerotate=fwht "$real"
expect 2 "d12.h5" "not a power of two" -- "$analyze" -q kivi:prerotate=hadamard "$tmp/d12.h5"
# llama.cpp's block rule: head_dim a multiple of the block (a block never spans heads), else
# exit 2 naming the rule; the default set leaves ggml and fp4 out with a note
expect 2 "d12.h5: ggml: ktype=q8_0: head_dim 12 is not a multiple of the 32-value blocks (llama.cpp refuses it" -- \
    "$analyze" -q ggml "$tmp/d12.h5"
expect 2 "stories260K.h5: ggml:vtype=q8_0,ktype=f16: vtype=q8_0: head_dim 8 is not a multiple" -- \
    "$analyze" -q ggml:vtype=q8_0,ktype=f16 "$real"
expect 0 -- "$analyze" -q ggml:ktype=f16,vtype=bf16 "$real"
expect 2 "stories260K.h5: fp4:format=nvfp4: head_dim 8 is not a multiple of the 16-value blocks" -- \
    "$analyze" -q fp4:format=nvfp4 "$real"
expect 2 "fp4:global=token: global: a second-level scale is nvfp4's" -- "$analyze" -q fp4:global=token "$real"
"$gen" --layers 1 --tokens 40 --head-dim 32 -o "$tmp/d32.h5" 2>/dev/null
"$analyze" --per model --format csv "$tmp/d32.h5" >"$tmp/def32.csv" 2>"$tmp/def32.err"
grep -q ',ggml,ggml,8.5,8.5,' "$tmp/def32.csv" && grep -q ',fp4,fp4,4.25,4.25,' "$tmp/def32.csv" && ! grep -q 'head_dim' "$tmp/def32.err" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: default set on head_dim 32 has ggml and fp4"; cat "$tmp/def32.err"; }
# default set: without --calib cluster is skipped with a note after the results, with it included
"$analyze" --per model --format csv "$real" >"$tmp/def.csv" 2>"$tmp/def.err"
grep -q 'without cluster, kvquant: needs --calib' "$tmp/def.err" && ! grep -q ',cluster,' "$tmp/def.csv" && ! grep -q ',kvquant,' "$tmp/def.csv" && grep -q ',gear,' "$tmp/def.csv" \
    && grep -q ',fp8,fp8,8.001953125,' "$tmp/def.csv" && grep -q ',tender,tender,4.076171875,' "$tmp/def.csv" \
    && grep -q ',lloydmax,' "$tmp/def.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: default set without --calib"; }
"$analyze" --per model --format csv --calib "$calib" "$real" >"$tmp/def.csv" 2>"$tmp/def.err"
grep -q ',cluster,' "$tmp/def.csv" && ! grep -q 'needs --calib' "$tmp/def.err" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: default set with --calib"; }
# head_dim 8: ggml and fp4 left out, with a note after the results
grep -q 'note: default set without fp4, ggml: head_dim 8 is not a multiple of their blocks (llama.cpp refuses' "$tmp/def.err" \
    && ! grep -q ',ggml,' "$tmp/def.csv" && ! grep -q ',fp4,' "$tmp/def.csv" && [ "$(wc -l <"$tmp/def.err")" = 1 ] \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: default set on head_dim 8 without ggml and fp4"; cat "$tmp/def.err"; }
# cluster rows carry static bytes, uniform quantizers none
awk -F, '$4 == "cluster" && $(NF-1) > 0 {c++} $4 == "kivi" && $(NF-1) == 0 {k++} END {exit !(c == 1 && k == 1)}' "$tmp/def.csv" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: static_bytes column"; }

# float16 generation and the kvq-info channel CSV
expect 0 -- "$gen" --dtype float16 --layers 1 --tokens 33 --head-dim 16 -o "$tmp/f16.h5"
expect 0 "dump,layer,head,tensor,channel,abs_max,abs_mean,rms" -- "$info" --channels "$tmp/f16.h5"

# kvq-info --values: one KV head token by token; bad selections are usage errors
"$info" --values 1:2 "$real" >"$tmp/values.csv"
[ "$(head -1 "$tmp/values.csv")" = "dump,layer,head,tensor,token,c0,c1,c2,c3,c4,c5,c6,c7" ] \
    && [ "$(grep -c '^stories260K.h5,1,2,key,' "$tmp/values.csv")" = 512 ] \
    && [ "$(grep -c '^stories260K.h5,1,2,value,' "$tmp/values.csv")" = 512 ] \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-info --values rows"; }
expect 2 "stories260K.h5: --values 5:0: expected layer 0..4 and KV head 0..3" -- "$info" --values 5:0 "$real"
expect 2 "--values 1: expected LAYER:HEAD" -- "$info" --values 1 "$real"
expect 2 "--channels and --values write different tables" -- "$info" --channels --values 0:0 "$real"
expect 1 "f16.h5: /head_dim: expected 8 like the first dump" -- "$info" --values 0:0 "$real" "$tmp/f16.h5"

# --- output targets (issue 16): atomic replace is for regular files only
check() { # 'what' command...: one pass or fail for a shell condition
    local what=$1
    shift
    if "$@"; then pass=$((pass + 1)); else fail=$((fail + 1)); echo "FAIL: $what"; fi
}
o=$tmp/outs
mkdir -p "$o/sub"
echo old >"$o/real.csv"
chmod 640 "$o/real.csv"
ln -s real.csv "$o/link.csv"
expect 0 -- "$analyze" -q kivi -o "$o/link.csv" "$real"
check "-o a symlink: the link stays, its target is written" [ -L "$o/link.csv" ]
check "-o a symlink: target has the table" grep -q '^dump,layer' "$o/real.csv"
check "-o an existing file keeps its mode" [ "$(stat -c %a "$o/real.csv")" = 640 ]
ln -s sub/new.csv "$o/dangling.csv"
expect 0 -- "$analyze" -q kivi -o "$o/dangling.csv" "$real"
check "-o a dangling symlink: written where it points" [ -L "$o/dangling.csv" -a -s "$o/sub/new.csv" ]
(umask 027 && "$analyze" -q kivi -o "$o/masked.csv" "$real")
check "a new result gets 0666 & ~umask" [ "$(stat -c %a "$o/masked.csv")" = 640 ]
(umask 002 && "$analyze" -q kivi -o "$o/open.csv" "$real")
check "a new result gets 0666 & ~umask (002)" [ "$(stat -c %a "$o/open.csv")" = 664 ]
mkfifo "$o/fifo"
cat "$o/fifo" >"$o/from-fifo" &
reader=$!
expect 0 -- "$analyze" -q kivi -o "$o/fifo" "$real"
wait $reader
check "-o a FIFO: written through, still a FIFO" [ -p "$o/fifo" -a "$(wc -l <"$o/from-fifo")" = 6 ]
if [ -w /dev/full ]; then
    expect 1 "/dev/full: write failed: No space left on device" -- "$analyze" -q kivi -o /dev/full "$real"
    check "-o /dev/full: still a device" [ -c /dev/full ]
fi
expect 1 "cannot write the output: it is a directory" -- "$analyze" -q kivi -o "$o/sub" "$real"
# SIGTERM part-way: the temporary is removed, nothing is left
# sigterm_leaves_nothing NAME command...: NAME is the output's file name in $o
sigterm_leaves_nothing() {
    local name=$1
    shift
    "$@" 2>"$tmp/victim.err" &
    local victim=$!
    for _ in $(seq 50); do ls "$o" | grep -q "$name.tmp" && break; sleep 0.1; done
    kill -TERM $victim
    wait $victim
    check "$name: SIGTERM gives exit 143" [ $? = 143 ]
    check "$name: SIGTERM says nothing was written" grep -q "interrupted: nothing written" "$tmp/victim.err"
    check "$name: SIGTERM leaves no temporary and no result" [ -z "$(ls "$o" | grep "$name")" ]
}
"$gen" --layers 2 --tokens 4096 --heads 8 --kv-heads 4 --head-dim 64 -o "$tmp/big.h5" 2>/dev/null
sigterm_leaves_nothing term.csv "$analyze" -q gear:lowrank=svd -q gear -q lloydmax -o "$o/term.csv" "$tmp/big.h5"
# the same for a dump being written (kvq-gen; kvq-dump shares the writer and the hook)
sigterm_leaves_nothing gen.h5 "$gen" --preset llama3-8b --tokens 8192 -o "$o/gen.h5"

# integer values print as integers (docs/tools.md): v_bits 10, static_bytes 25920,
# never 1e+01 / 2.592e+04
"$analyze" -q kivi:bits=4 --per model --format csv "$src/data/stories260K.h5" >"$tmp/int.csv" 2>/dev/null
"$analyze" -q cluster:centroids=16 --calib "$src/data/stories260K-calib.h5" --per model --format jsonl "$src/data/stories260K.h5" >"$tmp/int.jsonl" 2>/dev/null
awk -F, 'NR == 2 && $7 == "10" && $24 == "0" {ok = 1} END {exit !ok}' "$tmp/int.csv" && grep -q '"static_bytes": *25920[,}]' "$tmp/int.jsonl" \
    && ! grep -q 'e+0' "$tmp/int.csv" "$tmp/int.jsonl" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: integers in exponent form"; cat "$tmp/int.csv" "$tmp/int.jsonl"; }
# -o that is one of the run's inputs (by inode: ./x and x are one file) is a usage error and
# nothing is written; -o "" too (docs/tools.md)
cp "$src/data/stories260K.h5" "$tmp/in.h5"
cp "$src/data/stories260K-calib.h5" "$tmp/cal.h5"
sum0=$(cksum <"$tmp/in.h5")
expect 2 "that is an input of this run" -- env -C "$tmp" "$analyze" -q kivi -o ./in.h5 in.h5
expect 2 "that is an input of this run" -- "$analyze" -q cluster --calib "$tmp/cal.h5" -o "$tmp/cal.h5" "$tmp/in.h5"
expect 2 "that is an input of this run" -- "$build/tools/kvq-info" -o "$tmp/in.h5" "$tmp/in.h5"
expect 2 "that is an input of this run" -- "$build/tools/kvq-sweep" "$tmp/in.h5" --quant kivi --grid bits=2,4 -o "$tmp/in.h5"
ln -sf "$tmp/in.h5" "$tmp/link.h5"
expect 2 "that is an input of this run" -- "$analyze" -q kivi -o "$tmp/link.h5" "$tmp/in.h5"
[ "$(cksum <"$tmp/in.h5")" = "$sum0" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: an input was overwritten"; }
# OUT.meta.json gets the checks -o gets (issue #36): a link from it to an input, or an input
# under its name, is a usage error before any work; a FIFO or directory there is refused
# instead of blocking the run or failing it at the end
ln -s "$tmp/in.h5" "$tmp/r.csv.meta.json"
expect 2 "r.csv.meta.json (the provenance record of -o): that is an input of this run" -- "$analyze" -q per-token --per model -o "$tmp/r.csv" "$tmp/in.h5"
expect 2 "r.csv.meta.json (the provenance record of -o): that is an input of this run" -- "$build/tools/kvq-info" -o "$tmp/r.csv" "$tmp/in.h5"
expect 2 "r.csv.meta.json (the provenance record of -o): that is an input of this run" -- "$build/tools/kvq-sweep" "$tmp/in.h5" --quant kivi --grid bits=2,4 -o "$tmp/r.csv"
[ "$(cksum <"$tmp/in.h5")" = "$sum0" ] && [ ! -e "$tmp/r.csv" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a meta link overwrote an input"; }
mkfifo "$tmp/ff.csv.meta.json" && mkdir "$tmp/dd.csv.meta.json"
expect 2 "ff.csv.meta.json (the provenance record of -o): not a regular file (a FIFO)" -- timeout 20 "$analyze" -q kivi -o "$tmp/ff.csv" "$tmp/in.h5"
expect 2 "dd.csv.meta.json (the provenance record of -o): not a regular file (a directory)" -- timeout 20 "$analyze" -q kivi -o "$tmp/dd.csv" "$tmp/in.h5"
expect 2 "ff.csv.meta.json (the provenance record of -o): not a regular file (a FIFO)" -- timeout 20 "$build/tools/kvq-gen" -o "$tmp/ff.csv"
# a symlink loop at -o is refused with exit 1 and left as it is; a dangling link is written
# through (kvq-sweep too), and where its directory is missing the message names both
ln -s loop-b "$o/loop-a" && ln -s loop-a "$o/loop-b"
expect 1 "loop-a: cannot write the output: a symlink loop" -- "$analyze" -q kivi -o "$o/loop-a" "$tmp/in.h5"
expect 1 "loop-a: cannot write the output: a symlink loop" -- "$build/tools/kvq-info" -o "$o/loop-a" "$tmp/in.h5"
expect 1 "loop-a: cannot write the output: a symlink loop" -- "$build/tools/kvq-gen" -o "$o/loop-a"
expect 1 "loop-a: cannot write the output: a symlink loop" -- "$build/tools/kvq-sweep" "$tmp/in.h5" --quant kivi --grid bits=2,4 -o "$o/loop-a"
check "-o a symlink loop: both links kept" [ -L "$o/loop-a" -a -L "$o/loop-b" ]
ln -s swept.csv "$o/sweep-link.csv"
expect 0 -- "$build/tools/kvq-sweep" "$tmp/in.h5" --quant kivi --grid bits=2,4 -o "$o/sweep-link.csv"
check "kvq-sweep -o a dangling symlink: written where it points" [ -L "$o/sweep-link.csv" -a -s "$o/swept.csv" ]
expect 0 -- "$build/tools/kvq-sweep" "$tmp/in.h5" --quant kivi --grid bits=2,4,8 -o "$o/sweep-link.csv" --resume
check "kvq-sweep --resume through a symlink: the link kept, the target continued" \
    [ -L "$o/sweep-link.csv" -a "$(grep -c 'kivi:bits=2' "$o/swept.csv")" -gt 0 -a "$(grep -c 'kivi:bits=8' "$o/swept.csv")" -gt 0 ]
ln -s no-such-dir/x.csv "$o/nodir.csv"
expect 1 "nodir.csv: cannot create" "no-such-dir/x.csv, where the symlink points: No such file or directory" -- "$analyze" -q kivi -o "$o/nodir.csv" "$tmp/in.h5"
expect 1 "nodir.csv: cannot create" "where the symlink points: No such file or directory" -- "$build/tools/kvq-sweep" "$tmp/in.h5" --quant kivi --grid bits=2 -o "$o/nodir.csv"
# a write that fails part-way (EFBIG under a file-size limit, as ENOSPC would) names the
# system error, for the HDF5 writer too, and leaves no temporary behind
expect 1 "big-out.h5: /layer_000: cannot write: File too large" -- sh -c 'trap "" XFSZ; ulimit -f 100; exec "$1" -o "$2"' sh "$build/tools/kvq-gen" "$o/big-out.h5"
expect 1 "big-out.csv: write failed: File too large" -- sh -c 'trap "" XFSZ; ulimit -f 1; exec "$1" -q kivi -o "$2" "$3"' sh "$analyze" "$o/big-out.csv" "$tmp/in.h5"
check "a failed write leaves nothing" [ -z "$(ls "$o" | grep big-out)" ]
expect 2 "-o: expected a file name" -- "$analyze" -q kivi -o "" "$tmp/in.h5"
expect 2 "-o: expected a file name" -- "$build/tools/kvq-gen" -o ""
# what a tool prints must reach stdout: --help and --list-quantizers into /dev/full exit 1
if [ -w /dev/full ]; then
    for t in analyze info gen sweep dump eval; do
        "$build/tools/kvq-$t" --help >/dev/full 2>"$tmp/full.err"
        rc=$?
        [ $rc = 1 ] && grep -q "standard output: write failed" "$tmp/full.err" && pass=$((pass + 1)) \
            || { fail=$((fail + 1)); echo "FAIL: kvq-$t --help >/dev/full: exit $rc"; }
    done
    expect 1 "write failed" -- sh -c '"$1" --list-quantizers >/dev/full' sh "$analyze"
fi
# --- mix (docs/quantizers.md#mix): per-layer rows name the layer's spec; bits pool over layers
mixs='mix(0-1=kivi:kbits=4,vbits=2;2-=per-token:bits=2)'
# every tool's --help fits 80 columns
for t in kvq-analyze kvq-info kvq-gen kvq-sweep kvq-dump kvq-eval kvq-alloc; do
    [ -x "$build/tools/$t" ] || continue
    wide=$("$build/tools/$t" --help 2>&1 | awk 'length > 80' | head -n 2)
    [ -z "$wide" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: $t --help is wider than 80 columns: $wide"; }
done
expect 0 "mix(RANGE=SPEC;...)" "tokens(SELECT; HI; LO)" "snapkv " "obs=64" "[reads the queries]" "[1..1000000000]" -- "$analyze" --list-quantizers
expect 0 '0,all,mix,"kivi:kbits=4,vbits=2",5,8.5,' '4,all,mix,per-token:bits=2,6,6,' -- \
    "$analyze" -q "$mixs" --per layer --format csv "$real"
expect 0 "all,all,mix,\"$mixs\",5.6,7," -- "$analyze" -q "$mixs" --per model --format csv "$real"
# none (the exact cache) wherever a spec goes: alone (16 bits, no error) and as a range of a mix, whose
# other layers are the plain spec's rows (SPEC 10)
"$analyze" -q none -q 'mix(0=none;1-=kivi:bits=2)' -q kivi:bits=2 --per layer --format csv "$real" >"$tmp/none.csv" 2>/dev/null
python3 - "$tmp/none.csv" <<'PY' && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: none and mix(0=none;...)"; }
import csv, sys
rows = list(csv.DictReader(open(sys.argv[1])))
none = [r for r in rows if r["spec"] == "none" and r["quantizer"] == "none"]
mixed = {r["layer"]: r for r in rows if r["quantizer"] == "mix"}
kivi = {r["layer"]: r for r in rows if r["quantizer"] == "kivi"}
strip = lambda r: {k: v for k, v in r.items() if k not in ("quantizer", "spec")}
sys.exit(not (none and all(float(r["k_bits"]) == 16 and float(r["k_rel_fro"]) == 0 for r in none)
              and mixed["0"]["spec"] == "none" and float(mixed["0"]["k_rel_fro"]) == 0
              and all(strip(mixed[l]) == strip(kivi[l]) for l in kivi if l != "0")))
PY
expect 2 "layer 4 is in no range (every layer needs one)" -- "$analyze" -q 'mix(0-3=kivi)' "$real"
expect 2 "mix(0-=cluster): needs a calibration dump" -- "$analyze" -q 'mix(0-=cluster)' "$real"
expect 2 "range 1-: kivi:bitz=2: unknown key 'bitz'" -- "$analyze" -q 'mix(0=fp8;1-=kivi:bitz=2)' "$real"
expect 2 "mix(0-4,=kivi): range '0-4,': expected layers as a, a-b, a- or a,b" -- "$analyze" -q 'mix(0-4,=kivi)' "$real"

# --- tokens(SELECT; HI; LO) (docs/quantizers.md#tokens)
# keep=1 is the spec itself: every column but quantizer and spec
"$analyze" -q kivi:bits=2 -q 'tokens(h2o:keep=1; kivi:bits=2; drop)' --per layer --format csv "$real" >"$tmp/tok1.csv"
awk -F, 'NR > 1 {key = $1 FS $2 FS $3; $4 = $5 = ""; row[key] = row[key] "|" $0; n[key]++}
    END {for (k in n) {split(row[k], r, "|"); if (n[k] != 2 || r[2] != r[3]) exit 1} exit !length(n)}' "$tmp/tok1.csv" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: tokens(h2o:keep=1; SPEC; drop) differs from SPEC"; }
# dropping keeps a share of the attention, keeping all of it the whole; threads change nothing
tk='tokens(snapkv:keep=0.25,obs=16; kivi:bits=4; drop)'
"$analyze" -q kivi:bits=4 -q "$tk" --per model --format csv --threads 1 "$real" >"$tmp/tok2.csv"
"$analyze" -q kivi:bits=4 -q "$tk" --per model --format csv --threads 2 "$real" >"$tmp/tok3.csv"
cmp -s "$tmp/tok2.csv" "$tmp/tok3.csv" && awk -F, 'NR == 2 && $NF == 1 {a++} NR == 3 && $NF > 0.5 && $NF < 1 {b++} END {exit !(a && b)}' \
    "$tmp/tok2.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: tokens attn_mass or threads"; cat "$tmp/tok2.csv"; }
expect 1 "tokens(h2o:keep=0.5; none; drop): h2o:keep=0.5: the h2o selector scores tokens by attention: expected the queries" -- \
    "$analyze" -q 'tokens(h2o:keep=0.5; none; drop)' "$tmp/noq.h5"
expect 0 -- "$analyze" -q 'tokens(knorm:keep=0.5; none; drop)' -q 'tokens(window:sinks=2,recent=8; none; drop)' "$tmp/noq.h5"
expect 2 "tokens(h2o; none; drop): h2o: h2o needs keep=SHARE" -- "$analyze" -q 'tokens(h2o; none; drop)' "$real"
expect 2 "HI is drop" -- "$analyze" -q 'tokens(h2o:keep=0.5; drop; none)' "$real"
expect 2 "unknown selector 'nope'" -- "$analyze" -q 'tokens(nope:keep=0.5; none; drop)' "$real"
expect 2 "LO: kivi:bitz=2: unknown key 'bitz'" -- "$analyze" -q 'tokens(h2o:keep=0.5; none; kivi:bitz=2)' "$real"
expect 2 "needs a calibration dump" -- "$analyze" -q 'tokens(h2o:keep=0.5; cluster; drop)' "$real"
expect 0 ',0,all,mix,"tokens(window:sinks=2,recent=8; none; drop)",' -- \
    "$analyze" -q 'mix(0=tokens(window:sinks=2,recent=8; none; drop);1-=kivi)' --per layer --format csv "$real"

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
