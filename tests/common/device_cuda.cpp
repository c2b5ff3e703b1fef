// GPU-suite main: the same tests run against a CUDA handle on device 0, on a non-default stream.
// Exits 77 (skipped) when there is no usable GPU.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

#include "testing.hpp"

namespace fct {
namespace {
cudaStream_t g_stream = nullptr;
void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::abort();
  }
}
}  // namespace
Target& target() { static Target t{kDLCUDA, 0}; return t; }
void* dev_alloc(size_t bytes) {
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc");
  // Initialized (padding included), so compute-sanitizer's initcheck flags only the library's reads. On the
  // tests' stream and waited for: a cudaMemset on the legacy stream is not ordered with a non-blocking
  // stream, and under initcheck it once landed after the library's kernels, over their results.
  check(cudaMemsetAsync(p, 0xee, bytes, g_stream), "cudaMemsetAsync");
  check(cudaStreamSynchronize(g_stream), "cudaMemsetAsync sync");
  return p;
}
void dev_free(void* p) { cudaFree(p); }
void dev_upload(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, g_stream), "upload");
  check(cudaStreamSynchronize(g_stream), "upload sync");
}
void dev_download(void* dst, const void* src, size_t bytes) {
  check(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, g_stream), "download");
  check(cudaStreamSynchronize(g_stream), "download sync");
}
void dev_sync() { check(cudaStreamSynchronize(g_stream), "sync"); }
fce_stream_t test_stream() { return reinterpret_cast<fce_stream_t>(g_stream); }
}  // namespace fct

int main(int argc, char** argv) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    std::printf("no CUDA device (%s): skipped\n", e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
    return 77;
  }
  fct::check(cudaStreamCreateWithFlags(&fct::g_stream, cudaStreamNonBlocking), "stream");
  ::testing::InitGoogleTest(&argc, argv);
  const int rc = RUN_ALL_TESTS();
  cudaStreamDestroy(fct::g_stream);
  return rc;
}
