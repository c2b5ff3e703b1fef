// Unit-test main: every test runs against a CPU handle; device hooks are no-ops.
#include <hwy/targets.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "testing.hpp"

namespace fct {
Target& target() { static Target t; return t; }
void* dev_alloc(size_t) { return nullptr; }
void dev_free(void*) {}
void dev_upload(void*, const void*, size_t) {}
void dev_download(void*, const void*, size_t) {}
void dev_sync() {}
fce_stream_t test_stream() { return nullptr; }
}  // namespace fct

// FCE_TEST_SIMD_TARGET=<Highway target name, e.g. AVX2, SSE4, SCALAR> runs the library's CPU kernels on
// that instruction set instead of the CPU's best (exit 77, skipped, where the CPU lacks it).
static int choose_simd_target() {
  const char* want = std::getenv("FCE_TEST_SIMD_TARGET");
  if (!want || !*want) return 0;
  for (int64_t bits = hwy::SupportedTargets(); bits; bits &= bits - 1) {
    const int64_t t = bits & -bits;
    if (std::strcmp(hwy::TargetName(t), want) == 0) {
      hwy::SetSupportedTargetsForTest(t);
      hwy::GetChosenTarget().Update(hwy::SupportedTargets());
      std::printf("CPU kernels on %s\n", want);
      return 0;
    }
  }
  std::printf("this CPU does not run the %s target\n", want);
  return 77;
}

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  if (const int rc = choose_simd_target()) return rc;
  return RUN_ALL_TESTS();
}
