#include "cuda/nccl.hpp"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "common/comm.hpp"
#include "common/error.hpp"

namespace fce::cuda {

namespace {

template <class F>
void bind(void* lib, F*& fn, const char* name, bool required = true) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
  FCE_CHECK(fn != nullptr || !required, FCE_STATUS_COMMUNICATOR_ERROR, "NCCL has no symbol %s", name);
}

}  // namespace

const NcclApi& nccl() {
  static NcclApi api{};
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      const char* e = dlerror();
      error = e ? e : "dlopen failed";
      return;
    }
    try {
      bind(lib, api.all_gather, "ncclAllGather");
      bind(lib, api.all_reduce, "ncclAllReduce");
      bind(lib, api.comm_count, "ncclCommCount");
      bind(lib, api.comm_user_rank, "ncclCommUserRank");
      bind(lib, api.comm_cu_device, "ncclCommCuDevice");
      bind(lib, api.comm_get_async_error, "ncclCommGetAsyncError");
      bind(lib, api.get_error_string, "ncclGetErrorString");
      bind(lib, api.get_last_error, "ncclGetLastError", false);
      bind(lib, api.get_version, "ncclGetVersion");
    } catch (const Error& e) {
      error = e.message;
      api = NcclApi{};
    }
  });
  FCE_CHECK(api.all_gather != nullptr, FCE_STATUS_COMMUNICATOR_ERROR, "cannot load NCCL (libnccl.so.2): %s",
            error.c_str());
  return api;
}

void check_nccl(int result, ncclComm* comm, const char* what) {
  if (result == 0) return;
  const NcclApi& api = nccl();
  int async = 0;
  if (comm) api.comm_get_async_error(comm, &async);
  const char* last = comm && api.get_last_error ? api.get_last_error(comm) : nullptr;
  raise(FCE_STATUS_COMMUNICATOR_ERROR, "%s failed: %s (NCCL result %d)%s%s; the communicator's asynchronous error: %s",
        what, api.get_error_string(result), result, last && *last ? ": " : "", last ? last : "",
        api.get_error_string(async));
}

}  // namespace fce::cuda

// ---- the communicator object's calls (common/comm.hpp) -------------------------------------------

namespace fce::cuda {

void comm_init(fce_comm* c, ncclComm* comm) {
  const NcclApi& api = nccl();
  c->nccl = comm;
  check_nccl(api.comm_count(comm, &c->size), comm, "ncclCommCount");
  check_nccl(api.comm_user_rank(comm, &c->rank), comm, "ncclCommUserRank");
  check_nccl(api.comm_cu_device(comm, &c->device), comm, "ncclCommCuDevice");
}

void comm_all_gather(const fce_comm* c, fce_stream_t stream, const void* send, void* recv, size_t count) {
  check_nccl(nccl().all_gather(send, recv, count, kNcclFloat32, c->nccl, reinterpret_cast<cudaStream_t>(stream)),
             c->nccl, "ncclAllGather");
}

void comm_all_reduce_sum(const fce_comm* c, fce_stream_t stream, void* data, size_t count) {
  check_nccl(nccl().all_reduce(data, data, count, kNcclFloat32, kNcclSum, c->nccl,
                               reinterpret_cast<cudaStream_t>(stream)),
             c->nccl, "ncclAllReduce");
}

}  // namespace fce::cuda
