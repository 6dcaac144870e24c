#!/bin/bash
# check_same_outputs.sh — a code move changes no output: runs every tool of
# two builds (before and after) on the same inputs and compares the results
# byte for byte (dumps dataset by dataset, the provenance record's run-specific
# fields aside).  For the house moves of issue #37; not part of `meson test`.
#   tests/check_same_outputs.sh OLD_BUILD NEW_BUILD   (from the source root)
set -uo pipefail
[ $# -eq 2 ] || { echo "usage: $0 OLD_BUILD NEW_BUILD" >&2; exit 2; }
old=$(cd "$1" && pwd) new=$(cd "$2" && pwd)
src=$(cd "$(dirname "$0")/.." && pwd)
shared=$src/../shared
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvq-same.XXXXXX")
trap '[ -n "${KEEP:-}" ] || rm -rf "$tmp"' EXIT
D=$src/data/stories260K.h5 C=$src/data/stories260K-calib.h5
M=$shared/data/model/stories260K.gguf T=$shared/data/texts/story_main.txt
py=/usr/bin/python3
fail=0 n=0

# run NAME TOOL ARGS...: stdout to NAME.out in each build's directory ("@" in ARGS: that directory)
run() {
    local name=$1 tool=$2
    shift 2
    for b in old new; do
        local bin=${!b} dir=$tmp/$b
        mkdir -p "$dir"
        local args=("${@//@/$dir}")
        (cd "$dir" && "$bin/tools/$tool" "${args[@]}" >"$dir/$name.out" 2>"$dir/$name.err"; echo $? >"$dir/$name.rc")
    done
}

run list kvq-analyze --list-quantizers
run help-analyze kvq-analyze --help
for fmt in csv jsonl; do
    for th in 1 2; do
        for per in head layer model; do
            run "analyze-$per-$fmt-$th" kvq-analyze --per "$per" --format "$fmt" --threads "$th" --calib "$C" "$D"
        done
    done
done
run analyze-o kvq-analyze --per layer -o @/analyze-o.csv --calib "$C" "$D"
run gen kvq-gen --layers 2 --heads 4 --kv-heads 2 --head-dim 32 --tokens 96 --seed 3 --progress never -o @/gen.h5
# head_dim 32: every family's example spec (the ones that need blocks too)
specs=()
while read -r s; do specs+=(-q "$s"); done < <(PYTHONPATH=$new/python $py -c \
    'import kvq; [print(q["name"]); print(q["example_spec"]) for q in kvq.quantizers()]' 2>/dev/null | sort -u)
run analyze-gen kvq-analyze --per head --format jsonl --threads 2 --seed 5 "${specs[@]}" "$tmp/new/gen.h5"
run info kvq-info "$D"
run info-channels kvq-info --channels "$D"
run info-values kvq-info --values 1:0 "$D"
run sweep kvq-sweep --quant kivi --grid bits=2,3,4 --grid group=8,16 --per model --progress never -o @/sweep.csv "$D"
if [ -f "$M" ]; then
    run dump kvq-dump "$M" --text "$T" --max-tokens 64 -o @/dump.h5
    run eval kvq-eval "$M" --text "$T" --max-tokens 128 -q none -q kivi:bits=2 -q fp8 \
        --policy prefill,decode --format csv --progress never
    run eval-chunk kvq-eval "$M" --text "$T" --chunk 64 --chunks 2 -q none -q per-token:bits=3 --format jsonl \
        --progress never
    run alloc kvq-alloc "$M" --text "$T" --max-tokens 96 --family kivi --grid kbits=2,4 --grid vbits=2,4 \
        --fixed residual=0 --budget 5,7 --progress never -o @/alloc.csv
fi

# compare: stdout, exit codes, every file written (dumps dataset by dataset)
for f in "$tmp"/old/*; do
    name=${f##*/}
    case $name in *.err | *.meta.json) continue ;; esac
    n=$((n + 1))
    g=$tmp/new/$name
    if [[ $name == *.h5 ]]; then
        if ! $py - "$f" "$g" <<'EOF'; then
import sys, h5py, numpy as np
a, b = h5py.File(sys.argv[1]), h5py.File(sys.argv[2])
def walk(g, p=""):
    out = {}
    for k, v in g.items():
        out[p + k] = v if isinstance(v, h5py.Dataset) else None
        if isinstance(v, h5py.Group): out.update(walk(v, p + k + "/"))
    return out
x, y = walk(a), walk(b)
bad = sorted(set(x) ^ set(y)) + [k for k in x if k in y and x[k] is not None and
      (x[k].dtype != y[k].dtype or x[k].shape != y[k].shape or x[k][()].tobytes() != y[k][()].tobytes())]
bad += [f"attr {k}" for k in set(a.attrs) | set(b.attrs) if k not in ("kvq_commit", "created")
        and (k not in a.attrs or k not in b.attrs or str(a.attrs[k]) != str(b.attrs[k]))]
sys.exit(print("differ:", bad[:5]) or 1 if bad else 0)
EOF
            echo "DIFFER: $name"
            fail=$((fail + 1))
        fi
    elif ! cmp -s "$f" "$g"; then
        echo "DIFFER: $name"
        diff "$f" "$g" | head -5
        fail=$((fail + 1))
    fi
done
for f in "$tmp"/old/*.rc; do [ "$(cat "$f")" = 0 ] || echo "note: ${f##*/}: exit $(cat "$f") in the old build"; done
echo "check_same_outputs: $((n - fail))/$n outputs identical"
[ $fail -eq 0 ]
