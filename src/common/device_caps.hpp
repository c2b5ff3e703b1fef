// What a CUDA device and this build of the library can do, read once when a handle is made
// (src/cuda/device.cu) and kept on the handle: the planners (src/cuda/plan.hpp) take it as input, so a
// plan depends on the call's shape and these fields only.
#pragma once
#include <cstddef>

namespace fce {

struct DeviceCaps {
  int arch = 0;            // compute capability, major * 10 + minor (90: H100)
  int sm_count = 0;
  int max_smem_optin = 0;  // shared bytes a block may opt into
  bool clusters = false;   // thread-block clusters: the device launches them and sm_90 code was built
  bool mempools = false;   // stream-ordered allocation (cudaMallocAsync)
};

// One answer of the runtime's cluster-occupancy query, cached on the handle.
struct ClusterFitEntry {
  const void* kernel;
  int C, threads;
  size_t smem;
  int n;         // clusters resident at once, 0 when the runtime cannot say
  bool opt_in;   // non-portable cluster sizes allowed for the kernel
};

}  // namespace fce
