#!/usr/bin/env bash
# check_cuda_headers.sh — kernels/meson.build names every project header that a
# kernels/*.cu file includes (nvcc -M). Meson 1.0 gives nvcc no depfile, so that
# list is what rebuilds the CUDA module when a header changes; a header missing
# from it would let the module's objects disagree on a struct's layout.
#   check_cuda_headers.sh SOURCE_DIR BUILD_DIR NVCC
set -u
src=$(realpath "$1") build=$(realpath "$2") nvcc=$3
list="$src/kernels/meson.build"
pass=0 fail=0
for cu in "$src"/kernels/*.cu; do
    if ! deps=$("$nvcc" -M -I"$build" -I"$src/lib" -I"$src/kernels" -I"$src" "$cu" 2>&1); then
        echo "FAIL: nvcc -M $cu: $(echo "$deps" | tail -n 1)"
        fail=$((fail + 1))
        continue
    fi
    for f in $(echo "$deps" | tr ' \\' '\n\n' | grep -v ':$'); do
        [ -f "$f" ] || continue
        f=$(realpath "$f")
        case "$f" in "$build"/*) continue ;; esac # generated: meson regenerates it and what uses it
        rel=$(realpath --relative-to="$src" "$f")
        case "$rel" in
        kernels/*.cu | ../* | /*) continue ;; # the unit itself; system and CUDA headers
        kernels/*) want="'${rel#kernels/}'" ;;
        *) want="'../$rel'" ;;
        esac
        if grep -qF "$want" "$list"; then pass=$((pass + 1)); else
            echo "FAIL: $(basename "$cu") includes $rel, which kernels/meson.build's kvq_cuda_headers does not name"
            fail=$((fail + 1))
        fi
    done
done
[ $pass -gt 0 ] || { echo "FAIL: no project header found in nvcc -M's output"; fail=$((fail + 1)); }
echo "cuda-headers: $pass passed, $fail failed"
[ $fail -eq 0 ]
