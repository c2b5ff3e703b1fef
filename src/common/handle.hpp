#pragma once
#include <cstddef>
#include <vector>

#include "common/device_caps.hpp"
#include "common/ops.hpp"
#include "common/tensor.hpp"

// The opaque handle behind fce_handle_t.
struct fce_handle {
  fce::Backend backend = fce::Backend::CPU;
  int device_id = 0;
  // Cached workspace for calls that pass none (grown on demand, freed with the handle).
  void* cached_ws = nullptr;
  size_t cached_ws_bytes = 0;
  // CUDA state (unused for CPU handles).
  fce::DeviceCaps caps;
  std::vector<fce::ClusterFitEntry> cluster_fits;  // occupancy answers (src/cuda/device.cu)
  void* blas = nullptr;  // backend-owned BLAS state (cuBLAS handle etc.)
};

namespace fce {

// Validates the handle pointer and returns it.
fce_handle* check_handle(fce_handle_t h);
// Resolves the caller's workspace (checks its size and alignment) or the handle's cached one, grown to
// `need` in the order of `stream` (the header's Workspace paragraph).
Workspace resolve_workspace(fce_handle* h, void* ws, size_t ws_bytes, size_t need, fce_stream_t stream);
// Writes a workspace size to a caller pointer.
void write_size(size_t* out, size_t value);

}  // namespace fce
