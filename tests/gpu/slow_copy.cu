// A producer kernel for the programmatic-dependent-launch test (test_gpu_extra.cpp, GpuPdl).
#include <cuda_runtime.h>

#include <cstddef>

namespace {

// Lets the next kernel of the stream launch at once, then copies src to dst only after spinning `spin_ns`:
// a programmatic dependent launched after it that read dst before griddepcontrol.wait would see the old
// bytes.
__global__ void slow_copy_kernel(const unsigned char* src, unsigned char* dst, size_t bytes,
                                 unsigned long long spin_ns) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while (t - t0 < spin_ns);
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < bytes; i += size_t(gridDim.x) * blockDim.x)
    dst[i] = src[i];
}

}  // namespace

namespace fct {
cudaError_t launch_slow_copy(const void* src, void* dst, size_t bytes, unsigned long long spin_ns, cudaStream_t s) {
  slow_copy_kernel<<<64, 256, 0, s>>>(static_cast<const unsigned char*>(src), static_cast<unsigned char*>(dst), bytes,
                                      spin_ns);
  return cudaGetLastError();
}
}  // namespace fct
