#include "common/handle.hpp"

#include <cstdlib>

#include "common/error.hpp"

namespace fce {

fce_handle* check_handle(fce_handle_t h) {
  FCE_CHECK(h != nullptr, FCE_STATUS_INVALID_ARGUMENT, "handle is NULL");
  return h;
}

void write_size(size_t* out, size_t value) {
  FCE_CHECK(out != nullptr, FCE_STATUS_INVALID_ARGUMENT, "bytes (output pointer) is NULL");
  *out = value;
}

Workspace resolve_workspace(fce_handle* h, void* ws, size_t ws_bytes, size_t need, fce_stream_t stream) {
  if (ws != nullptr) {
    FCE_CHECK(reinterpret_cast<uintptr_t>(ws) % FCE_WORKSPACE_ALIGNMENT == 0, FCE_STATUS_INVALID_ARGUMENT,
              "workspace %p is not aligned to FCE_WORKSPACE_ALIGNMENT (%d) bytes", ws, FCE_WORKSPACE_ALIGNMENT);
    FCE_CHECK(ws_bytes >= need, FCE_STATUS_WORKSPACE_TOO_SMALL, "workspace has %zu bytes; the op needs %zu",
              ws_bytes, need);
    return {ws, ws_bytes};
  }
  if (need == 0) return {nullptr, 0};
  if (h->cached_ws_bytes < need) {
    void* p = nullptr;
    if (h->backend == Backend::CPU) {
      p = std::aligned_alloc(256, (need + 255) / 256 * 256);
      FCE_CHECK(p != nullptr, FCE_STATUS_OUT_OF_MEMORY, "cannot allocate a %zu-byte workspace", need);
      std::free(h->cached_ws);
    } else {
      p = cuda::workspace_alloc(h, need, stream);  // throws OUT_OF_MEMORY, or during capture
      cuda::workspace_free(h, h->cached_ws, stream);
    }
    h->cached_ws = p;
    h->cached_ws_bytes = need;
  }
  return {h->cached_ws, h->cached_ws_bytes};
}

}  // namespace fce

extern "C" {

FCE_API fce_status_t fce_handle_create(int32_t device_type, int32_t device_id, fce_handle_t* out) {
  return fce::guard(__func__, [&] {
    FCE_CHECK(out != nullptr, FCE_STATUS_INVALID_ARGUMENT, "out is NULL");
    FCE_CHECK(device_type == kDLCPU || device_type == kDLCUDA, FCE_STATUS_INVALID_ARGUMENT,
              "device_type %d is neither kDLCPU (1) nor kDLCUDA (2)", device_type);
    if (device_type == kDLCUDA)
      FCE_CHECK(device_id >= 0, FCE_STATUS_INVALID_ARGUMENT, "negative CUDA ordinal %d", device_id);
    auto* h = new fce_handle();
    if (device_type == kDLCUDA) {
      h->backend = fce::Backend::CUDA;
      h->device_id = device_id;
      try {
        fce::cuda::create_device(h, device_id);
      } catch (...) {
        delete h;
        throw;
      }
    }
    *out = h;
  });
}

FCE_API fce_status_t fce_handle_destroy(fce_handle_t h) {
  return fce::guard(__func__, [&] {
    if (!h) return;
    if (h->backend == fce::Backend::CPU) {
      std::free(h->cached_ws);
    } else {
      fce::cuda::destroy_device(h);  // synchronizes the device, frees the cached workspace
    }
    delete h;
  });
}

FCE_API fce_status_t fce_handle_get_device(fce_handle_t h, int32_t* device_type, int32_t* device_id) {
  return fce::guard(__func__, [&] {
    fce_handle* hh = fce::check_handle(h);
    if (device_type) *device_type = static_cast<int32_t>(hh->backend);
    if (device_id) *device_id = hh->backend == fce::Backend::CPU ? 0 : hh->device_id;
  });
}

}  // extern "C"
