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
  int pools = 0;
  check(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device_id), "cudaDeviceGetAttribute");
  h->mempools = pools != 0;
}

void destroy_device(fce_handle* h) {
  DeviceGuard g(h->device_id);
  if (h->cached_ws) {
    cudaDeviceSynchronize();  // work still enqueued may use the cached workspace (the header says so)
    if (h->mempools) cudaFreeAsync(h->cached_ws, nullptr);
    else cudaFree(h->cached_ws);
    cudaDeviceSynchronize();
  }
  cublas_release(h);
}

void* workspace_alloc(fce_handle* h, size_t bytes, fce_stream_t stream) {
  DeviceGuard g(h->device_id);
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(s, &cs), "cudaStreamIsCapturing");
  FCE_CHECK(cs == cudaStreamCaptureStatusNone, FCE_STATUS_INVALID_ARGUMENT,
            "the handle's cached workspace must grow to %zu bytes, which it cannot while the stream is being "
            "captured into a CUDA graph: pass a workspace (see the op's _workspace_size), or make one call "
            "before the capture", bytes);
  void* p = nullptr;
  const cudaError_t e = h->mempools ? cudaMallocAsync(&p, bytes, s) : cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    raise(FCE_STATUS_OUT_OF_MEMORY, "cannot allocate a %zu-byte workspace on CUDA device %d", bytes, h->device_id);
  }
  check(e, h->mempools ? "cudaMallocAsync (workspace)" : "cudaMalloc (workspace)");
  return p;
}

void workspace_free(fce_handle* h, void* p, fce_stream_t stream) {
  if (!p) return;
  DeviceGuard g(h->device_id);
  if (h->mempools) {
    check(cudaFreeAsync(p, reinterpret_cast<cudaStream_t>(stream)), "cudaFreeAsync (workspace)");
  } else {  // no stream-ordered free: the old buffer may still be in use by enqueued work
    cudaDeviceSynchronize();
    cudaFree(p);
  }
}

}  // namespace fce::cuda
