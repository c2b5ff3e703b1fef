// A borrowed NCCL communicator (fce_comm_t) and the CUDA backend's calls on it (src/cuda/nccl.cpp).
#pragma once
#include <cstddef>

#include "fusedce/fusedce.h"

struct fce_comm {
  struct ncclComm* nccl = nullptr;  // the caller's, not owned
  int rank = 0, size = 1, device = -1;
};

namespace fce::cuda {

// Loads NCCL and reads the communicator's rank, size and device (COMMUNICATOR_ERROR on failure).
void comm_init(fce_comm* c, struct ncclComm* nccl);
// All-gather of `count` fp32 values per rank on the stream: recv holds rank r's at r * count.
void comm_all_gather(const fce_comm* c, fce_stream_t stream, const void* send, void* recv, size_t count);
// In-place fp32 sum over the ranks (NCCL's order: every rank gets the same bits; with 2 ranks a + b, which is
// the rank-order sum).
void comm_all_reduce_sum(const fce_comm* c, fce_stream_t stream, void* data, size_t count);

}  // namespace fce::cuda
