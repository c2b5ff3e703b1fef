// CUDA linear cross-entropy: token chunks. For each chunk a cuBLASLt GEMM (fp32 accumulation) writes the
// chunk's logits in the inputs' dtype into the workspace, the cross-entropy rows kernel turns them into
// losses and, in place, dlogits (formed in fp32, rounded once), then GEMMs write the chunk's dhidden and add
// its dweight into the dweight output (the GEMM's fp32 compute, beta = 1: rounded once per chunk, no
// accumulator). 6*N*H*V flops with gradients, 2*N*H*V without; no [N,V] tensor ever exists. Logits in
// the inputs' dtype (as torch.nn.functional.linear) halve the chunk's bytes, so chunks are twice as long.
// A vocabulary shard runs the same loop over its real weight rows: the partial writes each chunk's records;
// the backward forms dlogits from the whole rows' lse (CeParams col0, vt); NCCL mode gathers and combines
// each chunk's records before its gradient, and sums the ranks' fp32 dhidden once at the end, in rank order.
// The forward alone on an sm_90 device (bf16, no bias): the fused GEMM of lce_fused.hpp writes records, never
// logits, and the vocabulary-parallel combine merges them (run_fused).
#include <algorithm>

#include "common/comm.hpp"
#include "common/force_path.hpp"
#include "cuda/blas.hpp"
#include "cuda/ce_internal.hpp"
#include "cuda/common.cuh"
#include "cuda/lce_fused.hpp"

namespace fce::cuda {
namespace {

// The default workspace (a caller's may be larger or smaller): with the cuBLAS handle's own memory, a call
// holds at most 512 MiB beyond its inputs and outputs.
constexpr size_t kDefaultWorkspaceBytes = size_t(448) << 20;

cudaDataType cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    case DType::F16: return CUDA_R_16F;
    default: raise(FCE_STATUS_INTERNAL_ERROR, "not a float dtype");
  }
}

int64_t padded(int64_t V) { return (V + 127) / 128 * 128; }  // 256-byte aligned rows

// Rows per chunk for at most `max_rows` (>= 1): all N in one chunk where they fit, else about equal chunks,
// a multiple of 128 rows where chunks are long (GEMM tiles), of 512 from 1024 rows (the gradient GEMMs,
// whose inner dimension is the chunk, ran faster at 1536 rows than at 1664: docs/lab-notes.md; 1792 and 912
// rows, one chunk fewer, were no faster with cuBLASLt's tiles either).
int64_t chunk_rows(int64_t N, int64_t max_rows) {
  const int64_t chunks = (N + max_rows - 1) / max_rows;
  if (chunks == 1) return N;
  int64_t C = (N + chunks - 1) / chunks;
  if (C >= 256) {
    const int64_t g = C >= 1024 ? 512 : 128;
    const int64_t up = (C + g - 1) / g * g;
    C = up <= max_rows ? up : C / g * g;
  }
  return C;
}

// Workspace: fixed part (prep, row losses, the fp32 dbias accumulator, split-row scratch; in NCCL mode the
// whole rows' lse and entropy when the caller keeps neither, and an fp32 dhidden for the ranks' sum) then
// the per-chunk part (the chunk's logits; in NCCL mode its records and every rank's). NCCL mode exchanges
// each chunk's records and sums dhidden in pieces, so every rank must cut the same chunks and pieces
// whatever its shard's width and its workspace's size: both are planned from the even split
// ceil(vocab_total / ranks) and the default budget, and this rank's workspace then holds its own shard
// (the chunk's logits region doubles as the sum's scratch once the chunks are done).
struct LceLayout {
  double* prep = nullptr;
  float *row_loss = nullptr, *row_zl = nullptr, *db_acc = nullptr;
  LsePair* lse = nullptr;                        // NCCL mode: the rows' pairs, for the gradient
  float *entropy = nullptr, *dh32 = nullptr;     // NCCL mode
  float *rec = nullptr, *gathered = nullptr;                  // NCCL mode: [C, K] and [W, C, K]
  char* logits = nullptr;  // [C, ldl] in the inputs' dtype; dlogits overwrite it in place
  void* rows = nullptr;
  size_t total = 0, logits_bytes = 0;
  int64_t C = 0;         // rows per chunk
  size_t sum_piece = 0;  // NCCL mode: elements of dhidden per all-gather of the ranks' sum

  // ranks > 0: NCCL mode over that many ranks.
  LceLayout(fce_handle* h, const LinearCeProblem& p, void* base, size_t bytes_or_zero, bool minimum,
            int64_t ranks = 0) {
    const int64_t N = p.hidden.rows, H = p.hidden.cols, V = p.real_rows(), K = p.records_width;
    const bool grad = p.wants_grad(), vp = ranks > 0;
    const bool reduced = !p.saved_lse && !p.records && p.o.reduction != FCE_REDUCTION_NONE;
    const size_t es = dtype_size(p.hidden.dtype);
    // The width the chunks are planned for: this shard's, or in NCCL mode the even split (every rank's).
    const int64_t Vp = vp ? (p.o.vocab_total + ranks - 1) / ranks : V;
    // At least 1: a shard of padding alone (V = 0) has no logits per row (one chunk of every row).
    const size_t per_row =
        std::max<size_t>(1, size_t(padded(Vp)) * es + (vp ? size_t(K) * 4 * size_t(ranks + 1) : 0));
    const bool sum = vp && p.dhidden;
    auto carve = [&](void* at, int64_t C_, int64_t Vc) {
      Carver c(at);
      prep = ce_needs_prep(p.o) ? c.take<double>(2) : nullptr;
      row_loss = reduced ? c.take<float>(size_t(N)) : nullptr;
      row_zl = reduced ? c.take<float>(size_t(N)) : nullptr;
      db_acc = p.dbias ? c.take<float>(size_t(Vc)) : nullptr;
      lse = vp ? c.take<LsePair>(size_t(N)) : nullptr;
      entropy = vp && p.grad_entropy && !p.entropy ? c.take<float>(size_t(N)) : nullptr;
      dh32 = sum && (p.dhidden.dtype != DType::F32 || p.accumulate || p.dhidden.ld != H)
                 ? c.take<float>(size_t(N) * size_t(H))
                 : nullptr;
      // The rows' scratch (split rows) for a full chunk and for the shorter last one, which may split
      // where a full chunk does not.
      const int64_t full = std::max<int64_t>(C_, 1), last = N % full;
      const bool b = static_cast<bool>(p.saved_lse) || vp;
      rows = c.take<char>(std::max(ce_rows_workspace(h, full, Vc, grad, b),
                                   last ? ce_rows_workspace(h, last, Vc, grad, b) : size_t(0)));
      rec = vp ? c.take<float>(size_t(C_) * size_t(K)) : nullptr;
      gathered = vp ? c.take<float>(size_t(C_) * size_t(K) * size_t(ranks)) : nullptr;
      // The sum's pieces fill the planned chunk's logits: the same on every rank.
      sum_piece = sum ? std::min(size_t(N) * size_t(H),
                                 std::max<size_t>(1, size_t(C_) * size_t(padded(Vp)) * es / (4 * size_t(ranks))))
                      : 0;
      logits_bytes = std::max(size_t(C_) * size_t(padded(Vc)) * es, sum_piece * 4 * size_t(ranks));
      logits = c.take<char>(logits_bytes);
      return c.used;
    };
    const size_t fixed = carve(nullptr, 1, Vp) - per_row;
    auto rows_in = [&](size_t budget) {
      return budget > fixed ? std::min<int64_t>(N, int64_t((budget - fixed) / per_row)) : int64_t(0);
    };
    // The default plan, whatever the workspace given: a call's chunks (so its bits) must not depend on the
    // size of the handle's cached workspace. Only a caller's workspace too small for it cuts shorter chunks.
    C = minimum && !vp ? 1 : chunk_rows(N, std::max<int64_t>(rows_in(kDefaultWorkspaceBytes), 1));
    if (!vp && bytes_or_zero && carve(nullptr, C, V) > bytes_or_zero) {
      const int64_t max_rows = rows_in(bytes_or_zero);
      FCE_CHECK(max_rows >= 1, FCE_STATUS_WORKSPACE_TOO_SMALL, "workspace of %zu bytes holds no token chunk (%zu needed)",
                bytes_or_zero, fixed + per_row);
      C = chunk_rows(N, max_rows);
      // The split-row scratch depends on C: shrink C until the final carve fits.
      while (C > 1 && carve(nullptr, C, V) > bytes_or_zero) --C;
    }
    total = carve(base, C, V);
    if (vp)
      FCE_CHECK(!bytes_or_zero || total <= bytes_or_zero, FCE_STATUS_WORKSPACE_TOO_SMALL,
                "workspace of %zu bytes is below the %zu this rank needs (NCCL mode cuts the same token chunks on "
                "every rank, whatever the workspace)", bytes_or_zero, total);
    else
      FCE_CHECK(!bytes_or_zero || total <= bytes_or_zero, FCE_STATUS_WORKSPACE_TOO_SMALL,
                "workspace of %zu bytes is below the %zu needed", bytes_or_zero, total);
  }
};

// ---- the fused forward (lce_fused.hpp) ----------------------------------------------------------------------

// The records' budget of the default plan: [tiles, C, 4] fp32 (C up to 21120 tokens at V = 151936).
constexpr size_t kFusedRecordsBytes = size_t(192) << 20;

LceFusedArgs fused_args(fce_handle* h, const LinearCeProblem& p, int64_t r0, int64_t rows, float* records) {
  LceFusedArgs a;
  a.hidden = p.hidden.data + size_t(r0) * size_t(p.hidden.ld) * 2;
  a.ldh = p.hidden.ld;
  a.weight = p.weight.data;
  a.ldw = p.weight.ld;
  a.rows = rows;
  a.H = p.hidden.cols;
  a.V = p.weight.rows;
  a.t64 = p.targets.dtype == DType::I64;
  a.targets = p.targets.data + size_t(r0) * (a.t64 ? 8 : 4);
  a.records = records;
  a.sm_count = h->caps.sm_count;
  a.device = h->device_id;
  return a;
}

// The forward alone, unsharded, bf16 without a bias, on a device that runs sm_90a code, with the options the
// records of width 4 carry (no softcap, logit scale 1, no argmax or entropy; label smoothing without class
// weights). FCE_FORCE_PATH=linear_ce:chunked turns it off, linear_ce:fused asks for it where it applies.
bool use_fused(fce_handle* h, const LinearCeProblem& p) {
  static const char* const kPaths[] = {"chunked", "fused"};
  if (forced_path("linear_ce", kPaths) == 0) return false;
#if FCE_LCE_FUSED
  const CeOpts& o = p.o;
  if (h->caps.arch != 90 || p.wants_grad() || p.saved_lse || p.records || p.records_width || o.sharded() ||
      p.bias || p.argmax || p.entropy || p.hidden.dtype != DType::BF16)
    return false;
  if (o.softcap != 0.f || o.logit_scale != 1.f || (o.label_smoothing != 0.f && o.class_weights)) return false;
  return lce_fused_can(fused_args(h, p, 0, p.hidden.rows, nullptr));
#else
  (void)h;
  (void)p;
  return false;
#endif
}

// Its workspace: prep and a reduction's row losses (as the chunked plan's), then the records of C tokens. C is
// the default plan's (all N where the records fit kFusedRecordsBytes, else equal parts in multiples of the
// GEMM's 128-row tile), shorter only for a caller's smaller workspace; each row's records, so the results, do
// not depend on C.
struct FusedLayout {
  double* prep = nullptr;
  float *row_loss = nullptr, *row_zl = nullptr, *records = nullptr;
  int64_t C = 0;
  size_t total = 0;
  FusedLayout(const LinearCeProblem& p, void* base, size_t bytes_or_zero, bool minimum) {
    const int64_t N = p.hidden.rows;
    const bool reduced = p.o.reduction != FCE_REDUCTION_NONE;
    const size_t per_row = size_t(lce_fused_tiles(p.weight.rows)) * kLceFusedRecordFields * 4;
    auto carve = [&](void* at, int64_t C_) {
      Carver c(at);
      prep = ce_needs_prep(p.o) ? c.take<double>(2) : nullptr;
      row_loss = reduced ? c.take<float>(size_t(N)) : nullptr;
      row_zl = reduced ? c.take<float>(size_t(N)) : nullptr;
      records = c.take<float>(size_t(C_) * per_row / 4);
      return c.used;
    };
    // Records within the budget, and hidden's rows within 64 MiB: at 16384 x 4096 one launch ran 10 % slower
    // than two (each wave of CTAs, going down the tokens, reads all of its rows; L2 holds 50 MB).
    const int64_t by_records = int64_t(kFusedRecordsBytes / per_row);
    const int64_t by_hidden = int64_t((size_t(64) << 20) / (size_t(p.hidden.cols) * 2));
    const int64_t fit = std::max<int64_t>(std::min(by_records, by_hidden) / 128 * 128, 128);
    const int64_t parts = (N + fit - 1) / fit;
    C = minimum ? 1 : parts <= 1 ? N : ((N + parts - 1) / parts + 127) / 128 * 128;
    if (bytes_or_zero && carve(nullptr, C) > bytes_or_zero) {
      const size_t fixed = carve(nullptr, 0);
      FCE_CHECK(bytes_or_zero >= fixed + per_row, FCE_STATUS_WORKSPACE_TOO_SMALL,
                "workspace of %zu bytes holds no token's records (%zu needed)", bytes_or_zero, fixed + per_row);
      C = std::min<int64_t>(C, int64_t((bytes_or_zero - fixed) / per_row));
    }
    total = carve(base, C);
  }
};

void run_fused(fce_handle* h, cudaStream_t s, const LinearCeProblem& p, Workspace w) {
#if FCE_LCE_FUSED
  static_assert(kLceFusedRecordFields == kCeRecordCore, "the fused forward's records are the core fields alone");
  const int64_t N = p.hidden.rows, V = p.weight.rows, T = lce_fused_tiles(V);
  const FusedLayout lay(p, w.ptr, w.bytes, false);
  const bool t64 = p.targets.dtype == DType::I64, none = p.o.reduction == FCE_REDUCTION_NONE;
  if (lay.prep) ce_prep(s, p.o, p.targets.data, t64, N, V, lay.prep);
  CeCombineProblem comb;
  comb.W = T;
  comb.o = p.o;
  comb.o.vocab_total = V;  // the combine's range of the targets; the tiles are the shards
  for (int64_t r0 = 0; r0 < N; r0 += lay.C) {
    const int64_t rows = std::min(lay.C, N - r0);
    lce_fused_records(s, fused_args(h, p, r0, rows, lay.records));
    comb.records = Mat{reinterpret_cast<char*>(lay.records), DType::F32, T * rows, kLceFusedRecordFields,
                       kLceFusedRecordFields};
    comb.targets = Vec{p.targets.data + size_t(r0) * (t64 ? 8 : 4), p.targets.dtype, rows, false};
    comb.lse = p.lse ? Vec{p.lse.data + size_t(r0) * (p.lse.pair ? 8 : 4), DType::F32, rows, false, p.lse.pair} : Vec{};
    float* lr = (none ? reinterpret_cast<float*>(p.loss.data) : lay.row_loss) + r0;
    float* zr = none ? (p.z_loss ? reinterpret_cast<float*>(p.z_loss.data) + r0 : nullptr) : lay.row_zl + r0;
    ce_combine_rows(s, comb, lay.prep, lr, zr, true);
  }
  if (!none)
    ce_finalize(s, lay.row_loss, lay.row_zl, N, p.o.reduction, lay.prep, reinterpret_cast<float*>(p.loss.data),
                p.z_loss ? reinterpret_cast<float*>(p.z_loss.data) : nullptr);
#else
  (void)h, (void)s, (void)p, (void)w;
  raise(FCE_STATUS_INTERNAL_ERROR, "the fused linear cross-entropy path is not built");
#endif
}

// Grid rows stride by gridDim.y: grid.y is capped at 65535.
template <class T>
__global__ void bias_rows_kernel(T* logits, int64_t rows, int64_t ldl, int64_t V, const T* bias) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < V; j += int64_t(gridDim.x) * blockDim.x)
      logits[r * ldl + j] = bias[j];
}

// dbias_acc[v] += sum over the chunk's rows of dl[r, v], in row order (deterministic).
template <class T>
__global__ void column_sum_kernel(const T* dl, int64_t ldd, int64_t rows, int64_t V, float* acc) {
  const int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (j >= V) return;
  float s = acc[j];
  for (int64_t r = 0; r < rows; ++r) s += to_float(dl[r * ldd + j]);
  acc[j] = s;
}

// out = in (or out + in, the sum in fp32), rounded once to O.
template <class O>
__global__ void convert_kernel(const float* in, int64_t rows, int64_t cols, int64_t ldi, O* out, int64_t ldo,
                               bool add) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
  for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < cols; j += int64_t(gridDim.x) * blockDim.x)
    out[r * ldo + j] = from_float<O>(add ? to_float(out[r * ldo + j]) + in[r * ldi + j] : in[r * ldi + j]);
}

void convert(cudaStream_t s, const float* in, int64_t rows, int64_t cols, int64_t ldi, void* out, DType ot, int64_t ldo,
             bool add) {
  const dim3 grid(unsigned(std::min<int64_t>((cols + 255) / 256, 64)), unsigned(std::min<int64_t>(rows, 65535)));
  dispatch_float(ot, [&](auto tag) {
    using O = decltype(tag);
    convert_kernel<O><<<grid, 256, 0, s>>>(in, rows, cols, ldi, static_cast<O*>(out), ldo, add);
  });
  check_launch("convert kernel");
}

// The chunk's statistics step between its logits GEMM and its gradient GEMMs. NCCL mode: the records, their
// all-gather, the combine of the chunk's rows.
struct VpStep {
  const fce_comm* comm;
  int64_t K;
};

void run(fce_handle* h, fce_stream_t stream, const LinearCeProblem& p, Workspace w, const VpStep* vp) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  if (!vp && use_fused(h, p)) return run_fused(h, s, p, w);
  // A vocabulary shard's padding rows of the weight are never read: V is the real rows from here on.
  const int64_t N = p.hidden.rows, H = p.hidden.cols, V = p.real_rows(), ldl = padded(V);
  const DType dt = p.hidden.dtype;
  FCE_CHECK(!p.dhidden || p.dhidden.dtype == dt || p.dhidden.dtype == DType::F32, FCE_STATUS_NOT_IMPLEMENTED,
            "on CUDA, dhidden must be float32 or hidden's dtype (%s)", dtype_name(dt));
  for (int64_t d : {N, H, V, p.hidden.ld, p.weight.ld, p.dhidden ? p.dhidden.ld : 0, p.dweight ? p.dweight.ld : 0})
    FCE_CHECK(d <= INT32_MAX, FCE_STATUS_UNSUPPORTED_LAYOUT,
              "extents and row strides beyond 2^31 - 1 elements are not supported by the cuBLAS path");
  const int64_t W = vp ? vp->comm->size : 0;
  const LceLayout lay(h, p, w.ptr, w.bytes, false, W);
  const CublasApi& api = cublas();
  cublasHandle_t blas = cublas_handle(h, s);
  const cudaDataType ct = cuda_type(dt);
  const float one = 1.f, zero = 0.f;
  const bool grad = p.wants_grad(), bwd = static_cast<bool>(p.saved_lse), partial = static_cast<bool>(p.records);
  const bool none = p.o.reduction == FCE_REDUCTION_NONE;
  const size_t es = dtype_size(dt);
  const bool t64 = p.targets.dtype == DType::I64;
  const size_t ts = t64 ? 8 : 4;

  if (lay.prep) ce_prep(s, p.o, p.targets.data, t64, N, p.o.sharded() ? p.o.vocab_total : V, lay.prep);
  // The chunk buffer's row padding is never written by the GEMMs but may be read by their vector loads.
  if (ldl > V)
    check(cudaMemset2DAsync(lay.logits + size_t(V) * es, size_t(ldl) * es, 0, size_t(ldl - V) * es,
                            size_t(lay.C), s),
          "cudaMemset2DAsync");
  if (lay.db_acc) check(cudaMemsetAsync(lay.db_acc, 0, size_t(V) * 4, s), "cudaMemsetAsync");
  void* dw = p.dweight ? static_cast<void*>(p.dweight.data) : nullptr;
  const int64_t lddw = p.dweight ? p.dweight.ld : 0;
  const cudaDataType dwt = p.dweight ? cuda_type(p.dweight.dtype) : CUDA_R_32F;
  // dhidden's GEMM target: the output, or in NCCL mode the fp32 sum of the ranks' parts.
  char* dh_base = lay.dh32 ? reinterpret_cast<char*>(lay.dh32) : p.dhidden ? p.dhidden.data : nullptr;
  const int64_t lddh = lay.dh32 ? H : p.dhidden ? p.dhidden.ld : 0;
  const DType dht = lay.dh32 ? DType::F32 : p.dhidden ? p.dhidden.dtype : dt;
  const bool dh_add = p.accumulate && !lay.dh32;
  // NCCL mode's whole-row statistics, per row of the call: the pairs for the gradient (LsePair), besides the
  // caller's lse.
  float* ent_rows = vp ? (p.entropy ? reinterpret_cast<float*>(p.entropy.data) : lay.entropy) : nullptr;
  const size_t lse_es = p.lse.pair ? 8 : 4, saved_es = p.saved_lse.pair ? 8 : 4;

  for (int64_t r0 = 0; r0 < N; r0 += lay.C) {
    const int64_t rows = std::min(lay.C, N - r0);
    const char* hid = p.hidden.data + size_t(r0) * size_t(p.hidden.ld) * es;
    float beta = 0.f;
    if (p.bias) {
      const dim3 grid(unsigned(std::min<int64_t>((V + 255) / 256, 64)), unsigned(std::min<int64_t>(rows, 65535)));
      dispatch_float(dt, [&](auto tag) {
        using T = decltype(tag);
        bias_rows_kernel<T><<<grid, 256, 0, s>>>(reinterpret_cast<T*>(lay.logits), rows, ldl, V,
                                                 reinterpret_cast<const T*>(p.bias.data));
      });
      check_launch("bias kernel");
      beta = 1.f;
    }
    // logits (col-major V x rows) = W^T (V x H) * hidden^T (H x rows); V = 0: a shard of padding alone, whose
    // records are neutral and gradients 0 (no GEMM of an empty extent: cuBLAS refuses a leading dimension of 0)
    if (V > 0)
      gemm(h, s,
           {CUBLAS_OP_T, CUBLAS_OP_N, int(V), int(rows), int(H), p.weight.data, int(p.weight.ld), hid,
            int(p.hidden.ld), ct, lay.logits, int(ldl), ct, beta},
           GemmRole::Logits, "logits GEMM");
    Vec targets = p.targets;
    targets.data += size_t(r0) * ts;
    targets.n = rows;
    if (partial || vp) {  // the chunk's records
      CePartialProblem part;
      part.logits = Mat{lay.logits, dt, rows, V, ldl};
      part.targets = targets;
      part.o = p.o;
      part.records = partial ? p.records : Mat{reinterpret_cast<char*>(lay.rec), DType::F32, rows, vp->K, vp->K};
      if (partial) {
        part.records.data += size_t(r0) * size_t(p.records.ld) * 4;
        part.records.rows = rows;
      }
      ce_partial(h, stream, part);
      if (partial) continue;
      comm_all_gather(vp->comm, stream, lay.rec, lay.gathered, size_t(rows) * size_t(vp->K));
      CeCombineProblem comb;
      comb.records = Mat{reinterpret_cast<char*>(lay.gathered), DType::F32, W * rows, vp->K, vp->K};
      comb.W = W;
      comb.targets = targets;
      comb.o = p.o;
      if (p.lse) comb.lse = Vec{p.lse.data + size_t(r0) * lse_es, DType::F32, rows, false, p.lse.pair};
      comb.pair = Vec{reinterpret_cast<char*>(lay.lse + r0), DType::F32, rows, false, true};
      if (ent_rows) comb.entropy = Vec{reinterpret_cast<char*>(ent_rows + r0), DType::F32, rows, false};
      if (p.argmax) comb.argmax = Vec{p.argmax.data + size_t(r0) * dtype_size(p.argmax.dtype), p.argmax.dtype, rows, false};
      float* lr = (none ? reinterpret_cast<float*>(p.loss.data) : lay.row_loss) + r0;
      float* zr = none ? (p.z_loss ? reinterpret_cast<float*>(p.z_loss.data) + r0 : nullptr) : lay.row_zl + r0;
      ce_combine_rows(s, comb, lay.prep, lr, zr);
      if (!grad) continue;
    }
    CeRows r{};
    r.x = lay.logits;
    r.xt = dt;
    r.ld = ldl;
    r.N = rows;
    r.V = V;
    r.targets = targets.data;
    r.t64 = t64;
    r.o = &p.o;
    r.prep = lay.prep;
    if (vp) {
      r.saved_lse = reinterpret_cast<const float*>(lay.lse + r0);
      r.saved_pair = true;
      if (p.grad_entropy) r.saved_entropy = ent_rows + r0;
    } else if (!bwd) {
      r.loss_rows = (none ? reinterpret_cast<float*>(p.loss.data) : lay.row_loss) + r0;
      r.zl_rows = none ? (p.z_loss ? reinterpret_cast<float*>(p.z_loss.data) + r0 : nullptr) : lay.row_zl + r0;
      r.lse = p.lse ? reinterpret_cast<float*>(p.lse.data + size_t(r0) * lse_es) : nullptr;
      r.lse_pair = p.lse.pair;
      r.entropy = p.entropy ? reinterpret_cast<float*>(p.entropy.data) + r0 : nullptr;
      r.argmax = p.argmax ? p.argmax.data + size_t(r0) * dtype_size(p.argmax.dtype) : nullptr;
      r.a64 = p.argmax && p.argmax.dtype == DType::I64;
    } else {
      r.saved_lse = reinterpret_cast<const float*>(p.saved_lse.data + size_t(r0) * saved_es);
      r.saved_pair = p.saved_lse.pair;
      r.saved_entropy = p.saved_entropy ? reinterpret_cast<const float*>(p.saved_entropy.data) + r0 : nullptr;
    }
    if (grad) {
      r.dx = lay.logits;
      r.dxt = dt;
      r.ldd = ldl;
      r.grad_scalar = p.grad_loss && p.grad_loss.scalar;
      r.grad_loss = p.grad_loss ? reinterpret_cast<const float*>(p.grad_loss.data) + (r.grad_scalar ? 0 : r0) : nullptr;
      r.ge_scalar = p.grad_entropy && p.grad_entropy.scalar;
      r.grad_entropy =
          p.grad_entropy ? reinterpret_cast<const float*>(p.grad_entropy.data) + (r.ge_scalar ? 0 : r0) : nullptr;
    }
    if (V > 0) ce_rows(h, s, r, lay.rows);  // V = 0 (padding alone): no dlogits to form
    if (!grad) continue;
    if (dh_base) {
      // dhidden (col-major H x rows) = W (H x V, col-major view of [V,H]) * dl (V x rows)
      char* dh = dh_base + size_t(r0) * size_t(lddh) * dtype_size(dht);
      if (V == 0) {  // no column: this shard's part of dhidden is 0 (unless accumulating into it)
        if (!dh_add)
          check(cudaMemset2DAsync(dh, size_t(lddh) * dtype_size(dht), 0, size_t(H) * dtype_size(dht), size_t(rows), s),
                "cudaMemset2DAsync");
      } else
      check_blas(api.gemm_ex(blas, CUBLAS_OP_N, CUBLAS_OP_N, int(H), int(rows), int(V), &one, p.weight.data, ct,
                             int(p.weight.ld), lay.logits, ct, int(ldl), dh_add ? &one : &zero, dh, cuda_type(dht),
                             int(lddh), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                 "dhidden GEMM");
    }
    if (dw && V > 0) {
      // dW (col-major H x V) += hidden^T (H x rows) * dl^T (rows x V)
      const float b = r0 == 0 && !p.accumulate ? 0.f : 1.f;
      gemm(h, s,
           {CUBLAS_OP_N, CUBLAS_OP_T, int(H), int(V), int(rows), hid, int(p.hidden.ld), lay.logits, int(ldl), ct, dw,
            int(lddw), dwt, b},
           GemmRole::DWeight, "dweight GEMM");
    }
    if (lay.db_acc && V > 0) {
      dispatch_float(dt, [&](auto tag) {
        using T = decltype(tag);
        column_sum_kernel<T><<<unsigned((V + 255) / 256), 256, 0, s>>>(reinterpret_cast<const T*>(lay.logits), ldl, rows, V,
                                                                       lay.db_acc);
      });
      check_launch("dbias kernel");
    }
  }
  if (lay.db_acc && V > 0) convert(s, lay.db_acc, 1, V, V, p.dbias.data, p.dbias.dtype, V, p.accumulate);
  // A shard's padding rows of dweight and dbias: 0 (left as they are when accumulating).
  const int64_t pad = p.weight.rows - V;
  if (grad && pad > 0 && !p.accumulate) {
    if (p.dweight) {
      const size_t e = dtype_size(p.dweight.dtype);
      check(cudaMemset2DAsync(p.dweight.data + size_t(V) * size_t(lddw) * e, size_t(lddw) * e, 0, size_t(H) * e,
                              size_t(pad), s),
            "cudaMemset2DAsync");
    }
    if (p.dbias)
      check(cudaMemsetAsync(p.dbias.data + size_t(V) * dtype_size(p.dbias.dtype), 0,
                            size_t(pad) * dtype_size(p.dbias.dtype), s),
            "cudaMemsetAsync");
  }
  if (vp && dh_base) {  // the ranks' parts summed in fp32 in rank order, rounded once; the chunk scratch is free
    const bool direct = lay.dh32 && !p.accumulate && p.dhidden.ld == H;  // the sum rounded straight into it
    rank_order_sum(vp->comm, stream, reinterpret_cast<float*>(dh_base), size_t(N) * size_t(H),
                   direct ? p.dhidden.data : nullptr, p.dhidden.dtype, lay.logits, lay.logits_bytes, lay.sum_piece);
    if (lay.dh32 && !direct)
      convert(s, lay.dh32, N, H, H, p.dhidden.data, p.dhidden.dtype, p.dhidden.ld, p.accumulate);
  }
  if (!bwd && !partial && !none)
    ce_finalize(s, lay.row_loss, lay.row_zl, N, p.o.reduction, lay.prep, reinterpret_cast<float*>(p.loss.data),
                p.z_loss ? reinterpret_cast<float*>(p.z_loss.data) : nullptr);
}

}  // namespace

size_t linear_ce_workspace(fce_handle* h, const LinearCeProblem& p, bool minimum) {
  if (use_fused(h, p)) return FusedLayout(p, nullptr, 0, minimum).total;
  return LceLayout(h, p, nullptr, 0, minimum).total;
}

void linear_ce(fce_handle* h, fce_stream_t stream, const LinearCeProblem& p, Workspace w) {
  run(h, stream, p, w, nullptr);
}

size_t linear_ce_vp_workspace(fce_handle* h, const LinearCeProblem& p, int64_t ranks, bool minimum) {
  return LceLayout(h, p, nullptr, 0, minimum, ranks).total;
}

void linear_ce_vp(fce_handle* h, const fce_comm* c, fce_stream_t stream, const LinearCeProblem& p, Workspace w) {
  const VpStep step{c, p.records_width};
  run(h, stream, p, w, &step);
}

}  // namespace fce::cuda
