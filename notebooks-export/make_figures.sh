#!/usr/bin/env bash
# make_figures.sh — regenerate every figure from the bundled data: run the kvq
# tools on data/stories260K.h5 (calibrated families on stories260K-calib.h5)
# into OUTDIR/data/ (each result with its OUT.meta.json), then each figure
# script, writing OUTDIR/*.png and *.pdf (the PDF's metadata names the commands).
#   notebooks-export/make_figures.sh [--build DIR] [--width single|double] [--readme] [OUTDIR]
#     --build DIR  where the kvq tools were built (default: build)
#     --width W    single (3.4 in, one column) or double (7 in, default) column figures
#     --readme     also refresh the images the README shows (notebooks-export/img/)
#     --data DIR   plot an earlier run's data (its OUTDIR/data) instead of running the tools
#     OUTDIR       default: figures
# tools/setup.sh figures installs what is missing, builds, and runs this.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
build=$root/build
readme=0
reuse=""
width=double
out=figures
while [ $# -gt 0 ]; do
    case "$1" in
    --build) build=$(cd "$2" && pwd); shift 2 ;;
    --readme) readme=1; shift ;;
    --data) reuse=$(cd "$2" && pwd) || exit 2; shift 2 ;;
    --width)
        case "${2:-}" in single|double) width=$2 ;; *) echo "make_figures: error: --width ${2:-}: expected single or double" >&2; exit 2 ;; esac
        shift 2 ;;
    -h|--help) sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "make_figures: error: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) out=$1; shift ;;
    esac
done
for t in kvq-analyze kvq-sweep kvq-info kvq-gen kvq-eval; do
    [ -x "$build/tools/$t" ] || { echo "make_figures: error: $build/tools/$t: not built (run tools/setup.sh build)" >&2; exit 1; }
done
# a Python 3 with matplotlib: Debian's (python3-matplotlib) even when another python3 comes first on PATH
python=""
for p in ${PYTHON:-} python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null && "$p" -c 'import matplotlib, numpy' 2>/dev/null; then python=$p; break; fi
done
[ -n "$python" ] || { echo "make_figures: error: no python3 with matplotlib and numpy (apt-get install python3-matplotlib python3-numpy, or tools/setup.sh figures)" >&2; exit 1; }

dump=$root/data/stories260K.h5
calib=$root/data/stories260K-calib.h5
mkdir -p "$out/data"
data=${reuse:-$out/data}
bin=$build/tools
# each step says when it starts and how long the run has taken; the tools show their
# own progress (layer by layer, pass by pass) when stderr is a terminal
start=$SECONDS
say() { printf 'make_figures: [%3d s] %s\n' $((SECONDS - start)) "$*" >&2; }

if [ -n "$reuse" ]; then # the tools' outputs are there: what was made decides what is drawn
    with_tasks=0 with_model=0
    [ -r "$data/eval-tasks.csv" ] && [ -r "$data/eval-decoding.csv" ] && with_tasks=1
    [ -r "$data/eval-context.csv" ] && with_model=1
else
say "kvq-info: channel magnitudes, layer 1 KV head 0 token by token"
"$bin/kvq-info" --channels -o "$data/channels.csv" "$dump"
"$bin/kvq-info" --values 1:0 -o "$data/values-L1-H0.csv" "$dump"

say "kvq-analyze: every family at several bit widths, per model and per layer"
specs=()
for b in 2 3 4 8; do specs+=(-q "per-token:bits=$b"); done
for b in 2 3 4; do specs+=(-q "per-channel:bits=$b" -q "kivi:bits=$b,group=32,residual=32" -q "kcvt:bits=$b"); done
for b in 4 6 8; do specs+=(-q "absmax:bits=$b"); done
for b in 2 4; do specs+=(-q "gear:bits=$b,rank=2,lowrank=svd" -q "gear-l:bits=$b,rank=2,lowrank=svd"); done
for b in 1 2 3 4; do specs+=(-q "lloydmax:bits=$b"); done
for c in 4 16 64; do specs+=(-q "cluster:centroids=$c"); done
for f in e4m3 e5m2; do specs+=(-q "fp8:format=$f" -q "fp8:format=$f,scale=token"); done
for b in 3 4 8; do specs+=(-q "tender:bits=$b"); done
for b in 2 3 4; do specs+=(-q "kvquant:bits=$b" -q "turboquant:bits=$b"); done
"$bin/kvq-analyze" "${specs[@]}" --calib "$calib" --per model -o "$data/analyze-model.csv" "$dump"
"$bin/kvq-analyze" -q per-token:bits=4 -q kivi:bits=2,group=32,residual=32 -q kcvt:bits=2 \
    -q gear:bits=2,rank=2,lowrank=svd -q lloydmax:bits=2 -q cluster:centroids=16 \
    --calib "$calib" --per layer -o "$data/analyze-layer.csv" "$dump"

# the deployed cache formats need head_dim a multiple of their blocks (llama.cpp's rule;
# the bundled model's is 8): compared on a synthetic dump of Llama-3-8B's attention shape
say "kvq-gen + kvq-analyze: cache formats (FP8, FP4, llama.cpp types) on a Llama-3-8B-shaped dump"
"$bin/kvq-gen" --preset llama3-8b --layers 2 --tokens 1024 --progress never -o "$data/llama3-8b-shape.h5"
fspecs=()
for f in e4m3 e5m2; do fspecs+=(-q "fp8:format=$f"); done
fspecs+=(-q fp4:format=mxfp4 -q fp4:format=nvfp4 -q fp4:format=nvfp4,global=tensor)
for t in q8_0 q5_1 q4_0 iq4_nl; do fspecs+=(-q "ggml:ktype=$t,vtype=$t"); done
for b in 2 4; do fspecs+=(-q "kivi:bits=$b" -q "turboquant:bits=$((b + 1))"); done
for b in 4 8; do fspecs+=(-q "per-token:bits=$b"); done
"$bin/kvq-analyze" "${fspecs[@]}" --per model -o "$data/analyze-formats.csv" "$data/llama3-8b-shape.h5"

# vq: 1, 2, 4 and 8 coupled channels at 1, 2 and 4 bits per channel (codes of at most 8
# bits, more as residual stages; share=layer: layer 0's values repeat with the token, too
# few distinct per head for 256 centres), beside scalar codes at 1, 2 and 4 bits
vspecs=()
for c in 1 2 4 8; do
    for bc in 1 2 4; do
        t=$((c * bc))
        if [ $t -le 8 ]; then vspecs+=(-q "vq:dims=$c,bits=$t,share=layer"); else vspecs+=(-q "vq:dims=$c,bits=8,stages=$((t / 8)),share=layer"); fi
    done
done
for b in 1 2 4; do vspecs+=(-q "per-channel:bits=$b" -q "kivi:bits=$b,group=32,residual=32" -q "lloydmax:bits=$b"); done
say "kvq-analyze: vq's coupled channels against scalar codes"
"$bin/kvq-analyze" "${vspecs[@]}" --calib "$calib" --per model -o "$data/analyze-vq.csv" "$dump"

say "kvq-sweep: KIVI group x residual x bits"
rm -f "$data/sweep-kivi.csv"
"$bin/kvq-sweep" "$dump" --quant kivi --grid bits=2,4 --grid group=16,32,64,128 --grid residual=0,32,64,128 \
    --per model --progress never -o "$data/sweep-kivi.csv"

# does the cache still remember? The project's own model (data/kvq-retrieval.gguf) on kv
# tasks of 256 context tokens: every compressed cache against the exact one
rmodel=$root/data/kvq-retrieval.gguf
if [ -r "$rmodel" ] && [ -x "$bin/kvq-gen" ] && [ -x "$bin/kvq-eval" ]; then
    say "kvq-gen --task kv + kvq-eval --tasks: recall under quantization and eviction"
    "$bin/kvq-gen" --task kv --count 120 --context-tokens 256 --seed 11 -o "$data/tasks-kv.jsonl"
    tspecs=(-q none)
    for b in 2 4; do tspecs+=(-q "kivi:bits=$b"); done
    for b in 2 3 4 8; do tspecs+=(-q "per-token:bits=$b"); done
    tspecs+=(-q fp8 -q ggml:ktype=q4_0,vtype=q4_0 -q lloydmax)
    for kr in 0.125:28 0.25:60 0.5:124 0.75:188; do # each selector keeping a fraction; a window of that size
        k=${kr%:*}
        tspecs+=(-q "tokens(snapkv:keep=$k; none; drop)" -q "tokens(h2o:keep=$k; none; drop)" \
                 -q "tokens(knorm:keep=$k; none; drop)" -q "tokens(window:sinks=4,recent=${kr#*:}; none; drop)")
    done
    tspecs+=(-q "tokens(snapkv:keep=0.5; kivi:bits=4; drop)" -q "tokens(snapkv:keep=0.25; kivi:bits=2; drop)" \
             -q "tokens(h2o:keep=0.25; none; kivi:bits=2)")
    "$bin/kvq-eval" "$rmodel" --tasks "$data/tasks-kv.jsonl" "${tspecs[@]}" --calib "$root/data/kvq-retrieval-calib.h5" \
        --per-depth 0.2 -o "$data/eval-tasks.csv"
    # compress while generating? 4 windows of 512 tokens (kv task contexts): a 256-token context, then
    # 255 generated positions; each selector compressing to S every 16 tokens, once, and quantization
    say "kvq-eval --context 256 --policy decode: compressing while generating, once, or quantizing"
    "$bin/kvq-gen" --task kv --count 16 --context-tokens 512 --seed 17 -o "$data/tasks-gen.jsonl"
    "$python" -c 'import json, sys; print(" ".join(json.loads(l)["context"] for l in open(sys.argv[1])))' \
        "$data/tasks-gen.jsonl" >"$data/gen-corpus.txt"
    dspecs=(-q none)
    for s in 32 64 128; do
        k=$(awk -v s=$s 'BEGIN {print s / 256}')
        for sel in snapkv h2o keydiff; do
            dspecs+=(-q "tokens($sel:keep=$k,target=$s,interval=16; none; drop)" -q "tokens($sel:keep=$k; none; drop)")
        done
        dspecs+=(-q "tokens(window:sinks=4,recent=$((s - 4)),target=$s,interval=16; none; drop)" \
                 -q "tokens(window:sinks=4,recent=$((s - 4)); none; drop)")
    done
    for b in 2 3 4; do dspecs+=(-q kivi:bits=$b -q per-token:bits=$b); done
    "$bin/kvq-eval" "$rmodel" --text "$data/gen-corpus.txt" --chunk 512 --chunks 4 --context 256 --policy decode \
        "${dspecs[@]}" -o "$data/eval-decoding.csv"
    with_tasks=1
else
    say "does_it_remember skipped: $rmodel or the model tools absent"
    with_tasks=0
fi

# models in the loop: the bundled model when ../shared/data/model is present (never committed)
shared=${KVQ_MODEL_DIR:-$root/../shared/data}
model=$shared/model/stories260K.gguf
if [ -r "$model" ] && [ -x "$bin/kvq-dump" ] && [ -x "$bin/kvq-eval" ]; then
    say "kvq-dump + kvq-analyze + kvq-eval: proxies against the loss on $model"
    text=$shared/texts/story_main.txt
    mspecs=(-q per-token:bits=2 -q per-token:bits=4 -q per-channel:bits=2 -q kivi:bits=2 -q kcvt:bits=2 -q absmax:bits=4)
    "$bin/kvq-dump" "$model" --text "$text" --max-tokens 512 -o "$data/model-dump.h5"
    "$bin/kvq-analyze" "${mspecs[@]}" --per layer -o "$data/proxy-layer.csv" "$data/model-dump.h5"
    "$bin/kvq-eval" "$model" --text "$text" --max-tokens 512 "${mspecs[@]}" --per-layer \
        -o "$data/eval-layer.csv"
    "$bin/kvq-eval" "$model" --text "$text" --max-tokens 512 "${mspecs[@]}" --policy prefill,decode \
        -o "$data/eval-policy.csv"
    say "kvq-eval: vq's coupled channels against scalar codes in the model"
    "$bin/kvq-eval" "$model" --text "$text" --max-tokens 512 "${vspecs[@]}" --calib "$calib" -o "$data/eval-vq.csv"
    say "kvq-eval --context 384: quantize or evict, 3 windows of 512 tokens"
    cat "$text" "$shared/texts/story_calib.txt" >"$data/corpus.txt"
    cspecs=(-q none)
    for kr in 0.125:44 0.25:92 0.5:188 0.75:284; do # snapkv keeping K tokens, and a window of the same size
        cspecs+=(-q "tokens(snapkv:keep=${kr%:*}; none; drop)" -q "tokens(window:sinks=4,recent=${kr#*:}; none; drop)")
    done
    for b in 2 3 4; do cspecs+=(-q "kivi:bits=$b,group=32,residual=32"); done
    for b in 2 3 4 8; do cspecs+=(-q "per-token:bits=$b"); done
    cspecs+=(-q fp8 -q fp8:scale=token)
    for k in 0.25 0.5; do
        for b in 4 2; do cspecs+=(-q "tokens(snapkv:keep=$k; kivi:bits=$b,group=32,residual=32; drop)"); done
    done
    for k in 0.125 0.25; do cspecs+=(-q "tokens(h2o:keep=$k; none; kivi:bits=2,group=32,residual=32)"); done
    "$bin/kvq-eval" "$model" --text "$data/corpus.txt" --chunk 512 --context 384 "${cspecs[@]}" -o "$data/eval-context.csv"
    if [ -x "$bin/kvq-alloc" ]; then
        say "kvq-alloc: kivi kbits x vbits per layer against uniform, budgets 5-10 bits"
        rm -f "$data/alloc.csv" "$data/alloc.csv.sensitivity.csv" "$data/alloc.csv.uniform.csv"
        "$bin/kvq-alloc" "$model" --text "$text" --family kivi --grid kbits=2,4,8 --grid vbits=2,4,8 --fixed residual=0 \
            --budget 5,6,7,8,10 -o "$data/alloc.csv"
    fi
    with_model=1
else
    say "proxy_vs_loss skipped: $model absent (the bundled model lives in ../shared/data/model)"
    with_model=0
fi
fi

say "figures (python: $python)"
"$python" "$here/channel_magnitudes.py" --width "$width" --values "$data/values-L1-H0.csv" --channels "$data/channels.csv" --out "$out"
"$python" "$here/error_vs_bits.py" --width "$width" --input "$data/analyze-model.csv" --out "$out"
"$python" "$here/error_vs_bits.py" --width "$width" --input "$data/analyze-formats.csv" --name error_vs_bits_formats --out "$out"
"$python" "$here/sweep_heatmap.py" --width "$width" --input "$data/sweep-kivi.csv" --x group --y residual --metric out_rel_joint --out "$out"
"$python" "$here/sweep_heatmap.py" --width "$width" --input "$data/sweep-kivi.csv" --x group --y residual --metric bits \
    --name sweep_heatmap_bits --out "$out"
"$python" "$here/layer_profile.py" --width "$width" --input "$data/analyze-layer.csv" --out "$out"
vq_eval=()
[ $with_model = 1 ] && vq_eval=(--eval "$data/eval-vq.csv")
"$python" "$here/vq_coupling.py" --width "$width" --analyze "$data/analyze-vq.csv" "${vq_eval[@]}" --out "$out"
if [ $with_model = 1 ]; then
    "$python" "$here/proxy_vs_loss.py" --width "$width" --analyze "$data/proxy-layer.csv" --eval-layer "$data/eval-layer.csv" \
        --eval-policy "$data/eval-policy.csv" --out "$out"
    [ -r "$data/alloc.csv" ] && "$python" "$here/alloc_vs_bits.py" --width "$width" --input "$data/alloc.csv" --out "$out"
    "$python" "$here/quantize_or_evict.py" --width "$width" --input "$data/eval-context.csv" --out "$out"
fi
if [ $with_tasks = 1 ]; then
    "$python" "$here/does_it_remember.py" --width "$width" --input "$data/eval-tasks.csv" --out "$out"
    "$python" "$here/compress_while_generating.py" --width "$width" --input "$data/eval-decoding.csv" --out "$out"
fi
if [ -n "${KVQ_SANITIZED:-}" ]; then
    say "python_api skipped: a sanitizer build's libkvq.so cannot be loaded by python3"
elif [ -r "$build/python/kvq/__init__.py" ]; then  # the Python API (python/kvq), from the build
    PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}" "$python" "$here/python_api.py" --width "$width" --dump "$dump" --out "$out"
else
    say "python_api skipped: $build/python/kvq absent (an older build: reconfigure it)"
fi
if [ $readme = 1 ]; then
    mkdir -p "$here/img"
    cp "$out/error_vs_bits.png" "$out/sweep_heatmap.png" "$out/vq_coupling.png" "$here/img/"
    [ -r "$out/alloc_vs_bits.png" ] && cp "$out/alloc_vs_bits.png" "$here/img/"
    [ -r "$out/quantize_or_evict.png" ] && cp "$out/quantize_or_evict.png" "$here/img/"
    [ -r "$out/does_it_remember.png" ] && cp "$out/does_it_remember.png" "$here/img/"
    [ -r "$out/compress_while_generating.png" ] && cp "$out/compress_while_generating.png" "$here/img/"
    say "refreshed notebooks-export/img/"
fi
say "done: $(cd "$out" && ls -- *.png | tr '\n' ' ')in $out/"
