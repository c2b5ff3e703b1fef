// F1 (docs/reliability.md): fce_status_string() with a status this build lacks is undefined behaviour in C++.
//   clang++ -std=c++17 -fsanitize=undefined -DFCE_BUILDING_LIBRARY -Iinclude -Isrc src/common/error.cpp \
//     tests/fuzz/repro/f1_status_enum.cpp -o /tmp/f1 && /tmp/f1
// Expected today: "runtime error: load of value 16, which is not a valid value for type 'fce_status_t'".
#include <fusedce/fusedce.h>

#include <cstdio>

int main() { std::printf("%s\n", fce_status_string(static_cast<fce_status_t>(16))); }
