#!/usr/bin/env bash
# Packs what the GPU machine needs into .gpu/ (git-ignored), built here: the library, the gpu-suite
# executables, the benchmarks, the demo and their non-CUDA runtime libraries. The GPU machine has the
# CUDA runtime but not OpenBLAS (the demo's; the library carries its BLIS, linked in, and needs only libgomp
# and libhwy of these); run tools/gpu-session.sh there with `.gpu` carried.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build-gpu}  # sm_90 only: small enough to carry
[ -f "$BUILD/build.ninja" ] || meson setup "$BUILD" "-Dgencode=-arch=sm_90"
bash tools/cuda-stale.sh "$BUILD"
ninja -C "$BUILD"
rm -rf .gpu .gpu-stage && mkdir -p .gpu-stage/bin .gpu-stage/lib
G=.gpu-stage
cp -a "$BUILD"/libfusedce.so "$BUILD"/libfusedce.so.[0-9]* $G/lib/
rm -rf $G/lib/*.p
# fusedce.torch's eager fast path (built when torch is importable here), found beside the library
for f in "$BUILD"/bindings/python/src/libfusedce_torch.so "$BUILD"/bindings/python/src/libfusedce_torch.torch; do
  if [ -f "$f" ]; then cp "$f" $G/lib/; fi
done
cp "$BUILD"/tests/gpu_* $G/bin/ 2>/dev/null || true
cp "$BUILD"/tests/vp_nccl $G/bin/ 2>/dev/null || true
rm -rf $G/bin/*.p
for b in "$BUILD"/benchmarks/bench_* "$BUILD"/examples/demo_real_cuda "$BUILD"/examples/quickstart; do
  if [ -f "$b" ] && [ -x "$b" ]; then cp "$b" $G/bin/; fi
done
for l in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0 libgomp.so.1 libcjson.so.1 libhwy.so.1; do
  # no early exit in awk: ldconfig would die of SIGPIPE, which pipefail turns into a failed pack
  p=$(ldconfig -p | awk -v l="$l" '$1 == l && !f {print $NF; f = 1}')
  [ -n "$p" ] && cp -L "$p" $G/lib/
done
cp -L /usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 $G/lib/ 2>/dev/null || true
# The Rust binding's NCCL-mode test (bindings/rust/fusedce/tests/nccl_mode_gpu.rs; gpu-session.sh rust), when
# cargo is here: linked against this build, CUDA's runtime (packed in rt/, not lib/, so that nothing else
# picks it up) and NCCL (the GPU machine's).
export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
if command -v cargo >/dev/null 2>&1; then
  cuda_lib=${CUDA_HOME:-/usr/local/cuda}/lib64
  exe=$(cd bindings/rust/fusedce && FUSEDCE_LIB_DIR="$OLDPWD/$BUILD" RUSTFLAGS="-L $cuda_lib" \
        CARGO_TARGET_DIR="$OLDPWD/$BUILD/cargo-gpu" cargo test --offline --features gpu-tests --test nccl_mode_gpu \
        --no-run 2>&1 | sed -n 's/.*Executable .*(\(.*\))$/\1/p')
  if [ -n "$exe" ]; then
    cp "$exe" $G/bin/rust_nccl_mode_gpu
    mkdir -p $G/rt && cp -L "$cuda_lib/libcudart.so.13" $G/rt/
  else
    echo "gpu-pack.sh: the Rust NCCL-mode test did not build; not packed" >&2
  fi
fi
mkdir -p $G/compat && cp -L /lib/x86_64-linux-gnu/libstdc++.so.6 $G/compat/
# Extra files to ship (e.g. tuning builds of the library): GPU_EXTRA="dir=path ..."
for e in ${GPU_EXTRA:-}; do mkdir -p "$G/${e%%=*}" && cp -L "${e#*=}" "$G/${e%%=*}/"; done
# The sample data when asked (it compresses to fit one call): GPU_SAMPLE=1
if [ "${GPU_SAMPLE:-0}" = 1 ]; then mkdir -p $G/data && cp data/smollm2_kjv_sample.safetensors $G/data/; fi
mkdir -p .gpu && tar -C $G -cf - . | xz -T2 -6 > .gpu/pack.tar.xz
rm -rf $G
du -sh .gpu/pack.tar.xz
