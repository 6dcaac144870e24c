#!/usr/bin/env bash
# test_figures.sh — the figure command on the bundled data (every file made,
# valid, of the expected size, not blank) and the scripts' input checks
# (missing file, missing columns, wrong kind of rows: one line, exit 1).
#   test_figures.sh BUILD_DIR SOURCE_DIR
set -u
build=$1
src=$2
nb=$src/notebooks-export
python=""
for p in ${PYTHON:-} python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import matplotlib, numpy' 2>/dev/null; then python=$p; break; fi
done
if [ -z "$python" ]; then
    echo "SKIP: no python3 with matplotlib and numpy (tools/setup.sh installs python3-matplotlib)"
    exit 77
fi
. "$src/tests/cli_lib.sh"
export MPLBACKEND=Agg # off-screen wherever this runs, also where a display is set

# importing kvqplot leaves a notebook's backend alone (only a script run from the shell picks Agg)
PYTHONPATH=$nb MPLBACKEND=pdf "$python" -c 'import matplotlib, kvqplot, sys; sys.exit(matplotlib.get_backend().lower() != "pdf")' \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: importing kvqplot switched the matplotlib backend"; }

out=$tmp/figs
"$nb/make_figures.sh" --build "$build" "$out" 2>"$tmp/make.err"
rc=$?
[ $rc = 0 ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: make_figures.sh exit $rc"; sed 's/^/  /' "$tmp/make.err" | tail -5; }
"$python" "$src/tests/check_figures.py" "$out" && pass=$((pass + 1)) || fail=$((fail + 1))
# paper style, every script at both widths: sizes, fonts >= 8 pt, no overlapping text,
# distinct legend entries, the provenance caption in the PDF
OPENBLAS_NUM_THREADS=1 "$python" "$src/tests/check_figure_style.py" "$out/data" "$tmp/styled" "$build" \
    && pass=$((pass + 1)) || fail=$((fail + 1))
# --width reaches every script (on the first run's data: --data); a bad one is a usage error
"$nb/make_figures.sh" --build "$build" --width single --data "$out/data" "$tmp/narrow" 2>/dev/null \
    && "$python" -c "import struct,sys; w=struct.unpack('>I', open(sys.argv[1],'rb').read()[16:20])[0]; sys.exit(w != 680)" \
       "$tmp/narrow/error_vs_bits.png" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: --width single"; }
expect 2 "--width wide: expected single or double" -- "$nb/make_figures.sh" --build "$build" --width wide "$tmp/x"

# bad inputs: one line naming the file and what is wrong, exit 1
d=$out/data
# the error-vs-bits table has every family, FP8 and Tender included
for fam in per-token per-channel kivi kcvt absmax gear gear-l cluster lloydmax fp8 tender kvquant turboquant; do
    grep -q "^stories260K.h5,all,all,$fam," "$d/analyze-model.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: $fam not in analyze-model.csv"; }
done
# the cache formats (head_dim 128): FP8, FP4 (mxfp4 4.25 bits, nvfp4 4.5) and llama.cpp's types
for row in ',fp8,fp8:format=e5m2,8.000030517578125,' ',fp4,fp4:format=mxfp4,4.25,4.25,' ',fp4,fp4:format=nvfp4,4.5,4.5,' \
           ',ggml,"ggml:ktype=q4_0,vtype=q4_0",4.5,4.5,'; do
    grep -qF "$row" "$d/analyze-formats.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: $row not in analyze-formats.csv"; }
done
# does the cache still remember: every spec's row over the 120 tasks and its 5 depth rows
[ -s "$out/does_it_remember.png" ] && [ "$(grep -c '^kvq-retrieval,120,' "$d/eval-tasks.csv")" = 29 ] \
    && [ "$(grep -c ',prefill,all,0.8-1,' "$d/eval-tasks.csv")" = 29 ] \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: does_it_remember or its rows missing"; }
sed 's/,exact_ref,/,exactref,/' "$d/eval-tasks.csv" >"$tmp/no-exact.csv"
grep -v ',all,all,' "$d/eval-tasks.csv" >"$tmp/no-all.csv"
expect 1 "no-exact.csv: missing column exact_ref" -- "$python" "$nb/does_it_remember.py" --input "$tmp/no-exact.csv" --out "$tmp/bad"
expect 1 "no-all.csv" "expected compressed specs" -- "$python" "$nb/does_it_remember.py" --input "$tmp/no-all.csv" --out "$tmp/bad"
# compress while generating: 31 rows, 4 windows of 255 positions; a compression while decoding holds at
# most target + interval tokens on average; the figure refuses a run without -q none or cache_tokens
[ -s "$out/compress_while_generating.png" ] && [ "$(grep -c ',decode/context=256,all,' "$d/eval-decoding.csv")" = 31 ] \
    && "$python" - "$d/eval-decoding.csv" <<'PY' && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: compress_while_generating or its rows"; }
import csv, re, sys
rows = list(csv.DictReader(open(sys.argv[1])))
assert all(r["positions"] == str(4 * 255) for r in rows)
for r in rows:
    m = re.search(r"target=(\d+),interval=(\d+)", r["spec"])
    if m:
        assert float(r["cache_tokens"]) <= int(m.group(1)) + int(m.group(2)), r
PY
sed 's/,cache_tokens$/,cachetokens/' "$d/eval-decoding.csv" >"$tmp/no-cache.csv"
grep -v ',none,none,' "$d/eval-decoding.csv" >"$tmp/no-none.csv"
expect 1 "no-cache.csv: missing column cache_tokens" -- "$python" "$nb/compress_while_generating.py" --input "$tmp/no-cache.csv" --out "$tmp/bad"
expect 1 "no-none.csv: no -q none row" -- "$python" "$nb/compress_while_generating.py" --input "$tmp/no-none.csv" --out "$tmp/bad"
sed 's/,attn_rel,/,attn_relx,/' "$d/analyze-model.csv" >"$tmp/no-attn.csv"
sed 's/,point$/,pt/' "$d/sweep-kivi.csv" >"$tmp/no-point.csv"
sed 's/,abs_max,/,absmax,/' "$d/channels.csv" >"$tmp/no-absmax.csv"
cut -d, -f1-5 "$d/values-L1-H0.csv" >"$tmp/no-values.csv"
sed '2s/,0\.[0-9]*,/,oops,/' "$d/analyze-model.csv" >"$tmp/nan.csv"
run() { "$python" "$nb/$1" "${@:2}" --out "$tmp/bad"; }
expect 1 "no-attn.csv: missing column attn_rel (expected kvq-analyze --per model output" -- run error_vs_bits.py --input "$tmp/no-attn.csv"
expect 1 "missing.csv: no such file" -- run error_vs_bits.py --input "$tmp/missing.csv"
expect 1 "analyze-layer.csv: no per-model rows" "--per model" -- run error_vs_bits.py --input "$d/analyze-layer.csv"
expect 1 "nan.csv: column" "expected a number, got 'oops'" -- run error_vs_bits.py --input "$tmp/nan.csv"
expect 1 "no-point.csv: missing column point (expected kvq-sweep output" -- run sweep_heatmap.py --input "$tmp/no-point.csv"
expect 1 "'rank' is not a grid key (grid keys: bits, group, residual)" -- run sweep_heatmap.py --input "$d/sweep-kivi.csv" --x rank
expect 1 "no-attn.csv: missing column attn_rel (expected kvq-analyze --per layer output" -- run layer_profile.py --input "$tmp/no-attn.csv"
expect 1 "analyze-model.csv: no per-layer rows" -- run layer_profile.py --input "$d/analyze-model.csv"
expect 1 "no-absmax.csv: missing column abs_max (expected kvq-info --channels output" -- \
    run channel_magnitudes.py --values "$d/values-L1-H0.csv" --channels "$tmp/no-absmax.csv"
expect 1 "no-values.csv: missing column c0 (expected kvq-info --values L:H output" -- \
    run channel_magnitudes.py --values "$tmp/no-values.csv" --channels "$d/channels.csv"
expect 1 "analyze-model.csv: missing columns budget, mean_bits, dnll, dnll_se (expected kvq-alloc output" -- \
    run alloc_vs_bits.py --input "$d/analyze-model.csv"
expect 1 "analyze-model.csv: no per-model vq rows" -- run vq_coupling.py --analyze "$d/analyze-model.csv"
expect 1 "no-attn.csv: missing column attn_rel (expected kvq-analyze --per model output" -- \
    run vq_coupling.py --analyze "$tmp/no-attn.csv"
expect 1 "analyze-vq.csv: missing columns policy, dnll, dnll_se (expected kvq-eval output" -- \
    run vq_coupling.py --analyze "$d/analyze-vq.csv" --eval "$d/analyze-vq.csv"
# vq's table: every dims at every bits per channel, beside the scalar codes
[ "$(grep -c ',vq,' "$d/analyze-vq.csv")" = 12 ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: 12 vq rows"; }
if [ -r "$d/alloc.csv" ]; then  # made with the bundled model: every budget's allocation and its uniform point
    [ -s "$out/alloc_vs_bits.png" ] && [ "$(grep -c '^[0-9.]*,"\{0,1\}mix(' "$d/alloc.csv")" = 5 ] \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: alloc_vs_bits or its 5 allocations missing"; }
fi
expect 1 "analyze-model.csv: missing columns tokens, policy, dnll, dnll_se, kl (expected kvq-eval --context N output" -- \
    run quantize_or_evict.py --input "$d/analyze-model.csv"
if [ -r "$d/eval-context.csv" ]; then  # made with the bundled model: every spec in a --context row, 381 positions
    [ -s "$out/quantize_or_evict.png" ] && [ "$(grep -c ',prefill/context=384,all,.*,381,' "$d/eval-context.csv")" = 24 ] \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: quantize_or_evict or its 24 rows missing"; }
    grep -v '/context=' "$d/eval-context.csv" | sed '1!d' >"$tmp/no-ctx.csv"
    sed -n 2p "$d/eval-context.csv" | sed 's|prefill/context=384|prefill|' >>"$tmp/no-ctx.csv"
    expect 1 "no-ctx.csv: no prefill/context=N rows (layer all): expected kvq-eval --context N output" -- \
        run quantize_or_evict.py --input "$tmp/no-ctx.csv"
fi
[ ! -e "$tmp/bad" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a rejected input left files in $tmp/bad"; }

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
