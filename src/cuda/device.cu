// CUDA device management for handles: discovery, capabilities (DeviceCaps), occupancy answers, workspace
// memory.
#include <mutex>
#include <utility>
#include <vector>

#include "common/handle.hpp"
#include "cuda/blas.hpp"
#include "cuda/cuda_util.hpp"

namespace fce::cuda {

namespace {

__global__ void arch_probe_kernel() {}

// Thread-block clusters need a device that launches them and device code built for sm_90 or later (a
// build that only JIT-compiles older PTX has no cluster code).
bool clusters_available(int device_id) {
  int launch = 0;
  bool ok = cudaDeviceGetAttribute(&launch, cudaDevAttrClusterLaunch, device_id) == cudaSuccess && launch != 0;
  if (ok) {
    cudaFuncAttributes fa{};
    ok = cudaFuncGetAttributes(&fa, arch_probe_kernel) == cudaSuccess && fa.ptxVersion >= 90;
  }
  if (!ok) cudaGetLastError();  // a failed query is an answer, not an error to report later
  return ok;
}

}  // namespace

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
  DeviceCaps& c = h->caps;
  int major = 0, minor = 0, pools = 0;
  for (auto [out, attr] : {std::pair{&c.sm_count, cudaDevAttrMultiProcessorCount},
                           std::pair{&c.max_smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin},
                           std::pair{&major, cudaDevAttrComputeCapabilityMajor},
                           std::pair{&minor, cudaDevAttrComputeCapabilityMinor},
                           std::pair{&pools, cudaDevAttrMemoryPoolsSupported}})
    check(cudaDeviceGetAttribute(out, attr, device_id), "cudaDeviceGetAttribute");
  c.arch = major * 10 + minor;
  c.mempools = pools != 0;
  DeviceGuard g(device_id);
  c.clusters = clusters_available(device_id);
}

bool allow_cluster(const void* kernel, int C) {
  if (C <= 8) return true;
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  struct Entry {
    int dev;
    const void* kernel;
    bool ok;
  };
  // Process-wide: the opt-in is an attribute of the kernel on a device, whichever handle set it.
  static std::mutex mu;
  static std::vector<Entry> done;
  std::lock_guard<std::mutex> lock(mu);
  for (const Entry& d : done)
    if (d.dev == dev && d.kernel == kernel) return d.ok;
  const bool ok = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1) == cudaSuccess;
  if (!ok) cudaGetLastError();  // no opt-in: the caller stays at 8
  done.push_back({dev, kernel, ok});
  return ok;
}

int max_active_clusters(fce_handle* h, const void* kernel, int C, int threads, size_t smem) {
  for (const ClusterFitEntry& e : h->cluster_fits)
    if (e.kernel == kernel && e.C == C && e.threads == threads && e.smem == smem) return e.n;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(C));
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = smem;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = unsigned(C);
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int n = 0;
  const bool opt_in = allow_cluster(kernel, C);
  if (!opt_in || cudaOccupancyMaxActiveClusters(&n, kernel, &cfg) != cudaSuccess) {
    cudaGetLastError();  // no answer is not an error of the call
    n = 0;
  }
  h->cluster_fits.push_back({kernel, C, threads, smem, n, opt_in});
  return n;
}

void destroy_device(fce_handle* h) {
  DeviceGuard g(h->device_id);
  if (h->cached_ws) {
    cudaDeviceSynchronize();  // work still enqueued may use the cached workspace (the header says so)
    if (h->caps.mempools) cudaFreeAsync(h->cached_ws, nullptr);
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
  const cudaError_t e = h->caps.mempools ? cudaMallocAsync(&p, bytes, s) : cudaMalloc(&p, bytes);
  if (e == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    raise(FCE_STATUS_OUT_OF_MEMORY, "cannot allocate a %zu-byte workspace on CUDA device %d", bytes, h->device_id);
  }
  check(e, h->caps.mempools ? "cudaMallocAsync (workspace)" : "cudaMalloc (workspace)");
  return p;
}

void workspace_free(fce_handle* h, void* p, fce_stream_t stream) {
  if (!p) return;
  DeviceGuard g(h->device_id);
  if (h->caps.mempools) {
    check(cudaFreeAsync(p, reinterpret_cast<cudaStream_t>(stream)), "cudaFreeAsync (workspace)");
  } else {  // no stream-ordered free: the old buffer may still be in use by enqueued work
    cudaDeviceSynchronize();
    cudaFree(p);
  }
}

}  // namespace fce::cuda
