#!/usr/bin/env bash
# Meson 1.0 (Debian 12) asks nvcc for no dependency files, so ninja does not rebuild a .cu object when a
# header it includes changes. Run before ninja: when a header of the project is newer than the oldest
# CUDA object in BUILD, the CUDA sources are touched so that every .cu object is rebuilt.
# Usage: tools/cuda-stale.sh BUILD
set -euo pipefail
cd "$(dirname "$0")/.."
oldest=$(find "$1" -name '*.cu.o' -printf '%T@ %p\n' 2>/dev/null | sort -n | head -1 | cut -d' ' -f2- || true)
[ -n "$oldest" ] || exit 0
if [ -n "$(find src include tests/common benchmarks -newer "$oldest" \( -name '*.h' -o -name '*.hpp' -o -name '*.cuh' \) | head -1)" ]; then
  echo "cuda-stale.sh: a header is newer than $oldest: rebuilding every .cu object"
  find src tests benchmarks dev -name '*.cu' -exec touch {} +
fi
