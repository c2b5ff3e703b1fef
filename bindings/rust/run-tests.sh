#!/usr/bin/env bash
# The Meson `rust` suite: bindings/rust/run-tests.sh <meson build dir>
#   1. generate.sh --check: fusedce-sys/src/bindings.rs must be what bindgen makes of the header today;
#      cargo fmt --check: the crates' sources as rustfmt.toml formats them;
#   2. cargo test --offline on both crates against the library in the build dir (bindgen's layout tests,
#      every op against float64 references, errors, versions, the real-input sample when present, doctests;
#      the example is compiled too);
#   3. the perplexity example on the first 256 positions of the sample, when the sample is present.
# Missing cargo or bindgen is a failure, not a skip: CI must run these tests (tools/deps.d/rust.sh
# installs bindgen; cargo comes with the machine, or Debian's `cargo`).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -ne 1 ]; then
  echo "usage: $0 <meson build dir>" >&2
  exit 2
fi
build="$(cd "$1" && pwd)"

# rustup installs into ~/.cargo/bin, which a non-login shell may not have on PATH; when it exists it is
# the toolchain meant (ahead of a Debian /usr/bin/cargo).
cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
if [ -x "$cargo_bin/cargo" ]; then
  case ":$PATH:" in *":$cargo_bin:"*) ;; *) export PATH="$cargo_bin:$PATH" ;; esac
fi
for tool in cargo rustc rustfmt bindgen; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "run-tests.sh: '$tool' not found: run tools/install-deps.sh (tools/deps.d/rust.sh)" >&2
    exit 1
  fi
done
echo "== $(cargo --version); $(rustc --version); $(bindgen --version 2>&1 | head -1)"

echo "== bindings/rust/generate.sh --check"
"$here/generate.sh" --check

if [ ! -e "$build/libfusedce.so" ]; then
  echo "run-tests.sh: $build/libfusedce.so not found (build the library first)" >&2
  exit 1
fi
export FUSEDCE_LIB_DIR="$build"
export LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CARGO_TARGET_DIR="$build/bindings/rust/target"
export CARGO_TERM_COLOR=never
cd "$here"

echo "== cargo fmt --check"
cargo fmt --all --check

echo "== cargo test --offline --workspace (FUSEDCE_LIB_DIR=$FUSEDCE_LIB_DIR)"
cargo test --offline --workspace

sample="${FUSEDCE_SAMPLE:-$here/../../data/smollm2_kjv_sample.safetensors}"
if [ -f "$sample" ]; then
  echo "== cargo run --example perplexity -- --rows 256"
  cargo run --offline --quiet -p fusedce --profile test --example perplexity -- "$sample" --rows 256
else
  echo "== perplexity example skipped: $sample is absent (tools/fetch-sample.sh makes it)"
fi
