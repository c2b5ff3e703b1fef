#!/usr/bin/env bash
# The unit and ABI suites under AddressSanitizer + UndefinedBehaviorSanitizer, and the unit tests under
# valgrind memcheck. Any report fails the run.
#
#   tools/sanitizers.sh            both
#   tools/sanitizers.sh asan       meson build dir $ASAN_BUILD (default build-asan): -Db_sanitize=address,undefined,
#                                  CUDA off; `meson test --suite unit --suite abi` there
#   tools/sanitizers.sh valgrind   the unit-test executables of the normal build $BUILD (default build) under
#                                  memcheck, with the gtest filter below (valgrind runs ~50x slower)
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

# Tests that take >2 s natively (the float64 references of 50k-150k-column rows): minutes under memcheck. The
# same code paths run under memcheck in the other tests of each file (every op, dtype, option, in-place and
# padded layouts, top-K, chunked linear CE); ASan runs everything. The contract's numerics tests (offsets to
# 1e4, huge logits, subnormal caps, OpenBLAS thread counts) are covered there too: 10+ minutes under memcheck.
VALGRIND_FILTER=${VALGRIND_FILTER:--CrossEntropy.ShapesDtypesReductions:CrossEntropy.ManyRowsFusedGradient:Logsumexp.ShapesAndDtypes:KdLoss.LargeVocabularies:KdLoss.ForwardOnlyManyRows:KdLoss.GradientManyRows:Logsumexp.FewAlignedRowsWithPartialLastVector:TempSoftmax.FewAlignedRowsWithPartialLastVector:TempSoftmax.ManyLongAlignedRows:TempSoftmax.FewRowsProbabilitiesOnly:TempSoftmax.ManyRowsProbabilitiesOnly:LinearCrossEntropy.QueriedWorkspace:Contract.KdInvariantToACommonLogitOffset:Contract.SoftmaxHugeLogitsAtInfiniteAndHugeTemperatures:Contract.CrossEntropySubnormalSoftcap:Contract.LinearCrossEntropyIndependentOfThreadCounts:KdVocabParallel.ManyRowsLongShards:VocabParallel.ManyRanksMegatronSplit:KdVocabParallel.ManyRanksMegatronSplit}

run_valgrind() {
  need valgrind ninja meson python3
  # Inside `meson test` (tests/reliability/meson.build) the build is already up to date: no nested ninja.
  [ -n "${SANITIZERS_NO_BUILD:-}" ] || ninja -C "$BUILD"
  local rc=0 t exe
  # Every executable of the unit suite, from meson's introspection (new unit tests are picked up), once: the
  # suite's reruns of an executable on other CPU instruction sets (FCE_TEST_SIMD_TARGET) are skipped here.
  local list
  list=$(meson introspect --tests "$BUILD" | python3 -c '
import json, sys
seen = set()
for t in json.load(sys.stdin):
    if any(s.endswith(":unit") or s == "unit" for s in t["suite"]) and t["cmd"][0] not in seen:
        seen.add(t["cmd"][0])
        print(t["name"], t["cmd"][0])')
  [ -n "$list" ] || { echo "sanitizers.sh: no unit tests in $BUILD" >&2; exit 1; }
  while read -r t exe; do
    [ -x "$exe" ] || { echo "sanitizers.sh: $exe missing" >&2; exit 1; }
    echo "== valgrind memcheck: test_$t (gtest filter $VALGRIND_FILTER)"
    local start=$SECONDS st=0
    # Exit 99 = a memcheck error (invalid access, uninitialised value used, definite/indirect leak).
    # OMP_NUM_THREADS=2: the threaded paths run, without serialising one worker per core of a big machine.
    OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=1 valgrind --tool=memcheck --error-exitcode=99 --leak-check=full \
        --show-leak-kinds=definite,indirect --errors-for-leak-kinds=definite,indirect --track-origins=yes \
        --suppressions=tests/valgrind.supp --gen-suppressions=all --quiet \
        "$exe" --gtest_filter="$VALGRIND_FILTER" --gtest_brief=1 || st=$?
    case $st in
      0) ;;
      99) echo "sanitizers.sh: memcheck errors in test_$t" >&2; rc=1 ;;
      # gtest's own failure status: an assertion, not a memory error. The unit suite runs the same tests
      # natively and owns them (several tests draw random inputs from std::random_device, and one is flaky,
      # see docs/reliability.md); here it is reported, not counted.
      1) echo "sanitizers.sh: WARNING: test_$t had gtest assertion failures under memcheck (no memcheck error)" >&2 ;;
      *) echo "sanitizers.sh: test_$t died under memcheck (status $st)" >&2; rc=1 ;;
    esac
    echo "   $((SECONDS - start)) s"
  done <<< "$list"
  return $rc
}

case $what in
  asan) run_asan ;;
  valgrind) run_valgrind ;;
  all) run_asan && run_valgrind ;;
  *) echo "usage: $0 [asan|valgrind|all]" >&2; exit 2 ;;
esac
