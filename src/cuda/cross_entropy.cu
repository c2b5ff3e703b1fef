// CUDA cross-entropy (forward, fused gradient, backward) and logsumexp.
//
// Rows are one block each when there are enough rows to fill the GPU: the block computes the row's
// online-softmax statistics in one pass and its outputs. With the fused gradient and 16-byte aligned rows,
// persistent blocks (one per SM) pipeline the rows: the next row's first ~225 KiB go to shared memory by
// asynchronous copies while the current row's gradient is written (row_kernel_pipe, and a lean variant for
// calls without soft-cap, weights, smoothing, entropy or argmax); otherwise the gradient pass re-reads the
// row with its prefix cached in shared memory (row_kernel_cached). With few rows, each row is split across
// blocks: logsumexp, and the cross-entropy forward without soft-cap, smoothing, entropy or argmax, of up to
// 64 aligned rows is one launch of register-resident slices merged through a thread-block cluster
// (lse_regs_kernel); otherwise the splits' statistics are merged in a fixed order, in one launch whose
// clusters are the rows (split_cluster_kernel, up to 8 splits), else by a partial and a merge kernel, and
// a gradient kernel writes each split's slice. Reductions over rows go through a
// single-block finalize kernel in a fixed order (a programmatic dependent launch on sm_90): no float
// atomics, bitwise repeatable, no host sync. The paths: cuda/plan.hpp (CePath, LsePath).
#include "cuda/ce_internal.hpp"
#include "cuda/ce_split.cuh"

#include <algorithm>
#include <type_traits>

namespace fce::cuda {
namespace {

// Mean denominator: the sum of w[t] over the non-ignored rows (an out-of-range target counts 1), in a
// fixed order; every thread of the block gets it.
__device__ double mean_denominator(const CeParams& p) {
  double den = 0;
  for (int64_t i = threadIdx.x; i < p.N; i += blockDim.x) {
    const int64_t t = load_index(p.targets, p.t64, i);
    if (t == p.ignore_index) continue;
    const bool in = t >= 0 && t < p.V;  // a target out of range or of a weight outside the domain counts 1
    den += in && p.weights && class_weight_ok(p.weights[t]) ? double(p.weights[t]) : 1.0;
  }
  return block_reduce(SumD(den)).s;
}

// The mean denominator and the sum of class weights, in a fixed order.
__global__ void __launch_bounds__(1024) prep_kernel(CeParams p, double* prep) {  // uses targets, weights, N, V
  const double den = mean_denominator(p);
  double W = 0;
  if (p.weights)
    for (int64_t j = threadIdx.x; j < p.V; j += blockDim.x)
      W += class_weight_ok(p.weights[j]) ? double(p.weights[j]) : double(NAN);
  W = block_reduce(SumD(W)).s;
  if (threadIdx.x == 0) {
    prep[0] = den;
    prep[1] = p.weights ? W : double(p.V);
  }
}

// SUM/MEAN of the row losses (and z-losses), fixed order; the MEAN's denominator from prep, or computed
// here from the targets when prep is null (one launch fewer for a forward without a gradient).
__global__ void __launch_bounds__(1024) finalize_kernel(CeParams p, float* loss, float* zloss) {
  wait_prior_grid();  // launched as a programmatic dependent of the rows' kernel where the device allows
  finalize_rows(p.loss_rows, p.zl_rows, p.N, p.reduction == FCE_REDUCTION_MEAN,
                [&] { return p.prep ? p.prep[0] : mean_denominator(p); }, loss, zloss);
}

// Calls body(T{}, T{}) for the logits' type: dlogits always has it (the API checks; linear CE's chunks are in
// the GEMM dtype), so no mixed pair is instantiated.
template <class F>
void dispatch_pair(DType in, DType out, F&& body) {
  if (in != out) raise(FCE_STATUS_INTERNAL_ERROR, "unsupported logits/dlogits dtype pair");
  dispatch_float(in, [&](auto t) { body(t, t); });
}

CeParams params_of(const CeRows& r) {
  CeParams k{};
  k.x = r.x;
  k.ld = r.ld;
  k.N = r.N;
  k.V = r.V;
  k.scale = r.o->logit_scale;
  k.softcap = r.o->softcap;
  k.full = true;
  k.targets = r.targets;
  k.t64 = r.t64;
  k.ignore_index = r.o->ignore_index;
  k.eps = r.o->label_smoothing;
  k.zq = r.o->z_loss_scale;
  k.col0 = r.o->sharded() ? r.o->vocab_start : 0;
  k.vt = r.o->sharded() ? r.o->vocab_total : r.V;
  k.inv_v = 1.f / float(k.vt);
  k.weights = r.o->class_weights ? reinterpret_cast<const float*>(r.o->class_weights.data) : nullptr;
  k.reduction = r.o->reduction;
  k.prep = r.prep;
  k.loss_rows = r.loss_rows;
  k.zl_rows = r.zl_rows;
  k.lse = r.lse;
  k.lse_pair = r.lse_pair;
  k.entropy = r.entropy;
  k.argmax = r.argmax;
  k.a64 = r.a64;
  k.dx = r.dx;
  k.ldd = r.ldd;
  k.grad_loss = r.grad_loss;
  k.grad_scalar = r.grad_scalar;
  k.saved_lse = r.saved_lse;
  k.saved_pair = r.saved_pair;
  k.grad_entropy = r.grad_entropy;
  k.ge_scalar = r.ge_scalar;
  k.saved_entropy = r.saved_entropy;
  return k;
}

// Split-row scratch: per-split partial statistics, and the merged lse for the gradient kernel.
struct RowsScratch {
  CeAcc* partial;
  LsePair* row_lse;  // the rows' lse for the gradient kernel
  float* row_ent;    // the entropy, for grad_entropy
  size_t bytes;
  RowsScratch(void* base, int64_t N, int splits, bool grad) {
    Carver c(base);
    partial = splits > 1 ? c.take<CeAcc>(size_t(N) * size_t(splits)) : nullptr;
    row_lse = splits > 1 && grad ? c.take<LsePair>(size_t(N)) : nullptr;
    row_ent = splits > 1 && grad ? c.take<float>(size_t(N)) : nullptr;
    bytes = c.used;
  }
};

}  // namespace

bool ce_needs_prep(const CeOpts& o) {
  return o.reduction == FCE_REDUCTION_MEAN || (o.class_weights && o.label_smoothing > 0.f);
}

void ce_prep(cudaStream_t s, const CeOpts& o, const void* targets, bool t64, int64_t N, int64_t V, double* prep) {
  CeParams k{};
  k.targets = targets;
  k.t64 = t64;
  k.N = N;
  k.V = V;
  k.ignore_index = o.ignore_index;
  k.weights = o.class_weights ? reinterpret_cast<const float*>(o.class_weights.data) : nullptr;
  prep_kernel<<<1, 1024, 0, s>>>(k, prep);
  check_launch("cross-entropy prep kernel");
}

void ce_finalize(cudaStream_t s, const float* loss_rows, const float* zl_rows, int64_t N, int reduction,
                 const double* prep, float* loss, float* zloss, const CeDenominator* den, bool dependent) {
  CeParams k{};
  if (!prep && reduction == FCE_REDUCTION_MEAN) {
    if (!den) raise(FCE_STATUS_INTERNAL_ERROR, "mean reduction without its denominator");
    k.targets = den->targets;
    k.t64 = den->t64;
    k.V = den->V;
    k.ignore_index = den->o->ignore_index;
    k.weights = den->o->class_weights ? reinterpret_cast<const float*>(den->o->class_weights.data) : nullptr;
  }
  k.N = N;
  k.loss_rows = const_cast<float*>(loss_rows);
  k.zl_rows = const_cast<float*>(zl_rows);
  k.reduction = reduction;
  k.prep = prep;
  launch_ex(finalize_kernel, dim3(1), dim3(1024), 0, s, 0, dependent, "cross-entropy finalize kernel", k, loss,
            zloss);
}

size_t ce_rows_workspace(fce_handle* h, int64_t N, int64_t V, bool grad, bool backward) {
  return backward ? 0 : RowsScratch(nullptr, N, ce_splits(h->caps, N, V), grad).bytes;
}

namespace {

// The plan of the rows of `r` (src/cuda/plan.hpp: CePath).
CePlan ce_plan(fce_handle* h, const CeRows& r, const CeParams& k) {
  const size_t xs = dtype_size(r.xt), os = r.dx ? dtype_size(r.dxt) : xs;
  CeShape sh;
  sh.N = r.N;
  sh.V = r.V;
  sh.esize = int(xs);
  sh.grad = r.dx != nullptr;
  sh.backward = r.saved_lse != nullptr;
  sh.regs_options = ce_regs_ok(k);
  sh.aligned16 = aligned16(r.x, r.ld, int(xs));
  // The pipelined kernel: logits and dlogits of one dtype, 16-byte aligned rows long enough to fill a good
  // part of shared memory.
  sh.pipe_layout = sh.grad && xs == os && sh.aligned16 && aligned16(r.dx, r.ldd, int(os)) &&
                   r.V * int64_t(xs) >= 16 * 1024;
  CePlan plan;
  dispatch_float(r.xt, [&](auto tag) { plan = plan_ce(sh, h->caps, lse_regs_kernels<decltype(tag), true>(h)); });
  return plan;
}

}  // namespace

void ce_rows(fce_handle* h, cudaStream_t s, const CeRows& r, void* ws) {
  const bool grad = r.dx != nullptr;
  CeParams k = params_of(r);
  const CePlan plan = ce_plan(h, r, k);
  k.splits = plan.splits;
  const unsigned N = unsigned(r.N);
  dispatch_pair(r.xt, grad ? r.dxt : r.xt, [&](auto ti, auto to) {
    using T = decltype(ti);
    using O = decltype(to);
    switch (plan.path) {
      case CePath::Backward:
        grad_kernel<T, O><<<dim3(unsigned(plan.splits), N), kRowThreads, 0, s>>>(k);
        break;
      case CePath::Regs:  // few rows, forward only: one launch
        launch_lse_regs<T, true>(h, s, k, plan.regs);
        break;
      case CePath::Pipe: {
        // Shared memory for as much of the row as fits (16-byte vectors), one persistent block per SM.
        const int64_t row_vecs = r.V * int64_t(sizeof(T)) / 16;
        const int64_t max_vecs = pipe_smem(h->caps) / 16;
        const int64_t cache_vecs = row_vecs < max_vecs ? row_vecs : max_vecs;
        const size_t smem = size_t(cache_vecs) * 16;
        const int64_t grid = pipe_grid(h->caps, r.N);
        // The lean kernel: plain options; with grad_entropy its entropy variant (which may write the entropy).
        const bool plain = k.softcap == 0.f && !k.weights && k.eps == 0.f && !k.argmax && (!k.entropy || k.grad_entropy);
        auto kernel = !plain ? row_kernel_pipe<T>
                      : k.grad_entropy ? row_kernel_pipe_plain<T, true> : row_kernel_pipe_plain<T, false>;
        check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
              "cudaFuncSetAttribute");
        kernel<<<unsigned(grid), kCachedThreads, smem, s>>>(k, cache_vecs);
        break;
      }
      case CePath::Cached: {
        // Shared memory for as much of the row as fits (16-byte vectors), one block per SM.
        const int64_t row_vecs = r.V * int64_t(sizeof(T)) / 16 + 1;
        const int64_t max_vecs = (int64_t(h->caps.max_smem_optin) / kCachedBlocks - 2048) / 16;
        const int64_t cache_vecs = row_vecs < max_vecs ? row_vecs : max_vecs;
        const size_t smem = size_t(cache_vecs > 0 ? cache_vecs : 0) * 16;
        check(cudaFuncSetAttribute(row_kernel_cached<T, O>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
              "cudaFuncSetAttribute");
        row_kernel_cached<T, O><<<N, kCachedThreads, smem, s>>>(k, cache_vecs);
        break;
      }
      case CePath::Row:
        row_kernel<T, O><<<N, kRowThreads, 0, s>>>(k);
        break;
      case CePath::SplitCluster:
      case CePath::SplitPhased: {
        const RowsScratch scratch(ws, r.N, plan.splits, grad);
        k.partial = scratch.partial;
        k.row_lse = scratch.row_lse;
        k.row_ent = k.grad_entropy ? scratch.row_ent : nullptr;
        launch_split_rows<T>(h, s, k, plan.path == CePath::SplitCluster);
        if (grad) grad_kernel<T, O><<<dim3(unsigned(plan.splits), N), kRowThreads, 0, s>>>(k);
        break;
      }
    }
  });
  check_launch("cross-entropy kernels");
}

namespace {

// Workspace of a cross-entropy call: prep, reduced row losses, then the rows' scratch.
struct CeCallWorkspace {
  double* prep;
  float *row_loss, *row_zl;
  void* rows;
  size_t bytes;
  CeCallWorkspace(fce_handle* h, const CeProblem& p, void* base) {
    Carver c(base);
    const bool reduced = !p.backward() && p.o.reduction != FCE_REDUCTION_NONE;
    prep = ce_needs_prep(p.o) ? c.take<double>(2) : nullptr;
    row_loss = reduced ? c.take<float>(size_t(p.logits.rows)) : nullptr;
    row_zl = reduced ? c.take<float>(size_t(p.logits.rows)) : nullptr;
    const size_t rb = ce_rows_workspace(h, p.logits.rows, p.logits.cols, static_cast<bool>(p.dlogits), p.backward());
    rows = c.take<char>(rb);
    bytes = c.used;
  }
};

}  // namespace

size_t ce_workspace(fce_handle* h, const CeProblem& p) { return CeCallWorkspace(h, p, nullptr).bytes; }

void ce(fce_handle* h, fce_stream_t stream, const CeProblem& p, Workspace w) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const CeCallWorkspace ws(h, p, w.ptr);
  const bool none = p.o.reduction == FCE_REDUCTION_NONE;
  const bool t64 = p.targets.dtype == DType::I64;
  // A forward without a gradient leaves the mean's denominator to the finalize kernel (one launch fewer);
  // gradients and smoothing with class weights need prep before the rows.
  const bool prep_first =
      ws.prep && (p.dlogits || p.backward() || (p.o.class_weights && p.o.label_smoothing > 0.f));
  // A vocabulary shard's prep counts over the whole vocabulary.
  const int64_t V_prep = p.o.sharded() ? p.o.vocab_total : p.logits.cols;
  if (prep_first) ce_prep(s, p.o, p.targets.data, t64, p.logits.rows, V_prep, ws.prep);
  // A vocabulary shard (the API takes its backward only): the gradient kernels over its real columns, with
  // the vocabulary's size and the shard's first column in CeParams; 0 in the padding past vocab_total.
  const int64_t cols = p.o.sharded() ? std::min(p.logits.cols, p.o.vocab_total - p.o.vocab_start) : p.logits.cols;
  if (cols < p.logits.cols) {
    const size_t es = dtype_size(p.dlogits.dtype);
    check(cudaMemset2DAsync(p.dlogits.data + size_t(cols) * es, size_t(p.dlogits.ld) * es, 0,
                            size_t(p.logits.cols - cols) * es, size_t(p.logits.rows), s),
          "cudaMemset2DAsync");
  }
  if (cols == 0) return;
  CeRows r{};
  r.x = p.logits.data;
  r.xt = p.logits.dtype;
  r.ld = p.logits.ld;
  r.N = p.logits.rows;
  r.V = cols;
  r.targets = p.targets.data;
  r.t64 = t64;
  r.o = &p.o;
  r.prep = prep_first ? ws.prep : nullptr;
  r.loss_rows = none ? reinterpret_cast<float*>(p.loss.data) : ws.row_loss;
  r.zl_rows = none ? (p.z_loss ? reinterpret_cast<float*>(p.z_loss.data) : nullptr) : ws.row_zl;
  r.lse = p.lse ? reinterpret_cast<float*>(p.lse.data) : nullptr;
  r.lse_pair = p.lse.pair;
  r.entropy = p.entropy ? reinterpret_cast<float*>(p.entropy.data) : nullptr;
  r.argmax = p.argmax ? p.argmax.data : nullptr;
  r.a64 = p.argmax && p.argmax.dtype == DType::I64;
  r.dx = p.dlogits ? p.dlogits.data : nullptr;
  r.dxt = p.dlogits ? p.dlogits.dtype : p.logits.dtype;
  r.ldd = p.dlogits ? p.dlogits.ld : 0;
  r.grad_loss = p.grad_loss ? reinterpret_cast<const float*>(p.grad_loss.data) : nullptr;
  r.grad_scalar = p.grad_loss && p.grad_loss.scalar;
  r.saved_lse = p.backward() ? reinterpret_cast<const float*>(p.saved_lse.data) : nullptr;
  r.saved_pair = p.saved_lse.pair;
  r.grad_entropy = p.grad_entropy ? reinterpret_cast<const float*>(p.grad_entropy.data) : nullptr;
  r.ge_scalar = p.grad_entropy && p.grad_entropy.scalar;
  r.saved_entropy = p.saved_entropy ? reinterpret_cast<const float*>(p.saved_entropy.data) : nullptr;
  ce_rows(h, s, r, ws.rows);
  if (!p.backward() && !none) {
    const CeDenominator den{&p.o, p.targets.data, t64, p.logits.cols};
    // A programmatic dependent launch needs what clusters need: an sm_90 device running sm_90 code.
    ce_finalize(s, ws.row_loss, ws.row_zl, p.logits.rows, p.o.reduction, r.prep, reinterpret_cast<float*>(p.loss.data),
                p.z_loss ? reinterpret_cast<float*>(p.z_loss.data) : nullptr, &den, h->caps.clusters);
  }
}

size_t lse_workspace(fce_handle* h, const LseProblem& p) {
  return RowsScratch(nullptr, p.x.rows, lse_splits(h->caps, p.x.rows, p.x.cols), false).bytes;
}

void lse(fce_handle* h, fce_stream_t stream, const LseProblem& p, Workspace w) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const int64_t N = p.x.rows;
  CeParams k{};
  k.x = p.x.data;
  k.ld = p.x.ld;
  k.N = N;
  k.V = p.x.cols;
  k.scale = p.scale;
  k.full = false;
  k.lse = reinterpret_cast<float*>(p.lse.data);
  dispatch_float(p.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int es = int(sizeof(T));
    const LsePlan plan = plan_lse(N, p.x.cols, es, aligned16(p.x.data, p.x.ld, es), h->caps,
                                  lse_regs_kernels<T, false>(h));
    const RowsScratch ws(w.ptr, N, plan.splits, false);
    k.splits = plan.splits;
    k.partial = ws.partial;
    switch (plan.path) {
      case LsePath::Regs:  // few rows: one launch
        launch_lse_regs<T, false>(h, s, k, plan.regs);
        break;
      case LsePath::Row:
        row_kernel<T, T><<<unsigned(N), kRowThreads, 0, s>>>(k);
        break;
      case LsePath::SplitCluster:
      case LsePath::SplitPhased:
        launch_split_rows<T>(h, s, k, plan.path == LsePath::SplitCluster);
        break;
    }
  });
  check_launch("logsumexp kernels");
}

}  // namespace fce::cuda
