# shellcheck shell=bash
# Reliability suite (tests/reliability): sourced by tools/install-deps.sh, which defines apt_install.
# - clang + libclang-rt-14-dev: tools/fuzz.sh builds the libFuzzer target with clang 14
#   (-fsanitize=fuzzer,address,undefined; the runtimes are in libclang-rt-14-dev).
# - llvm: llvm-symbolizer, so ASan/UBSan/libFuzzer reports carry file:line.
# - valgrind: tools/sanitizers.sh valgrind (memcheck over the unit tests).
# The ASan+UBSan meson build uses g++'s own runtimes (libasan8, libubsan1: dependencies of g++).
apt_install clang libclang-rt-14-dev llvm valgrind
