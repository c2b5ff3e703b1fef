// Linear cross-entropy's forward with the loss's statistics in the logits GEMM (src/cuda/linear_ce_fused.cu,
// built for sm_90a when CUTLASS's headers are found: FCE_LCE_FUSED). The GEMM never stores the logits: each
// 128 x 256 output tile is rounded to the inputs' dtype into shared memory, and a warp of the kernel's
// producer warp group reduces it while the tensor cores run the next tile, into one cross-entropy record
// (FCE_CE_RECORD_FIELDS_LOSS: max, sum of exp, the target's logit or 0, sum of the logits) per row and
// 256-column tile. The records of a row are the shards of fce_cross_entropy_combine: ce_combine_rows merges
// them in column order.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace fce::cuda {

constexpr int64_t kLceFusedTileN = 256;
constexpr int64_t kLceFusedRecordFields = 4;

struct LceFusedArgs {
  const void* hidden = nullptr;  // [rows, H] bf16, row stride ldh
  int64_t ldh = 0;
  const void* weight = nullptr;  // [V, H] bf16, row stride ldw
  int64_t ldw = 0;
  int64_t rows = 0, H = 0, V = 0;
  const void* targets = nullptr;  // [rows] int32 or int64
  bool t64 = false;
  float* records = nullptr;  // [tiles(V), rows, 4]: tile t's record of row i at (t * rows + i) * 4
  int sm_count = 0, device = 0;
};

inline int64_t lce_fused_tiles(int64_t V) { return (V + kLceFusedTileN - 1) / kLceFusedTileN; }

#if FCE_LCE_FUSED
// Whether the kernel takes these operands (CUTLASS's check: 16-byte aligned rows and bases, extents that fit).
bool lce_fused_can(const LceFusedArgs& a);
// Writes a.records; no host synchronization, no allocation.
void lce_fused_records(cudaStream_t s, const LceFusedArgs& a);
#endif

}  // namespace fce::cuda
