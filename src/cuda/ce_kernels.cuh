// Cross-entropy device code, one block per row: the per-thread statistics (CeAcc), the call's parameters
// (CeParams), the row's outputs and gradient, and the row kernels of cross_entropy.cu's row, cached and
// pipe paths.
#pragma once
#include "cuda/ce_internal.hpp"
#include "cuda/common.cuh"
#include "cuda/row_plan.cuh"

namespace fce::cuda {
namespace {

// Per-thread statistics of a row slice: the online softmax (m, d) in the shifted form with k = log2(e)
// (m in units of the transformed logits z), s1 = the sum of e^(z-m) (z-m) for the entropy (shifted with m:
// H = log d - s1/d keeps the precision of a peaked row's small entropy, which lse - sum p z loses to the
// rounding of lse), the plain sum of w_j*z_j for label smoothing, and the raw-logit argmax.
struct CeAcc : OnlineSoftmax {
  float s1, swz, av;
  int64_t ai;
  __device__ CeAcc() : s1(0.f), swz(0.f), av(-INFINITY), ai(INT64_MAX) {}
  // NaN counts as the largest value; ties go to the lowest index.
  __device__ static bool better(float v, int64_t j, float av, int64_t ai) {
    const bool vn = isnan(v), an = isnan(av);
    if (vn != an) return vn;
    if (v == av || (vn && an)) return j < ai;
    return v > av;
  }
  // s1 of a part (max mo, sum dd) shifted to the max mn: s1 + (mo - mn) dd; a part that saw nothing adds 0.
  __device__ static float shifted(float s, float mo, float dd, float mn) {
    return mo == -INFINITY ? 0.f : __fmaf_rn(__fsub_rn(mo, mn), dd, s);
  }
  __device__ void merge(const CeAcc& o) {
    const float ma = m, da = d;
    const Factors f = OnlineSoftmax::merge(o, kLog2e);
    s1 = m == INFINITY ? 0.f  // +inf logits: lse only
                       : __fadd_rn(__fmul_rn(shifted(s1, ma, da, m), f.a), __fmul_rn(shifted(o.s1, o.m, o.d, m), f.b));
    swz += o.swz;
    if (better(o.av, o.ai, av, ai)) { av = o.av; ai = o.ai; }
  }
  __device__ CeAcc shfl_down(unsigned off) const {
    CeAcc r;
    r.m = __shfl_down_sync(0xffffffffu, m, off);
    r.d = __shfl_down_sync(0xffffffffu, d, off);
    r.s1 = __shfl_down_sync(0xffffffffu, s1, off);
    r.swz = __shfl_down_sync(0xffffffffu, swz, off);
    r.av = __shfl_down_sync(0xffffffffu, av, off);
    r.ai = __shfl_down_sync(0xffffffffu, ai, off);
    return r;
  }
};

struct CeParams {
  const void* x;
  int64_t ld, N, V;
  float scale, softcap;
  bool full;  // cross-entropy (targets, entropy, argmax) rather than logsumexp only
  // cross-entropy inputs and options
  const void* targets;
  bool t64;
  int64_t ignore_index;
  float eps, zq, inv_v;
  const float* weights;
  int reduction;
  const double* prep;  // [0] mean denominator, [1] sum of class weights
  // outputs (row losses go to the workspace when reduced); lse: [N], or [N, 2] of LsePair with lse_pair
  float *loss_rows, *zl_rows, *lse, *entropy;
  bool lse_pair;
  void* argmax;
  bool a64;
  void* dx;
  int64_t ldd;
  const float* grad_loss;
  bool grad_scalar;
  // split rows
  int splits;
  int chunk;  // lse_regs_kernel: slice width, slice_cols(V, splits)
  CeAcc* partial;
  LsePair* row_lse;        // the lse for the gradient kernel
  const float* saved_lse;  // [N], or [N, 2] of LsePair with saved_pair
  bool saved_pair;
  // the entropy's upstream gradient (scalar or [N]); the entropy of the backward's rows, or of split rows
  const float* grad_entropy;
  bool ge_scalar;
  const float* saved_entropy;
  float* row_ent;
  // a vocabulary shard (the backward of fce_cross_entropy_bwd with vocab_total): the global index of column
  // 0, and the vocabulary's size (V itself unsharded)
  int64_t col0, vt;
};


// Accumulates row slice [begin, end) into a thread's CeAcc. Per 16-byte vector: the raw max (the
// transform is increasing, so max z = tf(max x)), one rescale, then one FMA + ex2 per element in base 2.
// The argmax is updated only when a vector holds a new maximum. A NaN makes d NaN; the caller then finds
// the first NaN for the argmax on a slow path.
template <class T, bool kSoftcap, bool kEntropy, bool kSmooth, bool kFromCache>
__device__ CeAcc accumulate(const CeParams& p, const T* row, int64_t begin, int64_t end, uint4* cache,
                            int64_t cache_vecs) {
  const LogitTransform tf(p.scale, p.softcap);
  CeAcc a;
  row_visit<T, kRowUnroll, kFromCache>(row, begin, end, [&](float (&v)[kVec<T>], int64_t j0, int n) {
    float vmax = -INFINITY;
#pragma unroll
    for (int k = 0; k < kVec<T>; ++k)
      if (k < n) vmax = fmaxf(vmax, v[k]);
    if (p.full && vmax > a.av) {  // new running maximum: first index holding it
      int kk = 0;
#pragma unroll
      for (int k = kVec<T> - 1; k >= 0; --k)
        if (k < n && v[k] == vmax) kk = k;
      a.av = vmax;
      a.ai = j0 + kk;
    }
    float z[kVec<T>];
#pragma unroll
    for (int k = 0; k < kVec<T>; ++k) z[k] = kSoftcap ? tf(v[k]) : v[k] * p.scale;
    // z - max is exact 0 at the maximum, so a single logit gives d = 1 and lse = z exactly.
    const float g = tf(vmax);
    a.add_shifted<kVec<T>>(z, n, g, kLog2e, [&](float r) {  // a.d is rescaled already, a.m not yet
      if (kEntropy) a.s1 = a.m == -INFINITY ? 0.f : __fmaf_rn(__fsub_rn(a.m, g), a.d, __fmul_rn(a.s1, r));
    }, [&](int k, float e) {
      if (kEntropy) a.s1 = __fmaf_rn(e, e > 0.f ? __fsub_rn(z[k], a.m) : 0.f, a.s1);  // a select: -inf z adds 0
      if (kSmooth && p.eps > 0.f) a.swz += (p.weights ? p.weights[j0 + k] : 1.f) * z[k];
    });
  }, cache, cache_vecs);
  return a;
}

// Block-wide statistics of row slice [begin, end), with the NaN slow path for the argmax.
template <class T>
__device__ CeAcc finish_stats(const CeParams& p, const T* row, int64_t begin, int64_t end, CeAcc a) {
  __shared__ int64_t first_nan;
  a = block_reduce(a);
  if (isnan(a.d)) {  // rare: a NaN logit, or +inf (inf - inf)
    if (threadIdx.x == 0) first_nan = INT64_MAX;
    __syncthreads();
    for (int64_t j = begin + threadIdx.x; j < end; j += blockDim.x)
      if (isnan(to_float(row[j]))) atomicMin(reinterpret_cast<unsigned long long*>(&first_nan), (unsigned long long)j);
    __syncthreads();
    if (first_nan != INT64_MAX) {  // the first NaN counts as the largest logit
      a.av = NAN;
      a.ai = first_nan;
    } else if (!p.full) {  // logsumexp of a row holding +inf (and no NaN) is +inf
      a.m = INFINITY;
      a.d = 1.f;
    }
    __syncthreads();
  }
  return a;
}

template <class T, bool kSoftcap, bool kEntropy, bool kSmooth, bool kFromCache>
__device__ CeAcc block_stats(const CeParams& p, const T* row, int64_t begin, int64_t end, uint4* cache,
                             int64_t cache_vecs) {
  return finish_stats<T>(
      p, row, begin, end, accumulate<T, kSoftcap, kEntropy, kSmooth, kFromCache>(p, row, begin, end, cache, cache_vecs));
}

// Statistics with the call's feature flags resolved at compile time (entropy and smoothing share one).
// kFromCache: the first cache_vecs vectors are read from `cache` (filled by cp_async16) rather than stored to it.
template <class T, bool kFromCache = false>
__device__ CeAcc row_stats(const CeParams& p, const T* x, int64_t b, int64_t e, uint4* cache = nullptr,
                           int64_t cache_vecs = 0) {
  const bool sc = p.softcap > 0.f, extra = p.full && (p.entropy || p.grad_entropy || p.eps > 0.f);
  if (sc)
    return extra ? block_stats<T, true, true, true, kFromCache>(p, x, b, e, cache, cache_vecs)
                 : block_stats<T, true, false, false, kFromCache>(p, x, b, e, cache, cache_vecs);
  return extra ? block_stats<T, false, true, true, kFromCache>(p, x, b, e, cache, cache_vecs)
               : block_stats<T, false, false, false, kFromCache>(p, x, b, e, cache, cache_vecs);
}

__device__ float row_grad_scale(const CeParams& p, int64_t row) {
  float g = p.grad_loss ? p.grad_loss[p.grad_scalar ? 0 : row] : 1.f;
  if (p.reduction == FCE_REDUCTION_MEAN) {
    const double den = p.prep[0];
    g = den > 0 ? float(double(g) / den) : 0.f;
  }
  return g;
}

// Per-row values loaded ahead of need (the pipelined kernel loads them before the statistics pass, so
// that their latency hides behind it): target, gradient scale, target logit (NaN if out of range).
struct RowHints {
  int64_t t;
  float g, xt;
};

template <class T>
__device__ RowHints row_hints(const CeParams& p, int64_t row) {
  RowHints h;
  h.t = load_index(p.targets, p.t64, row);
  h.g = p.dx ? row_grad_scale(p, row) : 0.f;
  // The target logit is used by thread 0 alone (write_row_outputs).
  h.xt = threadIdx.x == 0 && h.t >= 0 && h.t < p.V ? to_float(static_cast<const T*>(p.x)[row * p.ld + h.t]) : NAN;
  return h;
}

// A saved lse of the backward: the pair (lse, 0) of an [N] tensor, or the row's LsePair.
__device__ __forceinline__ LsePair saved_lse_of(const CeParams& p, int64_t row) {
  if (!p.saved_pair) return {p.saved_lse[row], 0.f};
  const float2 v = reinterpret_cast<const float2*>(p.saved_lse)[row];
  return {v.x, v.y};
}

// p_j = e^((z_j - hi) - lo) in base 2 (LsePair): every gradient kernel forms it so, from the row's pair.
__device__ __forceinline__ float pair_exp(float z, float hi, float nlo2) {
  return ex2(__fmaf_rn(__fsub_rn(z, hi), kLog2e, nlo2));
}

// Writes row outputs from the merged statistics (one thread); returns the row's lse as its pair (the max z
// and the log of the shifted sum), and its entropy in *H when H is not null.
template <class T>
__device__ LsePair write_row_outputs(const CeParams& p, int64_t row, const CeAcc& a, const RowHints* hint = nullptr,
                                     float* H = nullptr) {
  const float lse = a.m == -INFINITY ? -INFINITY : a.m + logf(a.d);
  const LsePair pair{a.m, a.m == -INFINITY ? 0.f : logf(a.d)};
  if (!p.full) {  // logsumexp: a NaN anywhere in the row (finish_stats marks it in av) wins over +-inf
    p.lse[row] = isnan(a.av) ? NAN : lse;
    return pair;
  }
  if (p.lse) {
    if (p.lse_pair) reinterpret_cast<float2*>(p.lse)[row] = make_float2(pair.hi, pair.lo);
    else p.lse[row] = lse;
  }
  const float ent = a.m == -INFINITY ? NAN : logf(a.d) - a.s1 / a.d;
  if (p.entropy) p.entropy[row] = ent;
  if (H) *H = ent;
  if (p.argmax) {
    const int64_t ai = a.ai == INT64_MAX ? 0 : a.ai;  // a row of all -inf: index 0, as on the CPU
    if (p.a64) static_cast<int64_t*>(p.argmax)[row] = ai;
    else static_cast<int32_t*>(p.argmax)[row] = int32_t(ai);
  }
  const int64_t t = hint ? hint->t : load_index(p.targets, p.t64, row);
  float loss = 0.f, zl = 0.f;
  if (t != p.ignore_index) {
    if (t < 0 || t >= p.V || (p.weights && !class_weight_ok(p.weights[t]))) {
      loss = zl = NAN;
    } else {
      const LogitTransform tf(p.scale, p.softcap);
      const T* x = static_cast<const T*>(p.x) + row * p.ld;
      const float zt = tf(hint ? hint->xt : to_float(x[t]));
      const float wt = p.weights ? p.weights[t] : 1.f;
      zl = p.zq * lse * lse;
      loss = (1.f - p.eps) * wt * ((a.m - zt) + pair.lo) + zl;  // lse - z_t from max-shifted values
      if (p.eps > 0.f) {  // prep holds the class weights' sum only when smoothing needs it
        const float W = p.weights ? float(p.prep[1]) : float(p.V);
        loss += p.eps * p.inv_v * (lse * W - a.swz);
      }
    }
  }
  p.loss_rows[row] = loss;
  if (p.zl_rows) p.zl_rows[row] = zl;
  return pair;
}

// The gradient with the entropy's term for plain rows (z = s x: no soft-cap, class weights or smoothing):
// dx_j = p_j (g0 + gu u_j) - [j == t] gt with u_j = log p_j = (z_j - hi) - lo (the row's LsePair),
// g0 = s (cp - ge H), gu = -s ge (CeGrad's terms, mu - z_j = -u_j - H); 0 where p_j = 0 (a -inf logit). The
// pipelined plain kernel and write_grad (the backward) form it alike, so that both give the same bits.
struct EntPlain {
  float s, hi, lo, g0, gu, gt;
  __device__ EntPlain(float s_, LsePair l, const CeGrad& g)
      : s(s_), hi(l.hi), lo(l.lo), g0(s_ * fmaf(-g.ge, g.H, g.cp)), gu(-s_ * g.ge), gt(s_ * g.ct) {}
  __device__ float operator()(float x, bool is_target) const {
    const float u = __fsub_rn(__fsub_rn(__fmul_rn(x, s), hi), lo);
    const float pj = ex2(__fmul_rn(u, kLog2e));
    return (pj == 0.f ? 0.f : pj * __fmaf_rn(gu, u, g0)) - (is_target ? gt : 0.f);
  }
};

// dlogits for row slice [begin, end), formed in fp32 and rounded once to O; H is the row's entropy (read
// only with grad_entropy). With `next`, the cached slots are refilled with the next row as they are used
// (row_map).
template <class T, class O>
__device__ void write_grad(const CeParams& p, int64_t row, int64_t begin, int64_t end, LsePair lse, float H,
                           uint4* cache = nullptr, int64_t cache_vecs = 0, const uint4* next = nullptr,
                           const RowHints* hint = nullptr) {
  const T* x = static_cast<const T*>(p.x) + row * p.ld;
  O* dx = static_cast<O*>(p.dx) + row * p.ldd;
  const int64_t t = hint ? hint->t : load_index(p.targets, p.t64, row);
  const float g = hint ? hint->g : row_grad_scale(p, row);
  const float ge = p.grad_entropy ? p.grad_entropy[p.ge_scalar ? 0 : row] : 0.f;
  const LogitTransform tf(p.scale, p.softcap);
  // A target out of range, or of a class weight outside the domain: NaN always.
  const bool bad = t != p.ignore_index && (t < 0 || t >= p.vt || (p.weights && !class_weight_ok(p.weights[t])));
  const bool lg = !bad && t != p.ignore_index && g != 0.f;      // the loss has a gradient here
  if (bad || (!lg && ge == 0.f)) {
    const float fill = bad ? NAN : 0.f;
    row_map<T, O>(x, dx, begin, end, [&](float (&v)[kVec<T>], int64_t, int n) {
#pragma unroll
      for (int k = 0; k < kVec<T>; ++k) v[k] = fill;
    }, cache, cache_vecs, next);
    return;
  }
  // The class weights' sum enters with label smoothing only (prep holds it then, and only then).
  const float W = p.weights && p.eps > 0.f ? float(p.prep[1]) : float(p.vt);
  CeGrad grad(lg ? g : 0.f, p.eps, lg && p.weights ? p.weights[t] : 1.f, W, p.inv_v, p.zq, lse.value());
  const int64_t tl = t - p.col0;  // the target's column in these logits (outside [0, V) in another shard's)
  const float hi = lse.hi, nlo2 = -lse.lo * kLog2e;
  if (ge != 0.f) {  // the entropy's term as well (CeGrad)
    grad.entropy(ge, H);
    if (p.softcap == 0.f && !p.weights && p.eps == 0.f) {
      const EntPlain ep(p.scale, lse, grad);
      row_map<T, O>(x, dx, begin, end, [&](float (&v)[kVec<T>], int64_t j0, int n) {
#pragma unroll
        for (int k = 0; k < kVec<T>; ++k)
          if (k < n) v[k] = ep(v[k], j0 + k == tl);
      }, cache, cache_vecs, next);
      return;
    }
    row_map<T, O>(x, dx, begin, end, [&](float (&v)[kVec<T>], int64_t j0, int n) {
#pragma unroll
      for (int k = 0; k < kVec<T>; ++k) {
        if (k < n) {
          const float z = tf(v[k]);
          const float w = p.weights && p.eps > 0.f ? p.weights[p.col0 + j0 + k] : 1.f;  // smoothing only
          v[k] = grad(pair_exp(z, hi, nlo2), w, j0 + k == tl, lse.logp(z)) * tf.derivative(z);
        }
      }
    }, cache, cache_vecs, next);
    return;
  }
  if (p.softcap == 0.f && !p.weights) {
    // Common case: z = s*x, dz/dx = s, w = 1. Per element z, z - hi, one FMA, one ex2, one FMA.
    const float s = p.scale, a = p.scale * grad.cp, b = -p.scale * grad.cw, at = p.scale * grad.ct;
    row_map<T, O>(x, dx, begin, end, [&](float (&v)[kVec<T>], int64_t j0, int n) {
      const int64_t kt = tl - j0;  // the target's position in this vector, if any
#pragma unroll
      for (int k = 0; k < kVec<T>; ++k) {
        if (k < n) v[k] = fmaf(a, pair_exp(__fmul_rn(v[k], s), hi, nlo2), b) - (k == kt ? at : 0.f);
      }
    }, cache, cache_vecs, next);
    return;
  }
  row_map<T, O>(x, dx, begin, end, [&](float (&v)[kVec<T>], int64_t j0, int n) {
#pragma unroll
    for (int k = 0; k < kVec<T>; ++k) {
      if (k < n) {
        const float z = tf(v[k]);
        const float w = p.weights && p.eps > 0.f ? p.weights[p.col0 + j0 + k] : 1.f;  // smoothing only
        v[k] = grad(pair_exp(z, hi, nlo2), w, j0 + k == tl) * tf.derivative(z);
      }
    }
  }, cache, cache_vecs, next);
}

// One block per row: statistics, outputs, and the gradient.
template <class T, class O>
__global__ void __launch_bounds__(kRowThreads) row_kernel(CeParams p) {
  __shared__ LsePair s_lse;
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.ld;
  const CeAcc a = row_stats<T>(p, x, 0, p.V);
  __shared__ float s_h;
  if (threadIdx.x == 0) s_lse = write_row_outputs<T>(p, row, a, nullptr, &s_h);
  if (!p.dx) return;
  __syncthreads();
  write_grad<T, O>(p, row, 0, p.V, s_lse, s_h);
}

// Forward with the fused gradient, one block per SM: the first part of the row stays in shared memory
// between the statistics and the gradient pass, the rest is re-read while still in L2. One read and one
// write of the row from device memory.
constexpr int kCachedThreads = 1024;  // one wide block per SM streams the rest of the row while it computes
constexpr int kCachedBlocks = 1;      // blocks per SM, each caching 1/kCachedBlocks of the shared memory
template <class T, class O>
__global__ void __launch_bounds__(kCachedThreads, kCachedBlocks) row_kernel_cached(CeParams p, int64_t cache_vecs) {
  extern __shared__ uint4 cache[];
  __shared__ LsePair s_lse;
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.ld;
  __shared__ float s_h;
  const CeAcc a = row_stats<T>(p, x, 0, p.V, cache, cache_vecs);
  if (threadIdx.x == 0) s_lse = write_row_outputs<T>(p, row, a, nullptr, &s_h);
  __syncthreads();
  write_grad<T, O>(p, row, 0, p.V, s_lse, s_h, cache, cache_vecs);
}

// Forward with the fused gradient, rows aligned to 16 bytes: persistent blocks (one per SM), each looping
// over rows. The first cache_vecs vectors of a row are brought into shared memory by asynchronous copies
// issued while the previous row's gradient is being written, slot by slot as each slot is used, so the
// loads of row r + 1 overlap the stores of row r; the statistics pass then reads shared memory, and the
// rest of the row (re-read by the gradient pass) was prefetched into L2 the same way.
// The part of row r past its cached vectors into L2 (one bulk prefetch of a 16-byte multiple, sm_90).
template <class T>
__device__ __forceinline__ void prefetch_rest(const CeParams& p, int64_t r, int64_t cache_vecs) {
  const T* x = static_cast<const T*>(p.x) + r * p.ld + cache_vecs * kVec<T>;
  const int64_t bytes = (p.V - cache_vecs * kVec<T>) * int64_t(sizeof(T)) / 16 * 16;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (threadIdx.x == 0 && bytes > 0)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(x), "r"(unsigned(bytes)) : "memory");
#else
  (void)x;
  (void)bytes;  // no bulk prefetch before sm_90: the gradient pass re-reads the rest through L2 anyway
#endif
}

// The first row of a persistent block: its cached vectors (this thread's slots) and the rest into L2.
template <class T>
__device__ __forceinline__ void pipe_start(const CeParams& p, int64_t row, uint4* cache, int64_t cache_vecs) {
  const uint4* src = reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + row * p.ld);
  for (int64_t i = threadIdx.x; i < cache_vecs; i += blockDim.x) cp_async16(cache + i, src + i);
  cp_async_commit();
  prefetch_rest<T>(p, row, cache_vecs);
}

template <class T>
__global__ void __launch_bounds__(kCachedThreads, 1) row_kernel_pipe(CeParams p, int64_t cache_vecs) {
  extern __shared__ uint4 cache[];
  __shared__ LsePair s_lse;
  __shared__ float s_h;
  int64_t row = blockIdx.x;
  if (row >= p.N) return;
  pipe_start<T>(p, row, cache, cache_vecs);
  for (; row < p.N; row += gridDim.x) {
    const RowHints hint = row_hints<T>(p, row);
    cp_async_wait_all();  // this thread's slots (only it reads them in either pass)
    const T* x = static_cast<const T*>(p.x) + row * p.ld;
    const int64_t next = row + gridDim.x;
    const CeAcc a = row_stats<T, true>(p, x, 0, p.V, cache, cache_vecs);
    if (threadIdx.x == 0) s_lse = write_row_outputs<T>(p, row, a, &hint, &s_h);
    __syncthreads();
    if (next < p.N) prefetch_rest<T>(p, next, cache_vecs);
    write_grad<T, T>(p, row, 0, p.V, s_lse, s_h, cache, cache_vecs,
                     next < p.N ? reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + next * p.ld) : nullptr,
                     &hint);
    cp_async_commit();
  }
}

// Plain rows (no soft-cap, class weights, smoothing or argmax, and no entropy output unless kEnt: the usual
// training call): the same pipeline, lean, in base 2 with 32-bit indices within the row (~6 instructions per
// logit per pass: z = s x, z - m, one FMA and one ex2; measured 2 % faster than the fused form it replaced
// at 8192 x 128256 bf16 on an H200, docs/lab-notes.md). kEnt: the entropy's gradient as well (grad_entropy;
// the entropy sum in the statistics pass, EntPlain in the gradient pass).
template <class T, bool kEnt>
__global__ void __launch_bounds__(kCachedThreads, 1) row_kernel_pipe_plain(CeParams p, int64_t cache_vecs) {
  extern __shared__ uint4 cache[];
  __shared__ LsePair s_lse;
  __shared__ float s_h;
  constexpr int K = kVec<T>, kThreads = kCachedThreads;
  const int nv = int(p.V / K), cvec = int(cache_vecs);
  const float s = p.scale;
  // L2 policies: the uncached rest is read twice (keep), the second read and the cached slots once.
  const unsigned long long keep = l2_policy_evict_last(), once = l2_policy_evict_first();
  int64_t row = blockIdx.x;
  if (row >= p.N) return;
  pipe_start<T>(p, row, cache, cache_vecs);
  for (; row < p.N; row += gridDim.x) {
    const RowHints hint = row_hints<T>(p, row);
    cp_async_wait_all();  // this thread's slots (only it reads them in either pass)
    const T* x = static_cast<const T*>(p.x) + row * p.ld;
    const uint4* vp = reinterpret_cast<const uint4*>(x);
    const int64_t next = row + gridDim.x;
    // The statistics of z = s x as accumulate forms them (the shifted form: z - m exact near the max, so
    // that the row's LsePair gives every p_j to fp32 precision at any offset of the logits). The max of each
    // vector is taken on packed pairs for a 16-bit vector. kEnt: the entropy sum as well.
    CeAcc a;
    auto add_z = [&](const float (&z)[K], int n, float g) {
      if constexpr (kEnt) {
        a.add_shifted<K>(z, n, g, kLog2e, [&](float r) {  // a.d is rescaled already, a.m not yet
          a.s1 = a.m == -INFINITY ? 0.f : __fmaf_rn(__fsub_rn(a.m, g), a.d, __fmul_rn(a.s1, r));
        }, [&](int k, float e) {
          a.s1 = __fmaf_rn(e, e > 0.f ? __fsub_rn(z[k], a.m) : 0.f, a.s1);  // a select: -inf z adds 0
        });
      } else {
        a.add_shifted<K>(z, n, g, kLog2e);
      }
    };
    auto add = [&](const uint4& raw) {
      float v[K];
      unpack_words<T>(raw, v);
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = __fmul_rn(v[k], s);
      add_z(v, K, __fmul_rn(vec_max<T>(raw), s));  // max z = s max x: rounding is monotonic
    };
    for (int i = threadIdx.x; i < cvec; i += kThreads) add(cache[i]);
    for (int base = cvec + threadIdx.x; base < nv; base += 4 * kThreads) {
      uint4 raw[4];
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (base + u * kThreads < nv) raw[u] = ld_hint_nc(vp + base + u * kThreads, keep);  // read again
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (base + u * kThreads < nv) add(raw[u]);
    }
    for (int64_t j = int64_t(nv) * K + threadIdx.x; j < p.V; j += kThreads) {
      float z[K];
#pragma unroll
      for (int k = 0; k < K; ++k) z[k] = -INFINITY;
      z[0] = __fmul_rn(to_float(x[j]), s);
      add_z(z, 1, z[0]);
    }
    a = finish_stats<T>(p, x, 0, p.V, a);
    if (threadIdx.x == 0) s_lse = write_row_outputs<T>(p, row, a, &hint, &s_h);
    __syncthreads();
    if (next < p.N) prefetch_rest<T>(p, next, cache_vecs);
    // dz_j = s [g (1 + 2 zq lse) p_j - g [j == t]]; a whole row of `fill` when the row has no gradient.
    const LsePair lse = s_lse;
    const int64_t t = hint.t;
    const bool bad = t != p.ignore_index && (t < 0 || t >= p.V);
    const bool lg = !bad && t != p.ignore_index && hint.g != 0.f;  // the loss has a gradient here
    const float ge = kEnt ? p.grad_entropy[p.ge_scalar ? 0 : row] : 0.f;
    const bool none = bad || (!lg && ge == 0.f);
    const float fill = bad ? NAN : 0.f;
    CeGrad cg(lg ? hint.g : 0.f, 0.f, 1.f, float(p.V), p.inv_v, p.zq, lse.value());
    if constexpr (kEnt) cg.entropy(ge, s_h);
    const float ga = p.scale * cg.cp, gt = p.scale * cg.ct, hi = lse.hi, nlo2 = -lse.lo * kLog2e;
    const EntPlain ep(p.scale, lse, cg);
    const int tl = lg ? int(t) : -1;
    T* dx = static_cast<T*>(p.dx) + row * p.ldd;
    uint4* dv = reinterpret_cast<uint4*>(dx);
    auto grad_vec = [&](const uint4& raw, int e0) {
      float v[K];
      unpack_words<T>(raw, v);
      if (kEnt && ge != 0.f && !none) {  // the entropy's term (EntPlain, target included)
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] = ep(v[k], e0 + k == tl);
        return pack<T>(v);
      }
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = none ? fill : ga * pair_exp(__fmul_rn(v[k], s), hi, nlo2);
      const unsigned kt = unsigned(tl - e0);  // the target's place in this vector, if it is here
      if (kt < unsigned(K)) {
#pragma unroll
        for (int k = 0; k < K; ++k)
          if (k == int(kt)) v[k] -= gt;
      }
      return pack<T>(v);
    };
    const uint4* nsrc = next < p.N ? reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + next * p.ld) : nullptr;
    for (int i = threadIdx.x; i < cvec; i += kThreads) {
      store_stream(dv + i, grad_vec(cache[i], i * K));
      if (nsrc) cp_async16_first(cache + i, nsrc + i, once);
    }
    for (int base = cvec + threadIdx.x; base < nv; base += 2 * kThreads) {
      uint4 raw[2];
#pragma unroll
      for (int u = 0; u < 2; ++u)
        if (base + u * kThreads < nv) raw[u] = ld_hint(vp + base + u * kThreads, once);  // in place allowed
#pragma unroll
      for (int u = 0; u < 2; ++u)
        if (base + u * kThreads < nv) store_stream(dv + base + u * kThreads, grad_vec(raw[u], (base + u * kThreads) * K));
    }
    for (int64_t j = int64_t(nv) * K + threadIdx.x; j < p.V; j += kThreads) {
      const float v = to_float(x[j]);
      dx[j] = from_float<T>(none                         ? fill
                            : kEnt && ge != 0.f          ? ep(v, j == tl)
                                                         : ga * pair_exp(__fmul_rn(v, s), hi, nlo2) - (j == tl ? gt : 0.f));
    }
    cp_async_commit();
  }
}

}  // namespace
}  // namespace fce::cuda
