#!/usr/bin/env bash
# Quick start: installs the dependencies, makes the real-input sample, builds, and runs the demo on it
# (docs/demo.md). Extra arguments go to the demo, e.g. `tools/demo.sh --device cpu`.
# BUILD=<dir> picks the build directory (default: build).
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
bash tools/install-deps.sh
bash tools/fetch-sample.sh
if [ ! -f "$BUILD/build.ninja" ]; then
  meson setup "$BUILD"
fi
ninja -C "$BUILD" examples/demo_real  # the demo alone: tools/test.sh builds the rest
exec "$BUILD/examples/demo_real" "$@" data/smollm2_kjv_sample.safetensors
