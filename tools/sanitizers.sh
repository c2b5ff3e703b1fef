#!/usr/bin/env bash
# The unit and ABI suites under AddressSanitizer + UndefinedBehaviorSanitizer, and the unit tests under
# valgrind memcheck. Any report fails the run.
#
#   tools/sanitizers.sh            both
#   tools/sanitizers.sh asan       meson build dir $ASAN_BUILD (default build-asan): -Db_sanitize=address,undefined,
#                                  CUDA off; `meson test --suite unit --suite abi` there
#   tools/sanitizers.sh valgrind   the reliability suite's memcheck runs of the normal build $BUILD (default
#                                  build), one after another: tests/reliability/memcheck.py (each unit
#                                  executable without its slowest tests, the fuzz seed corpus), then its check
#                                  that they call every exported function
#
# Exit status 0 only when every run is clean; 1 when a tool (valgrind, meson, ninja) is missing, so a
# machine without them fails instead of passing silently.
set -euo pipefail
cd "$(dirname "$0")/.."

ASAN_BUILD=${ASAN_BUILD:-build-asan}
BUILD=${BUILD:-build}
what=${1:-all}

need() {
  for t in "$@"; do
    command -v "$t" >/dev/null 2>&1 || { echo "sanitizers.sh: '$t' not found (tools/install-deps.sh installs it)" >&2; exit 1; }
  done
}

run_asan() {
  need meson ninja
  if [ ! -f "$ASAN_BUILD/build.ninja" ]; then
    # b_lundef=false: a sanitized shared library leaves the sanitizer runtime's symbols to the executable.
    meson setup "$ASAN_BUILD" -Db_sanitize=address,undefined -Db_lundef=false -Dcuda=disabled -Dbenchmarks=false -Dtorch_eager=disabled \
      -Dbuildtype=debugoptimized
  fi
  ninja -C "$ASAN_BUILD"
  # Every report is fatal. detect_leaks: LeakSanitizer at exit. Known library bugs are suppressed by name in
  # tests/reliability/{ubsan,lsan}.supp (each entry documented there and in docs/reliability.md).
  local supp=$PWD/tests/reliability
  # Every test of the unit and abi suites but abi/pkgconfig_link and abi/install_tree: they link plain
  # (unsanitized) C programs against the sanitized library, which ASan refuses to load ("runtime does not
  # come first"); they check packaging, not memory. Nor abi/api_reference (Doxygen on the header: no library
  # code runs).
  local tests
  tests=$(meson test -C "$ASAN_BUILD" --list --no-rebuild --suite unit --suite abi 2>/dev/null |
          sed -n 's|^\([^:]*\):[^/]* / \(.*\)$|\1:\2|p' |
          grep -v -E ':(pkgconfig_link|install_tree|api_reference)$' |
          grep -v -E -- '-(AVX2|SSE4)$' || true)  # the narrower vector targets: their -SCALAR runs stay
  [ -n "$tests" ] || { echo "sanitizers.sh: no unit/abi tests listed in $ASAN_BUILD" >&2; exit 1; }
  # GTEST_FILTER: Validation.HandlesStatusesAndVersion expects "cuda" in the NO_DEVICE message, which a
  # -Dcuda=disabled build words "built without the CUDA backend"; it fails in every CUDA-less build,
  # sanitized or not (reported with the findings in docs/reliability.md). It runs under memcheck instead.
  # shellcheck disable=SC2086
  GTEST_FILTER=${ASAN_GTEST_FILTER:--Validation.HandlesStatusesAndVersion} \
  ASAN_OPTIONS=halt_on_error=1:abort_on_error=1:detect_leaks=1:print_stacktrace=1:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1 \
  UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:suppressions=$supp/ubsan.supp \
  LSAN_OPTIONS=suppressions=$supp/lsan.supp:print_suppressions=0 \
    meson test -C "$ASAN_BUILD" --print-errorlogs --num-processes "$(nproc)" $tests
}

run_valgrind() {
  need valgrind ninja meson python3
  ninja -C "$BUILD"
  # The memcheck runs of the reliability suite (tests/reliability/meson.build), one after another.
  local names rc=0 n
  names=$(meson introspect --tests "$BUILD" | python3 -c '
import json, sys
print(" ".join(t["name"][len("memcheck "):] for t in json.load(sys.stdin) if t["name"].startswith("memcheck ")))')
  [ -n "$names" ] || { echo "sanitizers.sh: no memcheck tests in $BUILD" >&2; exit 1; }
  for n in $names; do
    python3 tests/reliability/memcheck.py run "$BUILD" "$n" || rc=1
  done
  # shellcheck disable=SC2086
  python3 tests/reliability/memcheck.py entry-points "$BUILD" $names || rc=1
  return $rc
}

case $what in
  asan) run_asan ;;
  valgrind) run_valgrind ;;
  all) run_asan && run_valgrind ;;
  *) echo "usage: $0 [asan|valgrind|all]" >&2; exit 2 ;;
esac
