#!/usr/bin/env bash
# Sets up, builds and runs every test suite, then prints one line: N passed, N failed, N skipped.
set -uo pipefail
cd "$(dirname "$0")/.."
bash tools/install-deps.sh || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }
BUILD=${BUILD:-build}
# GPU code for one architecture, sm_90 (the GPU runs' H100/H200; machine code and PTX): no test here runs a kernel. The release
# build's other architectures (meson_options.txt's gencode) are compiled by the test cuda_compile (tests/meson.build),
# one kernel file each. FCE_TEST_GENCODE="" keeps meson's default (all of them).
GENCODE=${FCE_TEST_GENCODE--arch=sm_90}
if [ ! -f "$BUILD/build.ninja" ]; then
  # -Ddev=true: the probes in dev/ compile too (they include the kernels' internal headers)
  meson setup "$BUILD" -Ddev=true ${GENCODE:+"-Dgencode=$GENCODE"} || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }
fi
bash tools/cuda-stale.sh "$BUILD"
ninja -C "$BUILD" || { echo "0 passed, 1 failed, 0 skipped"; exit 1; }
meson test -C "$BUILD" --print-errorlogs --num-processes "$(nproc)" "$@"
python3 tools/test_summary.py "$BUILD/meson-logs/testlog.json" --times "$BUILD/meson-logs/test-times.tsv"
