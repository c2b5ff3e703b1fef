// CUDA runtime helpers for the backend (host side).
#pragma once
#include <cuda_runtime.h>

#include "common/error.hpp"
#include "common/handle.hpp"

namespace fce::cuda {

// Throws CUDA_ERROR (or OUT_OF_MEMORY) with the runtime's text.
inline void check(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return;
  const fce_status_t s = e == cudaErrorMemoryAllocation ? FCE_STATUS_OUT_OF_MEMORY : FCE_STATUS_CUDA_ERROR;
  raise(s, "%s failed: %s (%s, %d)", what, cudaGetErrorString(e), cudaGetErrorName(e), int(e));
}

// Makes `device` current for the scope and restores the caller's device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int cur = -1;
    if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = 0;
};

// Clusters larger than the portable 8 blocks need a per-kernel, per-device opt-in: true once `kernel` may
// launch clusters of C blocks on the current device (set once per process and device).
bool allow_cluster(const void* kernel, int C);

// Clusters of C blocks of `threads` threads (`smem` dynamic shared bytes) of `kernel` that the handle's
// device holds at once (0 when the runtime cannot say), asked once per handle. Clusters of C blocks must fit
// in one GPC each, so fewer fit than SMs / C (H100: 15 of 8 blocks of 1024 threads, not 16).
int max_active_clusters(fce_handle* h, const void* kernel, int C, int threads, size_t smem = 0);

}  // namespace fce::cuda
