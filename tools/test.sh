#!/usr/bin/env bash
# Sets up, builds and runs every test suite, then prints one line: N passed, N failed, N skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }
BUILD=${BUILD:-build}
if [ ! -f "$BUILD/build.ninja" ]; then
  # -Ddev=true: the probes in dev/ compile too (they include the kernels' internal headers)
  meson setup "$BUILD" -Ddev=true || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }
fi
bash tools/cuda-stale.sh "$BUILD"
ninja -C "$BUILD" || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }
meson test -C "$BUILD" --print-errorlogs --num-processes "$(nproc)" "$@"
python3 tools/test_summary.py "$BUILD/meson-logs/testlog.json"
