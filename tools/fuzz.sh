#!/usr/bin/env bash
# Builds the libFuzzer target tests/fuzz/fuzz_api.cpp (the library's CPU sources compiled in, clang with
# -fsanitize=fuzzer,address,undefined) and runs it.
#
#   tools/fuzz.sh [SECONDS] [libFuzzer flags...]   default 60: the smoke run of the meson 'reliability' suite
#   tools/fuzz.sh 3600 -jobs=2 -workers=2          a longer local run on both cores
#   tools/fuzz.sh --build                          build only
#   tools/fuzz.sh --merge                          minimize build-fuzz/corpus + tests/fuzz/corpus into
#                                                  tests/fuzz/corpus (then commit it)
#   tools/fuzz.sh --repro FILE                     run one input (a crash artifact) and print the report
#
# New inputs go to build-fuzz/corpus (git-ignored); tests/fuzz/corpus is the committed seed corpus, read only
# here. Crash inputs land in build-fuzz/artifacts/. Exit status: 0 when the run ends without a finding, 1
# otherwise (also when clang or libFuzzer's runtime is missing: the caller must not mistake that for a pass).
# Environment: FUZZ_BUILD (default build-fuzz), CXX_FUZZ (default clang++), FCE_FUZZ_KNOWN_BUGS=1 makes the
# known library bugs reachable and fatal (see tests/fuzz/fuzz_api.cpp and docs/reliability.md).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${FUZZ_BUILD:-build-fuzz}
CXX=${CXX_FUZZ:-clang++}
mode=run
secs=60
case "${1:-}" in
  --build) mode=build; shift ;;
  --merge) mode=merge; shift ;;
  --repro) mode=repro; shift ;;
  ''|-*) ;;
  *) secs=$1; shift ;;
esac

if ! command -v "$CXX" >/dev/null 2>&1; then
  echo "fuzz.sh: $CXX not found; install clang and libclang-rt-14-dev (tools/install-deps.sh)" >&2
  exit 1
fi

mkdir -p "$OUT/obj" "$OUT/corpus" "$OUT/artifacts"
SAN="-fsanitize=address,undefined -fno-sanitize-recover=all"
# BLIS, the CPU GEMMs of linear CE: Debian's libblis-serial-dev, where meson.build finds it (BLIS_INC, BLIS_LIB
# name another build).
MULTIARCH=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
BLIS_INC=${BLIS_INC:-/usr/include/$MULTIARCH/blis-serial}
BLIS_LIB=${BLIS_LIB:-/usr/lib/$MULTIARCH/blis-serial/libblis.a}
CXXFLAGS="-std=c++17 -O1 -g -fno-omit-frame-pointer $SAN -DFCE_BUILDING_LIBRARY -Iinclude -Isrc -isystem $BLIS_INC"
LIB_SRCS=(src/common/*.cpp src/cpu/*.cpp src/cuda/no_cuda.cpp)

# Rebuild when a source, a header or the flags changed (a content hash, no timestamps).
stamp=$( { echo "$CXX $CXXFLAGS"; "$CXX" --version | head -1;
           cat "${LIB_SRCS[@]}" src/common/*.hpp src/cpu/*.hpp include/fusedce/fusedce.h tests/fuzz/fuzz_api.cpp; } |
         sha256sum | cut -c1-16)
if [ ! -x "$OUT/fuzz_api" ] || [ "$(cat "$OUT/stamp" 2>/dev/null)" != "$stamp" ]; then
  echo "fuzz.sh: building $OUT/fuzz_api" >&2
  objs=()
  pids=()
  for s in "${LIB_SRCS[@]}"; do
    o="$OUT/obj/$(echo "$s" | tr '/' '_').o"
    objs+=("$o")
    # Library code gets coverage instrumentation (fuzzer-no-link) so libFuzzer is guided by it.
    $CXX $CXXFLAGS -fsanitize=fuzzer-no-link -c "$s" -o "$o" &
    pids+=($!)
    if [ ${#pids[@]} -ge "$(nproc)" ]; then wait "${pids[0]}"; pids=("${pids[@]:1}"); fi
  done
  for p in "${pids[@]}"; do wait "$p"; done
  $CXX $CXXFLAGS -fsanitize=fuzzer tests/fuzz/fuzz_api.cpp "${objs[@]}" "$BLIS_LIB" -lhwy -lpthread -lm -o "$OUT/fuzz_api"
  echo "$stamp" > "$OUT/stamp"
fi
[ "$mode" = build ] && exit 0

export OMP_NUM_THREADS=1
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=1:detect_leaks=1:print_stacktrace=1:strict_string_checks=1:check_initialization_order=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
COMMON=(-max_len=1024 -timeout=20 -rss_limit_mb=2048 -artifact_prefix="$OUT/artifacts/")

case $mode in
  repro)
    exec "$OUT/fuzz_api" "${COMMON[@]}" "$@"
    ;;
  merge)
    tmp=$(mktemp -d)
    "$OUT/fuzz_api" "${COMMON[@]}" -merge=1 "$tmp" tests/fuzz/corpus "$OUT/corpus"
    rm -f tests/fuzz/corpus/*
    cp "$tmp"/* tests/fuzz/corpus/
    rm -rf "$tmp"
    echo "fuzz.sh: tests/fuzz/corpus now has $(ls tests/fuzz/corpus | wc -l) files, $(du -sb tests/fuzz/corpus | cut -f1) bytes"
    exit 0
    ;;
esac

log="$OUT/last-run.log"
start=$(date +%s)
set +e
"$OUT/fuzz_api" "${COMMON[@]}" -max_total_time="$secs" -print_final_stats=1 "$@" "$OUT/corpus" tests/fuzz/corpus \
  2>&1 | tee "$log" | grep -E '^#[0-9]+ +(INITED|DONE|pulse)|ERROR|oracle failure|KNOWN|SUMMARY|stat::|Test unit written'
rc=${PIPESTATUS[0]}
set -e
elapsed=$(( $(date +%s) - start ))
execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$' | tail -1)
echo "fuzz.sh: exit $rc, ${execs:-?} executions in ${elapsed} s, work corpus $(ls "$OUT/corpus" | wc -l) files," \
     "seed corpus $(ls tests/fuzz/corpus 2>/dev/null | wc -l) files (log: $log)"
exit $(( rc != 0 ))
