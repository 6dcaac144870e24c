#!/usr/bin/env bash
# setup.sh — kvq's one-command set-up on Debian/Ubuntu: installs the missing
# build dependencies (apt-get, when root; sudo otherwise), configures and
# builds with meson, then
#   tools/setup.sh demo   runs kvq-analyze on the bundled real dump (every family, calibrated on the second dump)
#   tools/setup.sh test   runs every test suite, in a normal build and in an
#                         AddressSanitizer + UndefinedBehaviorSanitizer build
#   tools/setup.sh figures regenerates every figure from the bundled data into figures/
#   tools/setup.sh build  only builds (into build/)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-build}
case "$what" in demo|test|figures|build) ;; *) echo "usage: tools/setup.sh demo|test|figures|build" >&2; exit 2 ;; esac

pkgs=(gcc pkg-config meson ninja-build libhdf5-dev libopenblas-dev liblapacke-dev check
      python3-matplotlib python3-numpy python3-h5py) # figure scripts (notebooks-export/), tools/kvq_dump.py
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "setup: installing ${missing[*]}" >&2
    if [ "$(id -u)" = 0 ]; then sudo=""; elif command -v sudo >/dev/null; then sudo="sudo"; else
        echo "setup: error: missing packages ${missing[*]} and not root (install them, then rerun)" >&2
        exit 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

configure() { # dir, extra meson options...
    local dir=$1
    shift
    if [ -f "$dir/build.ninja" ]; then
        meson setup --reconfigure "$dir" "$@" >/dev/null
    else
        meson setup "$dir" "$@" >/dev/null
    fi
    ninja -C "$dir" >/dev/null
}

configure build -Dtests=enabled
case "$what" in
demo)
    exec build/tools/kvq-analyze --per model --format table --calib data/stories260K-calib.h5 data/stories260K.h5
    ;;
figures)
    exec notebooks-export/make_figures.sh --build build figures
    ;;
test)
    meson test -C build --print-errorlogs
    configure build-asan -Dtests=enabled -Db_sanitize=address,undefined -Db_lundef=false -Dbuildtype=debug
    meson test -C build-asan --print-errorlogs
    ;;
esac
