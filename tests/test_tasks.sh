#!/usr/bin/env bash
# test_tasks.sh — retrieval tasks end to end (docs/models.md#retrieval-tasks): kvq-gen
# --task files, kvq-eval --tasks on the bundled model data/kvq-retrieval.gguf
# (the rows, -q none exactly unchanged, depth rows, independence of the
# thread count, a spec of every kind), task shards and their merge, what
# the model retrieves on kv tasks, llama.cpp's NLL on it, and the refusals: one line, exit 1 for bad input, 2 for usage,
# nothing written.
#   test_tasks.sh BUILD_DIR SOURCE_DIR
set -u
build=$1
src=$2
gen=$build/tools/kvq-gen
eval=$build/tools/kvq-eval
. "$src/tests/cli_lib.sh"
model=$src/data/kvq-retrieval.gguf

# --- task files
expect 0 -- "$gen" --task kv --count 8 --context-tokens 120 --seed 3 -o "$tmp/kv.jsonl"
[ "$(wc -l <"$tmp/kv.jsonl")" = 8 ] && grep -q '"task": "kv"' "$tmp/kv.jsonl.meta.json" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-gen --task kv: 8 lines and a record"; }
"$gen" --task kv --count 8 --context-tokens 120 --seed 3 -o "$tmp/kv2.jsonl" 2>/dev/null
cmp -s "$tmp/kv.jsonl" "$tmp/kv2.jsonl" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-gen --task is not seeded"; }
# the model's tokenizer counts exactly what the approximation counts on generated text
"$gen" --task needle --count 4 --context-tokens 150 --seed 3 --model "$model" -o "$tmp/n-model.jsonl" 2>/dev/null
"$gen" --task needle --count 4 --context-tokens 150 --seed 3 -o "$tmp/n-approx.jsonl" 2>/dev/null
cmp -s "$tmp/n-model.jsonl" "$tmp/n-approx.jsonl" && pass=$((pass + 1)) \
    || { fail=$((fail + 1)); echo "FAIL: --model and the approximation count differently on the bundled model"; }
expect 2 "--task haystack: expected needle, multikey, kv or mqar" -- "$gen" --task haystack --context-tokens 50 -o "$tmp/x.jsonl"
expect 2 "--task needs --context-tokens L" -- "$gen" --task kv -o "$tmp/x.jsonl"
expect 2 "too few for a multikey task" -- "$gen" --task multikey --context-tokens 20 -o "$tmp/x.jsonl"
[ ! -e "$tmp/x.jsonl" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a refused kvq-gen left a file"; }

# --- kvq-eval --tasks: rows, -q none, depth rows, threads
"$gen" --task needle --count 6 --context-tokens 100 --seed 4 -o "$tmp/needle.jsonl" 2>/dev/null
specs=(-q none -q kivi:bits=2 -q 'tokens(snapkv:keep=0.25; none; drop)' -q 'mix(0=per-token:bits=8;1-=per-token:bits=4)' -q ggml:ktype=q4_0) # no comma in a spec: the checks split CSV on commas
for n in 1 2; do
    "$eval" "$model" --tasks "$tmp/needle.jsonl" "${specs[@]}" --policy prefill,decode --per-depth 0.5 --threads $n \
        --format csv -o "$tmp/t$n.csv" 2>"$tmp/t$n.err" || { echo "kvq-eval --tasks failed:"; cat "$tmp/t$n.err"; }
done
cmp -s "$tmp/t1.csv" "$tmp/t2.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: --tasks differs between --threads 1 and 2"; }
head -1 "$tmp/t1.csv" | grep -qx 'model,tasks,quantizer,spec,policy,layer,depth,k_bits,v_bits,answer_nll_ref,answer_nll,answer_dnll,answer_dnll_se,exact_ref,exact,recall_drop' \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: --tasks columns"; head -1 "$tmp/t1.csv"; }
# 5 specs x 2 policies x (all + 2 depth buckets); the buckets hold 3 tasks each
awk -F, 'NR > 1 {n++; if ($7 != "all") {b++; if ($2 != 3) bad = 1}} END {exit !(n == 30 && b == 20 && !bad)}' "$tmp/t1.csv" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: --per-depth rows"; cat "$tmp/t1.csv"; }
# -q none: exactly no change; 16 bits
awk -F, 'NR > 1 && $3 == "none" {n++; if ($12 != 0 || $14 != $15 || $16 != 0 || $8 != 16 || $11 != $10) bad = 1} END {exit !(n == 6 && !bad)}' "$tmp/t1.csv" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: -q none changes the answers"; grep none "$tmp/t1.csv"; }
# the context's bits: q4_0 4.5; SnapKV's kept tokens (a quarter and its observation window) at 16 bits with positions
awk -F, 'NR > 1 && $3 == "ggml" && $7 == "all" {q = $8} NR > 1 && $3 == "tokens" && $7 == "all" {s = $8}
    END {exit !(q == 4.5 && s > 4 && s < 16)}' "$tmp/t1.csv" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: the contexts' bits"; cat "$tmp/t1.csv"; }
# one task file of two tasks = the pooled rows of the two tasks run alone
head -2 "$tmp/needle.jsonl" >"$tmp/two.jsonl"
for i in 1 2; do sed -n ${i}p "$tmp/needle.jsonl" >"$tmp/one$i.jsonl"; done
{
    "$eval" "$model" --tasks "$tmp/two.jsonl" -q kivi:bits=2 --format csv 2>/dev/null | tail -1
    for i in 1 2; do "$eval" "$model" --tasks "$tmp/one$i.jsonl" -q kivi:bits=2 --format csv 2>/dev/null | tail -1; done
} | awk -F, '{r[NR] = $10; q[NR] = $11} END {d = (r[1] * 2 - r[2] - r[3]) ^ 2 + (q[1] * 2 - q[2] - q[3]) ^ 2; exit !(NR == 3 && d < 1e-20)}' \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a task's result depends on the other tasks"; }
expect 0 '"answer_nll_ref"' -- "$eval" "$model" --tasks "$tmp/two.jsonl" -q none --format jsonl

# --- shards by task: 9 shares of 7 tasks (two of them empty), merged in any order, give the
# unsharded run's rows byte for byte; a missing, a doubled or an edited shard is refused
sspecs=(-q none -q kivi:bits=2 --policy prefill,decode)
"$gen" --task needle --count 7 --context-tokens 100 --seed 5 -o "$tmp/seven.jsonl" 2>/dev/null
"$eval" "$model" --tasks "$tmp/seven.jsonl" "${sspecs[@]}" --per-depth 0.5 -o "$tmp/full7.csv" 2>/dev/null
for i in 0 1 2 3 4 5 6 7 8; do
    "$eval" "$model" --tasks "$tmp/seven.jsonl" "${sspecs[@]}" --shard $i/9 -o "$tmp/sh$i.csv" 2>/dev/null || echo "shard $i failed"
done
expect 0 -- "$eval" --merge "$tmp"/sh{4,8,1,2,3,5,6,7,0}.csv --per-depth 0.5 -o "$tmp/merged.csv"
cmp -s "$tmp/full7.csv" "$tmp/merged.csv" && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: merged task shards differ from one run"; }
expect 1 "task 5 of 7 of none (prefill) is in none of the shards" -- "$eval" --merge "$tmp"/sh{0,1,2,3,4,5,6,8}.csv -o "$tmp/m.csv"
expect 1 "is in the shards twice" -- "$eval" --merge "$tmp"/sh{0,1,1,2,3,4,5,6,7,8}.csv -o "$tmp/m.csv"
awk -F, -v OFS=, 'NR == 2 {$12 = 7} 1' "$tmp/sh1.csv" >"$tmp/bad-sh1.csv" # exact 7: no run writes that
expect 1 "bad-sh1.csv: line 2: expected a task index" "exact 0 or 1" -- "$eval" --merge "$tmp"/sh0.csv "$tmp/bad-sh1.csv" "$tmp"/sh{2,3,4,5,6,7,8}.csv -o "$tmp/m.csv"
# a shard of another task file (another seed, the same count) is another run: refused by its fingerprint
"$gen" --task needle --count 7 --context-tokens 100 --seed 6 -o "$tmp/seven6.jsonl" 2>/dev/null
"$eval" "$model" --tasks "$tmp/seven6.jsonl" "${sspecs[@]}" --shard 1/9 -o "$tmp/other-sh1.csv" 2>/dev/null
expect 1 "of another run than" "other-sh1.csv" "not shards of one run" -- "$eval" --merge "$tmp"/sh0.csv "$tmp/other-sh1.csv" "$tmp"/sh{2,3,4,5,6,7,8}.csv -o "$tmp/m.csv"
[ ! -e "$tmp/m.csv" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a refused merge wrote its output"; }

# --- the bundled model retrieves (data/README.md): kv tasks of 256 tokens (64 pairs) from a seed
# it never saw, answered exactly with the exact cache at least 9 times in 10 (the issue's bar),
# and 2-bit per-token keys cost recall (the model's keys are its memory)
"$gen" --task kv --count 40 --context-tokens 256 --seed 424242 -o "$tmp/kv256.jsonl" 2>/dev/null
"$eval" "$model" --tasks "$tmp/kv256.jsonl" -q none -q per-token:bits=2 --format csv 2>/dev/null >"$tmp/kv256.csv"
awk -F, 'NR == 2 {ok = $14 >= 0.9 && $10 < 1.0} NR == 3 {ok = ok && $15 < $14} END {exit !ok}' "$tmp/kv256.csv" \
    && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: the bundled model on kv tasks of 256 tokens"; cat "$tmp/kv256.csv"; }

# --- llama.cpp reads the model as kvq does: llama-perplexity's mean NLL (printed to 6
# decimals by --ppl-output-type 1) equals kvq-eval --chunk's (LLAMA_PERPLEXITY: its binary,
# ../shared/tools/build-llama-perplexity.sh builds it; skipped without it)
llama=${LLAMA_PERPLEXITY:-}
if [ -n "$llama" ] && [ -x "$llama" ]; then
    "$gen" --task needle --count 12 --context-tokens 400 --seed 77 -o - 2>/dev/null |
        python3 -c 'import sys, json; print(" ".join(json.loads(l)["context"] for l in sys.stdin))' >"$tmp/ppl.txt"
    # llama.cpp's default cache is f16: kvq-eval's f16 cache is the same computation (the exact
    # float32 reference lies 4e-6 nats away on this model, whose attention logits are large)
    "$eval" "$model" --text "$tmp/ppl.txt" --chunk 256 -q none -q ggml:ktype=f16,vtype=f16 --format jsonl 2>/dev/null \
        >"$tmp/ours.jsonl"
    ours=$(python3 -c 'import json, sys; r = [json.loads(l) for l in open(sys.argv[1])]; print("%.9f" % r[1]["nll"])' "$tmp/ours.jsonl")
    exact=$(python3 -c 'import json, sys; r = [json.loads(l) for l in open(sys.argv[1])]; print("%.9f" % r[0]["nll"])' "$tmp/ours.jsonl")
    "$llama" -m "$model" -f "$tmp/ppl.txt" -c 256 -t 2 --ppl-output-type 1 --log-file "$tmp/llama.log" >/dev/null 2>&1
    theirs=$(awk 'NF == 4 && $1 ~ /^[0-9]+$/ {v = $3} END {print v}' "$tmp/llama.log") # the log file keeps the order
    awk -v a="$ours" -v b="$theirs" -v e="$exact" 'BEGIN {d = a - b; x = e - b; exit !(b != "" && d < 1e-6 && d > -1e-6 && x < 1e-5 && x > -1e-5)}' \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: llama-perplexity's NLL $theirs, kvq-eval's $ours (f16 cache), $exact (exact)"; }
else
    echo "skipped: llama.cpp's perplexity on the bundled model (set LLAMA_PERPLEXITY to llama-perplexity)"
fi

# --- refusals: one line, nothing written
good='{"context": "apple: red.", "question": "What is the value of apple?", "answer": "red"}'
printf '%s\nnot json\n' "$good" >"$tmp/bad1.jsonl"
printf '%s\n{"context": "a", "question": "b"}\n' "$good" >"$tmp/bad2.jsonl"
printf '{"context": "a", "question": "b", "answer": ""}\n' >"$tmp/bad3.jsonl"
printf '{"id": "x", "context": "a", "question": "b", "answer": "c", "depth": 2}\n' >"$tmp/bad4.jsonl"
expect 1 "bad1.jsonl: line 2: not a JSON object" -- "$eval" "$model" --tasks "$tmp/bad1.jsonl" -q none -o "$tmp/o.csv"
expect 1 "bad2.jsonl: line 2: no \"answer\" field" -- "$eval" "$model" --tasks "$tmp/bad2.jsonl" -q none -o "$tmp/o.csv"
expect 1 "bad3.jsonl: line 1: \"answer\" is empty" -- "$eval" "$model" --tasks "$tmp/bad3.jsonl" -q none -o "$tmp/o.csv"
expect 1 "bad4.jsonl: line 1: \"depth\": expected a number in 0..1" -- "$eval" "$model" --tasks "$tmp/bad4.jsonl" -q none -o "$tmp/o.csv"
"$gen" --task kv --count 2 --context-tokens 1200 -o "$tmp/long.jsonl" 2>/dev/null
expect 1 "long.jsonl: task kv-0 (line 1): the prompt and answer take" "more than the model's context length 1024" -- \
    "$eval" "$model" --tasks "$tmp/long.jsonl" -q none -o "$tmp/o.csv"
expect 1 "missing.jsonl: cannot open" -- "$eval" "$model" --tasks "$tmp/missing.jsonl" -q none -o "$tmp/o.csv"
[ ! -e "$tmp/o.csv" ] && [ ! -e "$tmp/o.csv.meta.json" ] && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: a refused run wrote its output"; }
expect 2 "--tasks: the prompts come from the task file" -- "$eval" "$model" --tasks "$tmp/two.jsonl" --text "$tmp/two.jsonl" -q none
expect 2 "--tasks: each task is its own window" -- "$eval" "$model" --tasks "$tmp/two.jsonl" --chunk 64 -q none
expect 2 "--tasks: each task is its own window" -- "$eval" "$model" --tasks "$tmp/two.jsonl" --context 8 -q none
expect 2 "--tasks --shard writes its share whole: no --resume" -- "$eval" "$model" --tasks "$tmp/two.jsonl" --shard 0/2 --resume -o "$tmp/o.csv" -q none
expect 2 "--tasks --shard 0/2: needs -o OUT" -- "$eval" "$model" --tasks "$tmp/two.jsonl" --shard 0/2 -q none
expect 2 "and no --per-depth (give it to --merge)" -- "$eval" "$model" --tasks "$tmp/two.jsonl" --shard 0/2 --per-depth 0.5 -o "$tmp/o.csv" -q none
expect 2 "--per-depth B needs --tasks FILE" -- "$eval" "$model" --text "$tmp/two.jsonl" --per-depth 0.5 -q none
expect 2 "--per-depth 0: expected a bucket width" -- "$eval" "$model" --tasks "$tmp/two.jsonl" --per-depth 0 -q none
expect 2 "no model given" -- "$eval" --tasks "$tmp/two.jsonl" -q none

echo "$pass passed, $fail failed"
[ "$fail" = 0 ]
