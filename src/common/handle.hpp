#pragma once
#include <atomic>
#include <cstddef>
#include <vector>

#include "common/device_caps.hpp"
#include "common/ops.hpp"
#include "common/tensor.hpp"

// The opaque handle behind fce_handle_t.
struct fce_handle {
  fce::Backend backend = fce::Backend::CPU;
  int device_id = 0;
  // Set while a thread's call is inside (check_handle takes it, the call's guard() gives it back): a second
  // thread gets FCE_STATUS_HANDLE_BUSY instead of racing on the state below.
  std::atomic<bool> busy{false};
  // Cached workspace for calls that pass none (grown on demand, freed with the handle).
  void* cached_ws = nullptr;
  size_t cached_ws_bytes = 0;
  // CUDA state (unused for CPU handles).
  fce::DeviceCaps caps;
  std::vector<fce::ClusterFitEntry> cluster_fits;  // occupancy answers (src/cuda/device.cu)
  void* blas = nullptr;  // backend-owned BLAS state (cuBLAS handle etc.)
};

namespace fce {

// Validates the handle pointer and takes the handle for the calling entry point (its busy flag, given back
// when the entry point's guard() returns): FCE_STATUS_HANDLE_BUSY when another thread's call holds it. An
// entry point this thread is already inside on the same handle (one entry point calling another) takes
// nothing. Every entry point that touches a handle's state calls it first, inside guard().
fce_handle* check_handle(fce_handle_t h);
// Resolves the caller's workspace (checks its size and alignment) or the handle's cached one, grown to
// `need` in the order of `stream` (the header's Workspace paragraph).
Workspace resolve_workspace(fce_handle* h, void* ws, size_t ws_bytes, size_t need, fce_stream_t stream);
// Writes a workspace size to a caller pointer.
void write_size(size_t* out, size_t value);

}  // namespace fce
