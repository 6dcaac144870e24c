# cli_lib.sh — sourced by the CLI test scripts: a temporary directory,
# pass/fail counters and `expect`, which checks a command's exit code, that a
# failure prints exactly one line on stderr, and the substrings it must print.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0

# expect CODE 'substring'... -- command...
expect() {
    local code=$1
    shift
    local needles=()
    while [ "$1" != "--" ]; do needles+=("$1"); shift; done
    shift
    "$@" >"$tmp/out" 2>"$tmp/err"
    local rc=$? ok=1 why=""
    [ "$rc" = "$code" ] || { ok=0; why="exit $rc, expected $code"; }
    if [ "$code" != 0 ]; then
        local lines
        lines=$(wc -l <"$tmp/err")
        [ "$lines" = 1 ] || { ok=0; why="$why; $lines lines on stderr"; }
    fi
    for n in "${needles[@]}"; do
        grep -qF -- "$n" "$tmp/err" "$tmp/out" || { ok=0; why="$why; missing '$n'"; }
    done
    if [ $ok = 1 ]; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        echo "FAIL: $* -> $why"
        sed 's/^/  stderr: /' "$tmp/err" | head -5
    fi
}

# recorded TOOL OUT...: every recorded option row of tools/kvq-TOOL.c reaches the
# record of one of the OUTs in $tmp (tests/check_option_record.py)
recorded() {
    local tool=$1 metas=() o
    shift
    for o; do metas+=("$tmp/$o.meta.json"); done
    /usr/bin/python3 "$src/tests/check_option_record.py" "$src/tools/kvq-$tool.c" "${metas[@]}" \
        && pass=$((pass + 1)) || { fail=$((fail + 1)); echo "FAIL: kvq-$tool's recorded rows"; }
}
