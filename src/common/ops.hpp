// Validated problem descriptions handed from the API layer to a backend (CPU or CUDA).
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/tensor.hpp"
#include "fusedce/fusedce.h"

struct fce_handle;
struct fce_comm;

namespace fce {

struct Workspace {
  void* ptr = nullptr;
  size_t bytes = 0;
};

// Cross-entropy options after validation.
struct CeOpts {
  int reduction = FCE_REDUCTION_MEAN;
  int64_t ignore_index = -100;
  float label_smoothing = 0.f;
  float z_loss_scale = 0.f;
  float softcap = 0.f;
  float logit_scale = 1.f;
  Vec class_weights;  // [V] fp32 or empty ([vocab_total] with a shard)
  int64_t vocab_start = 0, vocab_total = 0;  // a vocabulary shard when vocab_total > 0
  bool sharded() const { return vocab_total > 0; }
};

// Cross-entropy forward (saved_lse empty) or backward (saved_lse set, only dlogits written).
struct CeProblem {
  Mat logits;
  Vec targets;
  CeOpts o;
  Vec loss, lse, z_loss, argmax, entropy;  // outputs (forward); empty when not requested
  Mat dlogits;                             // optional
  Vec grad_loss;                           // optional upstream gradient (scalar or [N])
  Vec grad_entropy;                        // optional upstream gradient of the entropy (scalar or [N])
  Vec saved_lse;                           // backward only
  Vec saved_entropy;                       // backward with grad_entropy only
  bool backward() const { return static_cast<bool>(saved_lse); }
};

// Vocabulary-parallel cross-entropy: the records of a shard, and the forward of whole rows from the records
// of every shard (the header's "Vocabulary-parallel cross-entropy"; the gradient is a CeProblem backward
// with a sharded CeOpts).
// A record is a prefix of the full width: the loss's fields and the column range, then the entropy's, then
// the argmax's (math.hpp: CeRecordLayout).
constexpr int64_t kCeRecordFields = 9;   // ..., and the largest raw logit, its global index
constexpr int64_t kCeRecordLoss = 6;     // m, sum exp(z - m), z_t, sum w z, column range: loss, lse, z-loss
constexpr int64_t kCeRecordEntropy = 7;  // and sum exp(z - m) (z - m): the entropy
constexpr int64_t kCeRecordCore = 4;     // the first four alone: records that never leave the library
inline bool ce_record_width_ok(int64_t K) {
  return K == kCeRecordLoss || K == kCeRecordEntropy || K == kCeRecordFields;
}
struct CePartialProblem {
  Mat logits;
  Vec targets;
  CeOpts o;
  Mat records;  // [N, K] fp32, K one of the widths above
};
struct CeCombineProblem {
  Mat records;  // [W * N, K] fp32: rank r's row i at r * N + i
  int64_t W = 0;
  Vec targets;
  CeOpts o;
  Vec loss, lse, z_loss, argmax, entropy;
  Vec pair;  // optional, within the library: the rows' LsePair [N, 2] besides lse (a shard's backward reads it)
};

struct LseProblem {
  Mat x;
  float scale = 1.f;
  Vec lse;
};

struct SoftmaxProblem {
  Mat logits;
  float temperature = 1.f;
  Vec temperatures;  // optional [N] fp32
  Mat probs, logprobs;
  int64_t vocab_start = 0, vocab_total = 0;  // a vocabulary shard when vocab_total > 0
  Vec lse;                                    // with a shard: the whole rows' lse of logits / T
};

// Vocabulary-parallel logsumexp (the header's fce_logsumexp_partial / _combine).
constexpr int64_t kLseRecordFields = 6;  // m (raw), sum exp((x - m) s), column range, s, vocab_total (math.hpp)
struct LsePartialProblem {
  Mat x;
  float scale = 1.f;
  int64_t vocab_start = 0, vocab_total = 0;
  Mat records;  // [N, kLseRecordFields]
};
struct LseCombineProblem {
  Mat records;  // [W * N, kLseRecordFields]: rank r's row i at r * N + i
  int64_t W = 0, N = 0;
  Vec lse;   // [N], or [N, 2]: (max x, log D), lse = s max + log D
  Vec pair;  // optional, within the library: the pairs besides lse (NCCL mode's softmax reads them)
};

struct KdOpts {
  int divergence = FCE_KD_FORWARD_KL;
  float beta = 0.5f;
  float temperature = 1.f;
  bool scale_by_t2 = false;
  int topk_norm = FCE_KD_TOPK_FULL_VOCAB;
  int reduction = FCE_REDUCTION_MEAN;
  int64_t ignore_index = -100;
  int64_t vocab_start = 0, vocab_total = 0;  // a vocabulary shard when vocab_total > 0
  // JSD strictly between forward and reverse KL (the shard calls map beta 0 and 1 to them): its mixture
  // needs the rows' normalizers first, so over shards it takes a second exchange (the terms' records).
  bool mixture() const { return divergence == FCE_KD_JSD; }
  int64_t real_cols(int64_t V) const {  // the shard's columns inside the vocabulary (the rest is padding)
    return vocab_total - vocab_start < V ? vocab_total - vocab_start : V;
  }
};

// Vocabulary-parallel KD (the header's "Vocabulary-parallel knowledge distillation"): a shard's records, their
// combine into whole rows, and a shard's dstudent from the rows' statistics.
constexpr int64_t kKdRecordFields = 7;    // m_P, sum exp(z_P - m_P), m_Q, sum exp(z_Q - m_Q), cross sum X, range
constexpr int64_t kKdRowStatsFields = 5;  // M_s, log D_s, M_t, log D_t, A
constexpr int64_t kKdTermsRecordFields = 5;  // the shard's sums of the terms and of a_j; its top-K slots (-1: dense); range
// The teacher of a shard call: the shard's columns of full logits, or a top-K teacher's [N, K] ids (global
// vocabulary indices) and log-probabilities, the same on every rank.
// The largest K of a top-K teacher over shards on CUDA (fce_kd_bwd keeps a row's slot values on chip).
constexpr int64_t kKdShardTopkMax = 8192;
struct KdShardTeacher {
  Mat logits;
  Mat topk_ids, topk_lp;
  bool topk() const { return static_cast<bool>(topk_ids); }
};
struct KdPartialProblem {
  Mat student;
  KdShardTeacher teacher;
  KdOpts o;
  Mat records;  // [N, kKdRecordFields]
};
// The second exchange (JSD's mixture): a shard's sums of the element terms from the rows' statistics.
struct KdTermsPartialProblem {
  Mat student;
  KdShardTeacher teacher;
  KdOpts o;
  Mat row_stats;  // [N, kKdRowStatsFields], fields 0-3 read
  Mat records;    // [N, kKdTermsRecordFields]
};
// fce_kd_combine (records of kKdRecordFields; JSD: no loss, row_stats' A NaN) and fce_kd_terms_combine
// (records of kKdTermsRecordFields: the loss, and A into row_stats).
struct KdCombineProblem {
  Mat records;  // [W * N, fields]: rank r's row i at r * N + i
  int64_t W = 0, N = 0;
  Vec targets;  // optional
  KdOpts o;
  Vec loss;       // optional for JSD's first combine (absent there)
  Mat row_stats;  // optional [N, kKdRowStatsFields] (required by the terms' combine: A written)
  bool terms = false;  // the records are the terms' (fce_kd_terms_combine)
};
struct KdBwdProblem {
  Mat student;
  KdShardTeacher teacher;
  Vec targets;  // optional
  KdOpts o;
  Mat row_stats;
  Vec grad_loss;  // optional
  Mat dstudent;
};

struct KdProblem {
  Mat student;
  Mat teacher;                // full teacher logits, or empty
  Mat topk_ids, topk_lp;      // top-K teacher, or empty
  Vec targets;                // optional
  KdOpts o;
  Vec loss;
  Mat dstudent;               // optional
  Vec grad_loss;              // optional
  bool topk() const { return static_cast<bool>(topk_ids); }
};

struct LinearCeProblem {
  Mat hidden, weight;
  Vec bias;  // optional
  Vec targets;
  CeOpts o;
  Vec loss, lse, z_loss, argmax, entropy;
  Mat dhidden, dweight;
  Vec dbias;
  Vec grad_loss;
  Vec grad_entropy;   // optional (scalar or [N])
  Vec saved_lse;      // backward only
  Vec saved_entropy;  // backward with grad_entropy only
  bool accumulate = false;  // FCE_LINEAR_CE_ACCUMULATE: add into dhidden, dweight, dbias
  // A vocabulary shard (o.sharded()): the partial's records [N, K] (the call writes only these), or, in
  // NCCL mode, the width of the records it exchanges.
  Mat records;
  int64_t records_width = 0;
  bool wants_grad() const { return dhidden || dweight || dbias; }
  // The weight's rows inside the vocabulary (a shard's padding rows are never read).
  int64_t real_rows() const {
    const int64_t V = weight.rows, left = o.vocab_total - o.vocab_start;
    return o.sharded() && left < V ? left : V;
  }
};

// x[i, :] *= factor (scalar or [N]), rows with factor 1 untouched (fce_scale_rows).
struct ScaleProblem {
  Mat x;
  Vec factor;
};

// Every backend implements these; `*_workspace` gives the bytes the op needs (for linear CE: the default).
namespace cpu {
size_t ce_workspace(const CeProblem&);
void ce(const CeProblem&, Workspace);
void ce_partial(const CePartialProblem&);
void ce_combine(const CeCombineProblem&);
size_t lse_workspace(const LseProblem&);
void lse(const LseProblem&, Workspace);
size_t softmax_workspace(const SoftmaxProblem&);
void softmax(const SoftmaxProblem&, Workspace);
size_t kd_workspace(const KdProblem&);
void kd(const KdProblem&, Workspace);
void kd_partial(const KdPartialProblem&);
void kd_combine(const KdCombineProblem&);
void kd_terms_partial(const KdTermsPartialProblem&);
void kd_bwd(const KdBwdProblem&);
void lse_partial(const LsePartialProblem&);
void lse_combine(const LseCombineProblem&);
void softmax_shard(const SoftmaxProblem&);
size_t linear_ce_workspace(const LinearCeProblem&, bool minimum);
void linear_ce(const LinearCeProblem&, Workspace);
void scale_rows(const ScaleProblem&);
}  // namespace cpu

namespace cuda {
size_t ce_workspace(fce_handle*, const CeProblem&);
void ce(fce_handle*, fce_stream_t, const CeProblem&, Workspace);
void ce_partial(fce_handle*, fce_stream_t, const CePartialProblem&);
size_t ce_combine_workspace(fce_handle*, const CeCombineProblem&);
void ce_combine(fce_handle*, fce_stream_t, const CeCombineProblem&, Workspace);
size_t lse_workspace(fce_handle*, const LseProblem&);
void lse(fce_handle*, fce_stream_t, const LseProblem&, Workspace);
size_t softmax_workspace(fce_handle*, const SoftmaxProblem&);
void softmax(fce_handle*, fce_stream_t, const SoftmaxProblem&, Workspace);
size_t kd_workspace(fce_handle*, const KdProblem&);
void kd(fce_handle*, fce_stream_t, const KdProblem&, Workspace);
void kd_partial(fce_handle*, fce_stream_t, const KdPartialProblem&);
size_t kd_combine_workspace(fce_handle*, const KdCombineProblem&);
void kd_combine(fce_handle*, fce_stream_t, const KdCombineProblem&, Workspace);
void kd_terms_partial(fce_handle*, fce_stream_t, const KdTermsPartialProblem&);
size_t kd_bwd_workspace(fce_handle*, const KdBwdProblem&);
void kd_bwd(fce_handle*, fce_stream_t, const KdBwdProblem&, Workspace);
void lse_partial(fce_handle*, fce_stream_t, const LsePartialProblem&);
void lse_combine(fce_handle*, fce_stream_t, const LseCombineProblem&);
void softmax_shard(fce_handle*, fce_stream_t, const SoftmaxProblem&);
size_t linear_ce_workspace(fce_handle*, const LinearCeProblem&, bool minimum);
void linear_ce(fce_handle*, fce_stream_t, const LinearCeProblem&, Workspace);
// NCCL mode over `ranks` ranks (fce_linear_cross_entropy_fwd_vp).
size_t linear_ce_vp_workspace(fce_handle*, const LinearCeProblem&, int64_t ranks, bool minimum);
void linear_ce_vp(fce_handle*, const fce_comm*, fce_stream_t, const LinearCeProblem&, Workspace);
void scale_rows(fce_handle*, fce_stream_t, const ScaleProblem&);

// Device management (src/cuda/device.cpp, or stubs without CUDA).
void create_device(fce_handle*, int device_id);  // fills the handle's CUDA fields; throws NO_DEVICE
void destroy_device(fce_handle*);                // synchronizes the device; frees the cached workspace
// The handle's cached workspace, allocated and released in the order of `stream` (no host sync where the
// device has memory pools); allocating throws INVALID_ARGUMENT while `stream` is being captured.
void* workspace_alloc(fce_handle*, size_t bytes, fce_stream_t stream);
void workspace_free(fce_handle*, void*, fce_stream_t stream);
// CUDART_VERSION and CUBLAS_VERSION the backend was compiled against (0 without CUDA).
void build_versions(int* cudart, int* cublas);
}  // namespace cuda

}  // namespace fce
