#!/usr/bin/env bash
# Packs what the GPU machine needs into .gpu/ (git-ignored), built here: the library, the gpu-suite
# executables, the benchmarks, the demo and their non-CUDA runtime libraries. The GPU machine has the
# CUDA runtime but not OpenBLAS; run tools/gpu-session.sh there with `.gpu` carried.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
ninja -C "$BUILD"
rm -rf .gpu && mkdir -p .gpu/bin .gpu/lib
cp -a "$BUILD"/libfusedce.so "$BUILD"/libfusedce.so.[0-9]* .gpu/lib/
rm -rf .gpu/lib/*.p
cp "$BUILD"/tests/gpu_* .gpu/bin/ 2>/dev/null || true
rm -rf .gpu/bin/*.p
for b in "$BUILD"/benchmarks/bench_* "$BUILD"/examples/demo_real "$BUILD"/examples/quickstart; do
  [ -f "$b" ] && [ -x "$b" ] && cp "$b" .gpu/bin/
done
for l in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libgomp.so.1 libcjson.so.1; do
  p=$(ldconfig -p | awk -v l="$l" '$1 == l {print $NF; exit}')
  [ -n "$p" ] && cp -L "$p" .gpu/lib/
done
cp -L /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 .gpu/lib/ 2>/dev/null || true
mkdir -p .gpu/compat && cp -L /lib/x86_64-linux-gnu/libstdc++.so.6 .gpu/compat/
du -sh .gpu
