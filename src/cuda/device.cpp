// CUDA device management for handles: discovery, properties, workspace memory.
#include "common/handle.hpp"
#include "cuda/blas.hpp"
#include "cuda/cuda_util.hpp"

namespace fce::cuda {

void create_device(fce_handle* h, int device_id) {
  int count = 0;  // may be left unwritten on failure
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess) {
    // 35 insufficient driver, 34 stub library, 100 no device: all mean "no usable GPU here".
    cudaGetLastError();
    raise(FCE_STATUS_NO_DEVICE, "cudaGetDeviceCount failed: %s (%s, %d)", cudaGetErrorString(e), cudaGetErrorName(e),
          int(e));
  }
  FCE_CHECK(device_id < count, FCE_STATUS_NO_DEVICE, "CUDA ordinal %d requested but %d device(s) present", device_id,
            count);
  check(cudaDeviceGetAttribute(&h->sm_count, cudaDevAttrMultiProcessorCount, device_id), "cudaDeviceGetAttribute");
  check(cudaDeviceGetAttribute(&h->max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_id),
        "cudaDeviceGetAttribute");
}

void destroy_device(fce_handle* h) {
  DeviceGuard g(h->device_id);
  cublas_release(h);
}

void* device_alloc(fce_handle* h, size_t bytes) {
  DeviceGuard g(h->device_id);
  void* p = nullptr;
  check(cudaMalloc(&p, bytes), "cudaMalloc (workspace)");
  return p;
}

void device_free(fce_handle* h, void* p) {
  if (!p) return;
  DeviceGuard g(h->device_id);
  // The cached workspace may still be in use by enqueued work.
  cudaDeviceSynchronize();
  cudaFree(p);
}

}  // namespace fce::cuda
