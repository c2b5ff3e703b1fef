// A borrowed NCCL communicator (fce_comm_t) and the CUDA backend's calls on it (src/cuda/nccl.cpp).
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/error.hpp"
#include "common/handle.hpp"
#include "common/ops.hpp"
#include "common/tensor.hpp"
#include "fusedce/fusedce.h"

struct fce_comm {
  struct ncclComm* nccl = nullptr;  // the caller's, not owned
  int rank = 0, size = 1, device = -1;
};

namespace fce {
// An NCCL-mode call's communicator, checked against its handle (a CUDA handle on the communicator's device).
inline fce_comm* checked_comm(const fce_handle* h, fce_comm_t comm) {
  FCE_CHECK(comm != nullptr, FCE_STATUS_INVALID_ARGUMENT, "comm is NULL");
  FCE_CHECK(h->backend == Backend::CUDA, FCE_STATUS_INVALID_ARGUMENT,
            "NCCL mode needs a CUDA handle (this handle is on the CPU)");
  FCE_CHECK(comm->device == h->device_id, FCE_STATUS_DEVICE_MISMATCH,
            "the communicator is on device %d, the handle on device %d", comm->device, h->device_id);
  return comm;
}

// Workspace offsets of the NCCL-mode calls: 256-byte aligned.
inline size_t vp_align(size_t x) { return (x + 255) / 256 * 256; }

// The exchange of [N, K] fp32 records over W ranks: the aligned bytes of this rank's records (returned) and
// of every rank's (*all); OVERFLOW when they do not fit.
inline size_t vp_records_bytes(int64_t N, int64_t K, int64_t W, size_t* all) {
  const size_t rec = size_t(N) * size_t(K) * 4;
  FCE_CHECK(rec / 4 / size_t(K) == size_t(N) && size_t(W) <= SIZE_MAX / 2 / rec, FCE_STATUS_OVERFLOW,
            "the records of %lld rows from %lld ranks overflow", (long long)N, (long long)W);
  *all = vp_align(rec * size_t(W));
  return vp_align(rec);
}

// NCCL mode's logsumexp exchange of N rows (fce_logsumexp_vp, fce_temp_softmax_vp): the combine, into the
// caller's `lse` ([N] or [N, 2] fp32, validated as an output) when given, and the records' workspace: this
// rank's at 0, every rank's at *gathered, *bytes in all.
inline LseCombineProblem lse_vp_combine(Validator& val, const fce_comm* c, const DLTensor* lse, int64_t N,
                                        size_t* gathered, size_t* bytes) {
  LseCombineProblem comb;
  if (lse) {
    comb.lse = val.lse(lse, "lse", N);
    val.output("lse", comb.lse.data, Validator::span(comb.lse));
  }
  comb.W = c->size;
  comb.N = N;
  size_t all = 0;
  *gathered = vp_records_bytes(N, kLseRecordFields, c->size, &all);
  *bytes = *gathered + all;
  return comb;
}

namespace cuda {
void lse_partial(fce_handle*, fce_stream_t, const LsePartialProblem&);
void lse_combine(fce_handle*, fce_stream_t, const LseCombineProblem&);
void comm_all_gather(const fce_comm* c, fce_stream_t stream, const void* send, void* recv, size_t count);
}  // namespace cuda

// NCCL mode's logsumexp (fce_logsumexp_vp, fce_temp_softmax_vp): this rank's records at `base`, the
// all-gather of every rank's to base + gathered, their combine into comb.lse.
inline void lse_vp_run(fce_handle* h, const fce_comm* c, fce_stream_t s, LsePartialProblem part,
                       LseCombineProblem comb, char* base, size_t gathered) {
  const int64_t N = part.x.rows;
  part.records = Mat{base, DType::F32, N, kLseRecordFields, kLseRecordFields};
  comb.records = Mat{base + gathered, DType::F32, int64_t(c->size) * N, kLseRecordFields, kLseRecordFields};
  cuda::lse_partial(h, s, part);
  cuda::comm_all_gather(c, s, base, base + gathered, size_t(N) * size_t(kLseRecordFields));
  cuda::lse_combine(h, s, comb);
}
}  // namespace fce

namespace fce::cuda {

// Loads NCCL and reads the communicator's rank, size and device (COMMUNICATOR_ERROR on failure).
void comm_init(fce_comm* c, struct ncclComm* nccl);
// All-gather of `count` fp32 values per rank on the stream: recv holds rank r's at r * count.
void comm_all_gather(const fce_comm* c, fce_stream_t stream, const void* send, void* recv, size_t count);
// In-place fp32 sum over the ranks in NCCL's order (the same bits on every rank; with 2 ranks a + b, the
// rank-order sum).
void comm_all_reduce_sum(const fce_comm* c, fce_stream_t stream, void* data, size_t count);

// The sum over the ranks of each rank's fp32 `part` [count], added in rank order (((p0 + p1) + p2) + ...)
// whatever NCCL's algorithm or protocol: the same bits on every rank (src/cuda/rank_sum.cu). With `out`
// (contiguous, a float dtype) the sum is rounded once to it and `part` is left as scratch; without, `part`
// receives the sum. Beyond two ranks every rank's part is all-gathered `piece` elements at a time (the
// same piece on every rank) into `scratch`, device memory free for the call of at least 4 * size * piece
// bytes.
void rank_order_sum(const fce_comm* c, fce_stream_t stream, float* part, size_t count, void* out, DType out_dtype,
                    void* scratch, size_t scratch_bytes, size_t piece);

}  // namespace fce::cuda
