// Cross-entropy over a block of rows, as a host-side building block shared by the cross-entropy op and
// linear cross-entropy (which feeds it chunks of logits in the GEMM dtype and takes dlogits in place).
#pragma once
#include <cuda_runtime.h>

#include "common/handle.hpp"
#include "common/ops.hpp"

namespace fce::cuda {

struct CeRows {
  const void* x;  // logits [N, V] with row stride ld, of dtype xt
  DType xt;
  int64_t ld, N, V;
  const void* targets;  // [N]
  bool t64;
  const CeOpts* o;
  const double* prep;  // from ce_prep when ce_needs_prep, else null
  float *loss_rows, *zl_rows, *lse, *entropy;  // per-row outputs ([N]); zl_rows, lse, entropy optional
  bool lse_pair;                               // lse is [N, 2] of LsePair
  void* argmax;                                // optional [N]
  bool a64;
  void* dx;  // optional dlogits [N, V] with row stride ldd, of dtype dxt
  DType dxt;
  int64_t ldd;
  const float* grad_loss;  // optional: scalar, or [N] (already offset to this block)
  bool grad_scalar;
  const float* saved_lse;  // backward only: [N], or [N, 2] of LsePair with saved_pair
  bool saved_pair;
  const float* grad_entropy;  // optional: scalar, or [N] (already offset to this block)
  bool ge_scalar;
  const float* saved_entropy;  // backward with grad_entropy: [N]
};

// Mean denominator and class-weight sum (written to prep[0], prep[1]) are needed for MEAN, or for label
// smoothing with class weights.
bool ce_needs_prep(const CeOpts& o);
void ce_prep(cudaStream_t s, const CeOpts& o, const void* targets, bool t64, int64_t N, int64_t V, double* prep);
// Scratch bytes ce_rows needs for N rows (split rows only).
size_t ce_rows_workspace(fce_handle* h, int64_t N, int64_t V, bool grad, bool backward);
void ce_rows(fce_handle* h, cudaStream_t s, const CeRows& r, void* ws);
// Where the MEAN's denominator is not in a prep buffer: the call's targets and options to compute it from.
struct CeDenominator {
  const CeOpts* o;
  const void* targets;
  bool t64;
  int64_t V;
};
// SUM or MEAN of row losses into the scalars loss (and zloss when not null), in a fixed order; the MEAN's
// denominator from prep, or (prep null) from `den`. `dependent`: launched as a programmatic dependent of
// the stream's previous kernel (sm_90 and later), so that its launch overlaps that kernel's tail.
void ce_finalize(cudaStream_t s, const float* loss_rows, const float* zl_rows, int64_t N, int reduction,
                 const double* prep, float* loss, float* zloss, const CeDenominator* den = nullptr,
                 bool dependent = false);

// The combine's per-row outputs of p's rows (vocab_parallel.cu's kernel, no reduction): losses into loss_rows
// (and zl_rows), p.lse, p.entropy, p.argmax; prep from ce_prep over the call's targets and vocab_total when
// ce_needs_prep. many_shards (linear CE's fused forward: hundreds of loss records a row) merges each row's
// records with a warp, lane by lane then over the lanes, instead of one thread in shard order: other bits
// than fce_cross_entropy_combine's (and the CPU's), so only for records that never leave the library.
void ce_combine_rows(cudaStream_t s, const CeCombineProblem& p, const double* prep, float* loss_rows,
                     float* zl_rows, bool many_shards = false);

}  // namespace fce::cuda
