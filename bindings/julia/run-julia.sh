#!/usr/bin/env bash
# Runs the project's Julia 1.5.3 (Debian bullseye's, unpacked into .julia-root/ by tools/deps.d/julia.sh).
# Override with JULIA=/path/to/julia. Uses a private depot (.julia-root/depot) so nothing in ~/.julia
# (or a newer Julia's packages) interferes.
set -euo pipefail
top="$(cd "$(dirname "$0")/../.." && pwd)"
if [ -n "${JULIA:-}" ]; then exec "$JULIA" "$@"; fi
root="${FUSEDCE_JULIA_ROOT:-$top/.julia-root}"
bin="$root/root/usr/bin/julia"
if [ ! -x "$bin" ]; then
  echo "run-julia.sh: no julia at $bin; run tools/install-deps.sh" >&2
  exit 1   # a failure, never a skip: CI must run the Julia tests
fi
lib="$root/root/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="$lib:$lib/julia${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export JULIA_DEPOT_PATH="${JULIA_DEPOT_PATH:-$root/depot}"
export JULIA_PKG_OFFLINE=true
exec "$bin" "$@"
