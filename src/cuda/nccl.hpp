// NCCL, loaded at run time (dlopen("libnccl.so.2")) on the first fce_comm_create: the library never links
// NCCL, so a process that already has it (PyTorch) shares its copy, and processes that never ask for NCCL
// mode pay nothing. The few declarations below are NCCL's stable C ABI (nccl.h: ncclComm_t is
// `struct ncclComm*`, ncclResult_t, ncclDataType_t and ncclRedOp_t are int enums, ncclFloat32 = 7, ncclSum = 0).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>

struct ncclComm;

namespace fce::cuda {

struct NcclApi {
  int (*all_gather)(const void*, void*, size_t, int, ncclComm*, cudaStream_t);
  int (*all_reduce)(const void*, void*, size_t, int, int, ncclComm*, cudaStream_t);
  int (*comm_count)(const ncclComm*, int*);
  int (*comm_user_rank)(const ncclComm*, int*);
  int (*comm_cu_device)(const ncclComm*, int*);
  int (*comm_get_async_error)(ncclComm*, int*);
  const char* (*get_error_string)(int);
  const char* (*get_last_error)(ncclComm*);  // may be null (older NCCL)
  int (*get_version)(int*);
};
constexpr int kNcclFloat32 = 7;
constexpr int kNcclSum = 0;  // ncclRedOp_t

// The loaded API (throws COMMUNICATOR_ERROR with the loader's message when NCCL cannot be loaded).
const NcclApi& nccl();
// Throws COMMUNICATOR_ERROR for a failed NCCL call: the result's text, the communicator's last error and
// its asynchronous error.
void check_nccl(int result, ncclComm* comm, const char* what);

}  // namespace fce::cuda
