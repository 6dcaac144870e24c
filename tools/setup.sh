#!/usr/bin/env bash
# setup.sh — kvq's one-command set-up on Debian/Ubuntu: installs the missing
# build dependencies (apt-get, when root; sudo otherwise), configures and
# builds with meson, then
#   tools/setup.sh demo   runs kvq-analyze on the bundled real dump (every family, calibrated on the second dump)
#   tools/setup.sh test   runs every test suite, in a normal build and in an
#                         AddressSanitizer + UndefinedBehaviorSanitizer build
#                         (as root it also installs slurm-wlm and munge: the slurm suite)
#   tools/setup.sh figures regenerates every figure from the bundled data into figures/
#   tools/setup.sh build  only builds (into build/)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-build}
case "$what" in demo|test|figures|build) ;; *) echo "usage: tools/setup.sh demo|test|figures|build" >&2; exit 2 ;; esac

# say() names each step; run_step shows a step's own output — apt's packages,
# meson's checks, ninja's [n/N] — as one line that rewrites itself on a
# terminal (so the demo's table is not buried under it), or line by line into
# a log (CI); a failing step prints the last lines of its output.
say() { echo "setup: $*" >&2; }
# heartbeat PREFIX: copies its input line by line (prefixed), and after 60 s without a line says
# that the step is still running — a log never goes silent for minutes (apt's unpacking, a long test)
heartbeat() {
    local t0=$SECONDS line rc
    while :; do
        if IFS= read -r -t 60 line; then
            echo "$1$line"
        else
            rc=$?
            [ $rc -gt 128 ] || break # end of input (a last line without a newline is printed)
            echo "$1... still running ($((SECONDS - t0)) s)"
        fi
    done
    [ -z "${line:-}" ] || echo "$1$line"
}
run_step() { # what command...
    local what=$1 log="" rc=0
    shift
    say "$what"
    set +e
    if [ -t 2 ]; then
        local cols
        log=$(mktemp "${TMPDIR:-/tmp}/kvq-setup.XXXXXX") # what a failing step shows
        cols=$(tput cols 2>/dev/null || echo 80)
        "$@" 2>&1 | tee "$log" | while IFS= read -r line; do
            printf '\r\033[K  %s' "${line:0:$((cols - 4))}" >&2
        done
        rc=${PIPESTATUS[0]}
        printf '\r\033[K' >&2
    else
        "$@" 2>&1 | heartbeat "  " >&2
        rc=${PIPESTATUS[0]}
    fi
    set -e
    if [ "$rc" != 0 ]; then
        [ -n "$log" ] && tail -n 30 "$log" >&2
        say "error: $what failed (exit $rc)"
        rm -f "$log"
        exit 1
    fi
    [ -z "$log" ] || rm -f "$log"
}

pkgs=(gcc pkg-config meson ninja-build libhdf5-dev libopenblas-dev liblapacke-dev libssl-dev check)
# the figure scripts (notebooks-export/) and the Python tests: not for the demo or a build
case "$what" in figures | test) pkgs+=(python3-matplotlib python3-numpy python3-h5py) ;; esac
# the test suite's real parts, as root: the slurm suite starts a one-node Slurm, the install
# suite builds a wheel with meson-python into a venv (both skip without them)
# (patchelf: meson-python only recommends it, but it needs it to point the wheel's programs at its libkvq)
[ "$what" = test ] && [ "$(id -u)" = 0 ] && pkgs+=(slurm-wlm munge python3-mesonpy patchelf python3-venv)
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
        echo "setup: error: missing packages ${missing[*]} and not root (install them, then rerun)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    run_step "updating the package lists (apt-get update)" $sudo apt-get update
    run_step "installing ${missing[*]} (apt-get install, a few minutes)" \
        $sudo apt-get install -y --no-install-recommends "${missing[@]}"
fi

configure() { # dir, extra meson options...
    local dir=$1
    shift
    if [ -f "$dir/build.ninja" ]; then
        run_step "configuring $dir (meson setup --reconfigure $*)" meson setup --reconfigure "$dir" "$@"
    else
        run_step "configuring $dir (meson setup $*)" meson setup "$dir" "$@"
    fi
    run_step "building $dir (ninja)" ninja -C "$dir"
}

# libkvq where the loader looks when installed (Debian's multiarch directory; meson picks lib64
# without dpkg-dev, which Debian's loader does not search)
multiarch=$(gcc -print-multiarch 2>/dev/null || true)
libdir=()
[ -n "$multiarch" ] && [ -d "/usr/lib/$multiarch" ] && libdir=(-Dlibdir="lib/$multiarch")
configure build -Dtests=enabled "${libdir[@]}"
case "$what" in
demo)
    exec build/tools/kvq-analyze --per model --format table --calib data/stories260K-calib.h5 data/stories260K.h5
    ;;
figures)
    exec notebooks-export/make_figures.sh --build build figures
    ;;
test)
    say "testing build (meson test: every suite; a line per test as it ends)"
    meson test -C build --print-errorlogs 2>&1 | heartbeat ""
    configure build-asan -Dtests=enabled -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debug
    say "testing build-asan (every suite under AddressSanitizer + UndefinedBehaviorSanitizer)"
    meson test -C build-asan --print-errorlogs 2>&1 | heartbeat ""
    ;;
esac
