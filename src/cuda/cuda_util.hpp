// CUDA runtime helpers for the backend (host side).
#pragma once
#include <cuda_runtime.h>

#include "common/error.hpp"

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

}  // namespace fce::cuda
