// Unit-test main: every test runs against a CPU handle; device hooks are no-ops.
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

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
