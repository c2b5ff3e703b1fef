#include "common/handle.hpp"

#include <cstdlib>

#include "common/error.hpp"

namespace fce {

namespace {
thread_local HandleScope* t_scope = nullptr;  // the innermost entry point the calling thread is inside
}

HandleScope::HandleScope() noexcept : outer(t_scope) { t_scope = this; }

HandleScope::~HandleScope() {
  if (held) held->busy.store(false, std::memory_order_release);
  t_scope = outer;
}

fce_handle* check_handle(fce_handle_t h) {
  FCE_CHECK(h != nullptr, FCE_STATUS_INVALID_ARGUMENT, "handle is NULL");
  HandleScope* s = t_scope;
  FCE_CHECK(s != nullptr && s->held == nullptr, FCE_STATUS_INTERNAL_ERROR,
            "a handle checked outside an entry point, or twice in one");
  for (const HandleScope* o = s->outer; o; o = o->outer)
    if (o->held == h) return h;  // an entry point this thread is inside holds it already
  // One atomic exchange per call; acquire/release order a call's use of the handle after the previous one's.
  FCE_CHECK(!h->busy.exchange(true, std::memory_order_acquire), FCE_STATUS_HANDLE_BUSY,
            "handle %p is in use by another thread's call (a handle takes one thread at a time: give each thread "
            "its own handle, or serialize the calls)", static_cast<void*>(h));
  s->held = h;
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
    fce::check_handle(h);  // HANDLE_BUSY, the handle left alive, while another thread's call is inside
    if (h->backend == fce::Backend::CPU) {
      std::free(h->cached_ws);
    } else {
      fce::cuda::destroy_device(h);  // synchronizes the device, frees the cached workspace
    }
    fce::t_scope->held = nullptr;  // freed: nothing to give back
    delete h;
  });
}

FCE_API fce_status_t fce_handle_get_device(fce_handle_t h, int32_t* device_type, int32_t* device_id) {
  return fce::guard(__func__, [&] {
    // Reads only what fce_handle_create set: any thread, any time, the handle not taken.
    FCE_CHECK(h != nullptr, FCE_STATUS_INVALID_ARGUMENT, "handle is NULL");
    const fce_handle* hh = h;
    if (device_type) *device_type = static_cast<int32_t>(hh->backend);
    if (device_id) *device_id = hh->backend == fce::Backend::CPU ? 0 : hh->device_id;
  });
}

}  // extern "C"
