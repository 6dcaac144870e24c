#!/usr/bin/env bash
# test_install.sh — kvq installs as a C and a Python library (README "Install").
# 1. `meson install --destdir STAGE` from the build under test: libkvq in a
#    directory the platform's loader searches (ldconfig's list), kvq.pc and the
#    headers; a C program built with `pkg-config --cflags --libs kvq` against
#    the staged files runs and parses a spec through libkvq.
# 2. With meson-python (Debian: python3-mesonpy) and venv: `pip install
#    --no-build-isolation .` into a venv made with --system-site-packages, then
#    `import kvq` from outside the tree quantizes an array; skipped with one
#    line without them.
#   test_install.sh BUILD_DIR SOURCE_DIR
set -u
build=$(cd "$1" && pwd)
src=$(cd "$2" && pwd)
pass=0 fail=0
ok() { pass=$((pass + 1)); }
bad() { fail=$((fail + 1)); echo "FAIL: $*"; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# --- 1. meson install into a staging root.  --no-rebuild: `meson test` has built
# everything, and a rebuild here (the commit stamp after a new commit) would relink
# the tools while the tests beside this one run them
stage=$tmp/stage
if meson install -C "$build" --no-rebuild --destdir "$stage" --quiet >"$tmp/install.log" 2>&1; then ok; else
    bad "meson install: $(tail -n 3 "$tmp/install.log")"
fi
pc=$(find "$stage" -name kvq.pc | head -n 1)
[ -n "$pc" ] && ok || bad "no kvq.pc installed"
libdir=$(PKG_CONFIG_PATH=$(dirname "${pc:-/nonexistent}") pkg-config --variable=libdir kvq 2>/dev/null)
includedir=$(PKG_CONFIG_PATH=$(dirname "${pc:-/nonexistent}") pkg-config --variable=includedir kvq 2>/dev/null)
[ -e "$stage$libdir/libkvq.so.0" ] && ok || bad "libkvq.so.0 is not in kvq.pc's libdir $libdir"
[ -e "$stage$includedir/kvq.h" ] && ok || bad "kvq.h is not in kvq.pc's includedir $includedir"
# the directories the loader searches: /etc/ld.so.conf and what it includes (ldconfig -v lists
# only those that exist), plus the trusted ones
if cat /etc/ld.so.conf /etc/ld.so.conf.d/*.conf 2>/dev/null | sed 's/[[:space:]]*$//' | grep -qx "$libdir" ||
    case "$libdir" in /lib | /usr/lib | /lib64 | /usr/lib64) true ;; *) false ;; esac; then ok; else
    bad "libdir $libdir is not searched by the loader (meson setup -Dlibdir=lib/\$(gcc -print-multiarch); tools/setup.sh does)"
fi
cat >"$tmp/prog.c" <<'EOF'
#include <kvq.h>
#include <stdio.h>
int main(void)
{
    kvq_spec spec;
    kvq_error err = {0};
    if (kvq_spec_parse("kivi:bits=2", &spec, &err)) { fprintf(stderr, "%s\n", err.msg); return 1; }
    printf("kvq %s: %zu quantizers, %s parsed\n", kvq_version(), kvq_quantizer_count(), spec.text);
    return 0;
}
EOF
export PKG_CONFIG_SYSROOT_DIR=$stage PKG_CONFIG_PATH=$(dirname "${pc:-/nonexistent}")
if cc "$tmp/prog.c" -o "$tmp/prog" $(pkg-config --cflags --libs kvq) 2>"$tmp/cc.err"; then ok; else
    bad "cc prog.c \$(pkg-config --cflags --libs kvq): $(head -n 3 "$tmp/cc.err")"
fi
unset PKG_CONFIG_SYSROOT_DIR PKG_CONFIG_PATH
out=$(LD_LIBRARY_PATH=$stage$libdir "$tmp/prog" 2>&1)
case "$out" in "kvq "*" quantizers, kivi:bits=2 parsed") ok ;; *) bad "the C program: $out" ;; esac
ldd "$tmp/prog" 2>/dev/null | grep -q "libkvq.so.0 => not found" && true # the staged copy is not the root's: expected

# --- 2. pip install . into a venv
py=/usr/bin/python3
if ! $py -c 'import mesonpy, venv, ensurepip' 2>/dev/null; then
    echo "SKIP: pip install: meson-python or venv/ensurepip missing (apt-get install python3-mesonpy python3-venv)"
elif ! command -v patchelf >/dev/null; then
    # meson-python sets the RPATH of the wheel's programs and libraries with it (Debian's
    # python3-mesonpy only recommends it): without it the build stops in its wheel step
    echo "SKIP: pip install: patchelf missing, which meson-python needs (apt-get install patchelf)"
else
    $py -m venv --system-site-packages "$tmp/venv" >"$tmp/venv.log" 2>&1 || bad "python3 -m venv: $(tail -n 2 "$tmp/venv.log")"
    # a copy of the tree: pip builds where the source is and must not touch the checkout
    mkdir -p "$tmp/src"
    (cd "$src" && git ls-files -z -co --exclude-standard 2>/dev/null | xargs -0 cp --parents -t "$tmp/src" 2>/dev/null) ||
        cp -r "$src/." "$tmp/src"
    rm -rf "$tmp/src/build" "$tmp/src/build-asan"
    t0=$SECONDS
    if "$tmp/venv/bin/pip" install --no-build-isolation --no-deps --no-index -q "$tmp/src" >"$tmp/pip.log" 2>&1; then ok; else
        bad "pip install --no-build-isolation .: $(tail -n 5 "$tmp/pip.log")"
    fi
    echo "pip install: $((SECONDS - t0)) s"
    out=$(cd / && env -u PYTHONPATH -u KVQ_LIBRARY "$tmp/venv/bin/python" -c '
import numpy as np, kvq
x = np.linspace(-1, 1, 2 * 16 * 32, dtype=np.float32).reshape(2, 16, 32)
q = kvq.quantize("per-token:bits=4", x, x)
print(kvq.__file__.startswith("'"$tmp/venv"'"), len(kvq.quantizers()) > 10, float(abs(q[0] - x).max()) < 0.1)' 2>&1)
    [ "$out" = "True True True" ] && ok || bad "import kvq from the venv: $out"
    [ -x "$tmp/venv/bin/kvq-analyze" ] && "$tmp/venv/bin/kvq-analyze" --version >/dev/null 2>&1 && ok ||
        bad "the venv's kvq-analyze does not run"
fi
echo "install: $pass passed, $fail failed"
[ $fail = 0 ]
