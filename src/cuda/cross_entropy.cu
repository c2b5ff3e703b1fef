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
#include "cuda/common.cuh"
#include "cuda/row_plan.cuh"

#include <type_traits>

namespace fce::cuda {
namespace {

// Per-thread statistics of a row slice: online softmax (m, d), sum of e^(z-m)*z for the entropy,
// the plain sum of w_j*z_j for label smoothing, and the raw-logit argmax.
struct CeAcc {
  float m, d, s1, swz, av;
  int64_t ai;
  __device__ CeAcc() : m(-INFINITY), d(0.f), s1(0.f), swz(0.f), av(-INFINITY), ai(INT64_MAX) {}
  // NaN counts as the largest value; ties go to the lowest index.
  __device__ static bool better(float v, int64_t j, float av, int64_t ai) {
    const bool vn = isnan(v), an = isnan(av);
    if (vn != an) return vn;
    if (v == av || (vn && an)) return j < ai;
    return v > av;
  }
  __device__ void merge(const CeAcc& o) {
    const float mn = fmaxf(m, o.m);
    if (mn == INFINITY) {  // +inf logits (logsumexp): only the +inf parts count, no inf - inf
      d = (m == mn ? d : 0.f) + (o.m == mn ? o.d : 0.f);
      s1 = 0.f;
    } else if (mn != -INFINITY) {
      const float a = expf(m - mn), b = expf(o.m - mn);
      d = d * a + o.d * b;
      s1 = s1 * a + o.s1 * b;
    } else {
      d += o.d;
      s1 += o.s1;
    }
    m = mn;
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
  // outputs (row losses go to the workspace when reduced)
  float *loss_rows, *zl_rows, *lse, *entropy;
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
  float* row_lse;  // lse for the gradient kernel
  const float* saved_lse;
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
  row_visit<T, FCE_ROW_UNROLL, kFromCache>(row, begin, end, [&](float (&v)[kVec<T>], int64_t j0, int n) {
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
    const float zmax = tf(vmax);
    const float mn = fmaxf(a.m, zmax);
    if (mn == -INFINITY) {  // nothing finite yet: only a NaN matters (keeps NaN out of -inf - -inf)
#pragma unroll
      for (int k = 0; k < kVec<T>; ++k)
        if (k < n && isnan(v[k])) a.d = NAN;
      return;
    }
    const float r = ex2((a.m - mn) * kLog2e);
    a.d *= r;
    if (kEntropy) a.s1 *= r;
    a.m = mn;
#pragma unroll
    for (int k = 0; k < kVec<T>; ++k) {
      if (k < n) {
        // z - max is exact 0 at the maximum, so a single logit gives d = 1 and lse = z exactly.
        const float z = kSoftcap ? tf(v[k]) : v[k] * p.scale;
        const float e = ex2((z - mn) * kLog2e);
        a.d += e;
        if (kEntropy && e > 0.f) a.s1 += e * z;
        if (kSmooth && p.eps > 0.f) a.swz += (p.weights ? p.weights[j0 + k] : 1.f) * z;
      }
    }
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
  const bool sc = p.softcap > 0.f, extra = p.full && (p.entropy || p.eps > 0.f);
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

// Writes row outputs from the merged statistics (one thread); returns the row's lse.
template <class T>
__device__ float write_row_outputs(const CeParams& p, int64_t row, const CeAcc& a, const RowHints* hint = nullptr) {
  const float lse = a.m == -INFINITY ? -INFINITY : a.m + logf(a.d);
  if (!p.full) {  // logsumexp: a NaN anywhere in the row (finish_stats marks it in av) wins over +-inf
    p.lse[row] = isnan(a.av) ? NAN : lse;
    return lse;
  }
  if (p.lse) p.lse[row] = lse;
  if (p.entropy) p.entropy[row] = a.m == -INFINITY ? NAN : lse - a.s1 / a.d;
  if (p.argmax) {
    const int64_t ai = a.ai == INT64_MAX ? 0 : a.ai;  // a row of all -inf: index 0, as on the CPU
    if (p.a64) static_cast<int64_t*>(p.argmax)[row] = ai;
    else static_cast<int32_t*>(p.argmax)[row] = int32_t(ai);
  }
  const int64_t t = hint ? hint->t : load_index(p.targets, p.t64, row);
  float loss = 0.f, zl = 0.f;
  if (t != p.ignore_index) {
    if (t < 0 || t >= p.V) {
      loss = zl = NAN;
    } else {
      const LogitTransform tf(p.scale, p.softcap);
      const T* x = static_cast<const T*>(p.x) + row * p.ld;
      const float zt = tf(hint ? hint->xt : to_float(x[t]));
      const float wt = p.weights ? p.weights[t] : 1.f;
      zl = p.zq * lse * lse;
      loss = (1.f - p.eps) * wt * (lse - zt) + zl;
      if (p.eps > 0.f) {  // prep holds the class weights' sum only when smoothing needs it
        const float W = p.weights ? float(p.prep[1]) : float(p.V);
        loss += p.eps * p.inv_v * (lse * W - a.swz);
      }
    }
  }
  p.loss_rows[row] = loss;
  if (p.zl_rows) p.zl_rows[row] = zl;
  return lse;
}

// dlogits for row slice [begin, end), formed in fp32 and rounded once to O.
// With `next`, the cached slots are refilled with the next row as they are used (row_map).
template <class T, class O>
__device__ void write_grad(const CeParams& p, int64_t row, int64_t begin, int64_t end, float lse,
                           uint4* cache = nullptr, int64_t cache_vecs = 0, const uint4* next = nullptr,
                           const RowHints* hint = nullptr) {
  const T* x = static_cast<const T*>(p.x) + row * p.ld;
  O* dx = static_cast<O*>(p.dx) + row * p.ldd;
  const int64_t t = hint ? hint->t : load_index(p.targets, p.t64, row);
  const float g = hint ? hint->g : row_grad_scale(p, row);
  const LogitTransform tf(p.scale, p.softcap);
  if (t == p.ignore_index || g == 0.f || t < 0 || t >= p.V) {
    const float fill = (t != p.ignore_index && (t < 0 || t >= p.V)) ? NAN : 0.f;  // out of range: NaN always
    row_map<T, O>(x, dx, begin, end, [&](float (&v)[kVec<T>], int64_t, int n) {
#pragma unroll
      for (int k = 0; k < kVec<T>; ++k) v[k] = fill;
    }, cache, cache_vecs, next);
    return;
  }
  const float W = p.weights ? float(p.prep[1]) : float(p.V);
  const CeGrad grad(g, p.eps, p.weights ? p.weights[t] : 1.f, W, p.inv_v, p.zq, lse);
  if (p.softcap == 0.f && !p.weights) {
    // Common case: z = s*x, dz/dx = s, w = 1. Per element one FMA, one ex2, one FMA.
    const float s = p.scale, a = p.scale * grad.cp, b = -p.scale * grad.cw, at = p.scale * grad.ct;
    row_map<T, O>(x, dx, begin, end, [&](float (&v)[kVec<T>], int64_t j0, int n) {
      const int64_t kt = t - j0;  // the target's position in this vector, if any
#pragma unroll
      for (int k = 0; k < kVec<T>; ++k) {
        if (k < n) v[k] = fmaf(a, ex2((v[k] * s - lse) * kLog2e), b) - (k == kt ? at : 0.f);
      }
    }, cache, cache_vecs, next);
    return;
  }
  row_map<T, O>(x, dx, begin, end, [&](float (&v)[kVec<T>], int64_t j0, int n) {
#pragma unroll
    for (int k = 0; k < kVec<T>; ++k) {
      if (k < n) {
        const float z = tf(v[k]);
        const float w = p.weights ? p.weights[j0 + k] : 1.f;
        v[k] = grad(ex2((z - lse) * kLog2e), w, j0 + k == t) * tf.derivative(z);
      }
    }
  }, cache, cache_vecs, next);
}

// One block per row: statistics, outputs, and the gradient.
template <class T, class O>
__global__ void __launch_bounds__(kRowThreads) row_kernel(CeParams p) {
  __shared__ float s_lse;
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.ld;
  const CeAcc a = row_stats<T>(p, x, 0, p.V);
  if (threadIdx.x == 0) s_lse = write_row_outputs<T>(p, row, a);
  if (!p.dx) return;
  __syncthreads();
  write_grad<T, O>(p, row, 0, p.V, s_lse);
}

// Forward with the fused gradient, one block per SM: the first part of the row stays in shared memory
// between the statistics and the gradient pass, the rest is re-read while still in L2. One read and one
// write of the row from device memory.
#ifndef FCE_CACHED_THREADS
#define FCE_CACHED_THREADS 1024
#endif
#ifndef FCE_CACHED_BLOCKS
#define FCE_CACHED_BLOCKS 1  // blocks per SM, each caching 1/FCE_CACHED_BLOCKS of the shared memory
#endif
constexpr int kCachedThreads = FCE_CACHED_THREADS, kCachedBlocks = FCE_CACHED_BLOCKS;
template <class T, class O>
__global__ void __launch_bounds__(kCachedThreads, kCachedBlocks) row_kernel_cached(CeParams p, int64_t cache_vecs) {
  extern __shared__ uint4 cache[];
  __shared__ float s_lse;
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(p.x) + row * p.ld;
  const CeAcc a = row_stats<T>(p, x, 0, p.V, cache, cache_vecs);
  if (threadIdx.x == 0) s_lse = write_row_outputs<T>(p, row, a);
  __syncthreads();
  write_grad<T, O>(p, row, 0, p.V, s_lse, cache, cache_vecs);
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
  __shared__ float s_lse;
  int64_t row = blockIdx.x;
  if (row >= p.N) return;
  pipe_start<T>(p, row, cache, cache_vecs);
  for (; row < p.N; row += gridDim.x) {
    const RowHints hint = row_hints<T>(p, row);
    cp_async_wait_all();  // this thread's slots (only it reads them in either pass)
    const T* x = static_cast<const T*>(p.x) + row * p.ld;
    const int64_t next = row + gridDim.x;
    const CeAcc a = row_stats<T, true>(p, x, 0, p.V, cache, cache_vecs);
    if (threadIdx.x == 0) s_lse = write_row_outputs<T>(p, row, a, &hint);
    __syncthreads();
    if (next < p.N) prefetch_rest<T>(p, next, cache_vecs);
    write_grad<T, T>(p, row, 0, p.V, s_lse, cache, cache_vecs,
                     next < p.N ? reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + next * p.ld) : nullptr,
                     &hint);
    cp_async_commit();
  }
}

// Plain rows (no soft-cap, class weights, smoothing, entropy or argmax: the usual training call): the same
// pipeline, lean, in base 2 with 32-bit indices within the row (~4 instructions per logit per pass).
template <class T>
__global__ void __launch_bounds__(kCachedThreads, 1) row_kernel_pipe_plain(CeParams p, int64_t cache_vecs) {
  extern __shared__ uint4 cache[];
  __shared__ float s_lse;
  constexpr int K = kVec<T>, kThreads = kCachedThreads;
  const int nv = int(p.V / K), cvec = int(cache_vecs);
  const float sl = p.scale * kLog2e;
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
    float m2 = -INFINITY, d = 0.f;  // max of x s log2(e), sum of 2^(x s log2(e) - m2)
    // vm: the max of the n values v (computed by the caller on packed pairs for a 16-bit vector).
    auto add_max = [&](const float* v, int n, float vm) {
      const float mn = fmaxf(m2, vm * sl);
      if (mn == -INFINITY) {  // nothing finite yet: only a NaN matters
        for (int k = 0; k < n; ++k)
          if (isnan(v[k])) d = NAN;
        return;
      }
      d *= ex2(m2 - mn);
      m2 = mn;
      for (int k = 0; k < n; ++k) d += ex2(fmaf(v[k], sl, -mn));
    };
    auto add = [&](const uint4& raw) {
      float v[K];
      unpack_words<T>(raw, v);
      add_max(v, K, vec_max<T>(raw));
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
      const float v = to_float(x[j]);
      add_max(&v, 1, v);
    }
    CeAcc a;
    a.m = m2 * (1.f / kLog2e);
    a.d = d;
    a = finish_stats<T>(p, x, 0, p.V, a);
    if (threadIdx.x == 0) s_lse = write_row_outputs<T>(p, row, a, &hint);
    __syncthreads();
    if (next < p.N) prefetch_rest<T>(p, next, cache_vecs);
    // dz_j = s [g (1 + 2 zq lse) p_j - g [j == t]]; a whole row of `fill` when the row has no gradient.
    const float lse = s_lse;
    const int64_t t = hint.t;
    const bool none = t == p.ignore_index || hint.g == 0.f || t < 0 || t >= p.V;
    const float fill = (t != p.ignore_index && (t < 0 || t >= p.V)) ? NAN : 0.f;
    const CeGrad cg(hint.g, 0.f, 1.f, float(p.V), p.inv_v, p.zq, lse);
    const float ga = p.scale * cg.cp, gt = p.scale * cg.ct, nl = -lse * kLog2e;
    const int tl = none ? -1 : int(t);
    T* dx = static_cast<T*>(p.dx) + row * p.ldd;
    uint4* dv = reinterpret_cast<uint4*>(dx);
    auto grad_vec = [&](const uint4& raw, int e0) {
      float v[K];
      unpack_words<T>(raw, v);
#pragma unroll
      for (int k = 0; k < K; ++k) v[k] = none ? fill : ga * ex2(fmaf(v[k], sl, nl));
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
      dx[j] = from_float<T>(none ? fill : ga * ex2(fmaf(v, sl, nl)) - (j == tl ? gt : 0.f));
    }
    cp_async_commit();
  }
}

// Split rows, phase 1: statistics of split blockIdx.x of row blockIdx.y.
template <class T>
__global__ void __launch_bounds__(kRowThreads) partial_kernel(CeParams p) {
  const int64_t row = blockIdx.y;
  int64_t b, e;
  split_range(p.V, p.splits, blockIdx.x, &b, &e);
  const T* x = static_cast<const T*>(p.x) + row * p.ld;
  allow_dependents();  // the merge kernel may start its launch (it waits for this grid's writes)
  const CeAcc a = row_stats<T>(p, x, b, e);
  if (threadIdx.x == 0) p.partial[row * p.splits + blockIdx.x] = a;
}

// Split rows, phase 2: merge the splits of each row in order and write its outputs.
template <class T>
__global__ void merge_kernel(CeParams p) {
  wait_prior_grid();   // launched as a programmatic dependent of partial_kernel where the device allows
  allow_dependents();  // the cross-entropy finalize kernel may start its launch
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= p.N) return;
  CeAcc a = p.partial[row * p.splits];
  for (int k = 1; k < p.splits; ++k) a.merge(p.partial[row * p.splits + k]);
  const float lse = write_row_outputs<T>(p, row, a);
  if (p.row_lse) p.row_lse[row] = lse;
}

// The merge as a programmatic dependent of partial_kernel (sm_90 code on an sm_90 device): its launch
// overlaps the partials (faster; measured in docs/lab-notes.md, "Kernel choices").
template <class T>
void launch_merge(cudaStream_t s, const CeParams& k, bool dependent) {
  launch_ex(merge_kernel<T>, dim3(unsigned((k.N + 127) / 128)), dim3(128), 0, s, 0, dependent, "merge kernel", k);
}

// A CeAcc as two 16-byte words for the cluster exchange (no padding bytes on the wire).
struct CeWire {
  uint4 a, b;
};
__device__ __forceinline__ CeWire to_wire(const CeAcc& v) {
  const unsigned long long ai = static_cast<unsigned long long>(v.ai);
  return {make_uint4(__float_as_uint(v.m), __float_as_uint(v.d), __float_as_uint(v.s1), __float_as_uint(v.swz)),
          make_uint4(__float_as_uint(v.av), 0u, unsigned(ai), unsigned(ai >> 32))};
}
__device__ __forceinline__ CeAcc from_wire(const CeWire& w) {
  CeAcc v;
  v.m = __uint_as_float(w.a.x);
  v.d = __uint_as_float(w.a.y);
  v.s1 = __uint_as_float(w.a.z);
  v.swz = __uint_as_float(w.a.w);
  v.av = __uint_as_float(w.b.x);
  v.ai = static_cast<int64_t>(static_cast<unsigned long long>(w.b.z) | static_cast<unsigned long long>(w.b.w) << 32);
  return v;
}

// Split rows in one launch: the splits of a row (2..kMaxGatherCluster) form a cluster; each block's
// statistics (partial_kernel's slices) go to rank 0's shared memory, and rank 0 merges them in split order,
// as merge_kernel does, and writes the row's outputs: no second launch, no partials through device memory.
// Faster than partial + merge (docs/lab-notes.md, "Kernel choices"). At most 64 registers, as partial_kernel
// (4 blocks per SM): at 80, 2x256 rows no longer fit in one wave. Not a programmatic dependent launch,
// unlike the register kernels: it lets its own dependents launch at once, so back to back each launch's
// blocks would be placed while the one before still ran (slower).
template <class T>
__global__ void __launch_bounds__(kRowThreads, 4) split_cluster_kernel(CeParams p) {
  const int C = p.splits;
  const int rank = cluster_rank_of(C);  // == blockIdx.x: the cluster spans gridDim.x
  few_arrive<false>(C, sizeof(CeWire));
  allow_dependents();  // a finalize or gradient kernel may start its launch
  const int64_t row = blockIdx.y;
  int64_t b, e;
  split_range(p.V, C, rank, &b, &e);
  const T* x = static_cast<const T*>(p.x) + row * p.ld;
  const CeAcc a = row_stats<T>(p, x, b, e);
  if (threadIdx.x >= 32) return;
  const CeWire* slot = few_gather_rank0(to_wire(a), C, rank);
  if (rank != 0 || threadIdx.x != 0) return;
  CeAcc m = from_wire(slot[0]);
  for (int k = 1; k < C; ++k) m.merge(from_wire(slot[k]));
  const float lse = write_row_outputs<T>(p, row, m);
  if (p.row_lse) p.row_lse[row] = lse;
}

// Launches the split rows' statistics and outputs: one cluster launch (`cluster`: the plan's split_cluster
// path), else partial_kernel then merge_kernel (split_phased).
template <class T>
void launch_split_rows(const fce_handle* h, cudaStream_t s, const CeParams& k, bool cluster) {
  if (cluster) {
    launch_ex(split_cluster_kernel<T>, dim3(unsigned(k.splits), unsigned(k.N)), dim3(kRowThreads), 0, s, k.splits,
              false, "split rows kernel", k);
    return;
  }
  partial_kernel<T><<<dim3(unsigned(k.splits), unsigned(k.N)), kRowThreads, 0, s>>>(k);
  launch_merge<T>(s, k, h->caps.clusters);
}

// Split rows (and the backward), phase 3: gradient of split blockIdx.x of row blockIdx.y.
template <class T, class O>
__global__ void __launch_bounds__(kRowThreads) grad_kernel(CeParams p) {
  const int64_t row = blockIdx.y;
  int64_t b, e;
  split_range(p.V, p.splits, blockIdx.x, &b, &e);
  write_grad<T, O>(p, row, b, e, p.saved_lse ? p.saved_lse[row] : p.row_lse[row]);
}

// Few rows of logsumexp in one launch: C blocks per row (a cluster of up to 16), each holding its slice in
// registers; the blocks' (max, sum) partials are pushed to rank 0, which merges them in a fixed order
// (few_merge) and writes the row's logsumexp. kCe: the row's cross-entropy outputs instead (loss, z-loss,
// lse; no soft-cap, label smoothing, entropy or argmax: ce_regs_ok), rank 0's thread 0 loading the target
// and its logit while the slice's loads are in flight.
template <class T, int R, bool kCe = false>
__global__ void __launch_bounds__(1024) lse_regs_kernel(CeParams p) {
  const FewCtx f = few_ctx(p.V, p.splits, p.chunk);
  wait_prior_grid();  // a programmatic dependent launch: its launch overlaps the end of the kernel before
  const T* x = static_cast<const T*>(p.x) + f.row * p.ld + f.begin;
  uint4 raw[R];
  reg_load_lean<T, R>(x, f.n, raw);
  // The cluster's barrier arrival after the loads are issued, so that nothing but the addresses precedes
  // them.
  few_arrive<false>(p.splits);
  if constexpr (kCe) allow_dependents();  // the finalize kernel of a reduction may start its launch
  RowHints hint{};
  if constexpr (kCe) {
    if (f.rank == 0 && threadIdx.x == 0) {
      hint.t = load_index(p.targets, p.t64, f.row);
      hint.xt = hint.t >= 0 && hint.t < p.V ? to_float(static_cast<const T*>(p.x)[f.row * p.ld + hint.t]) : NAN;
    }
  }
  const float c = p.scale * kLog2e;  // the raw max first, then the scale (scale > 0)
  // Only warp 0 goes on to the exchange (a little faster); the others leave once the block merge has their
  // partials.
  const MaxSum part = few_partial<T, R, false, true>(raw, f.n, c);
  if (threadIdx.x >= 32 && p.splits > 1) return;
  const FewStats t = few_merge<false>(part, c, p.splits, f.rank);  // rank 0 writes the result
  if (f.rank != 0 || threadIdx.x != 0) return;
  if constexpr (kCe) {
    // The statistics in the scaled logits' units; a +inf scaled max (a +inf logit, or one that overflows
    // with the scale) makes the row NaN, as in accumulate (inf - inf inside the log-sum-exp).
    CeAcc a;
    a.m = t.nan ? NAN : t.m * p.scale;
    a.d = t.nan || a.m == INFINITY ? NAN : t.d;
    write_row_outputs<T>(p, f.row, a, &hint);
  } else {
    p.lse[f.row] = t.nan                ? NAN
                   : t.m == INFINITY     ? INFINITY
                   : t.m == -INFINITY    ? -INFINITY
                                         : (t.m * c + log2f(t.d)) * kLn2;
  }
}

// The register-resident cross-entropy forward covers these options (the others need per-element work or
// outputs that the (max, sum) merge does not carry).
bool ce_regs_ok(const CeParams& k) {
  return !k.dx && !k.saved_lse && k.softcap == 0.f && k.eps == 0.f && !k.entropy && !k.argmax;
}

// The kernels of the register path (for the planner's occupancy questions).
template <class T, bool kCe>
RegKernels lse_regs_kernels(fce_handle* h) {
  return RegKernels(h, reinterpret_cast<const void*>(lse_regs_kernel<T, 1, kCe>),
                    reinterpret_cast<const void*>(lse_regs_kernel<T, 2, kCe>),
                    reinterpret_cast<const void*>(lse_regs_kernel<T, 4, kCe>));
}

// Launches lse_regs_kernel for N rows with register plan `rp`: logsumexp, or (kCe) the cross-entropy
// forward.
template <class T, bool kCe>
void launch_lse_regs(fce_handle* h, cudaStream_t s, CeParams k, const RegPlan& rp) {
  k.splits = rp.C;
  k.chunk = int(slice_cols(k.V, rp.C));
  const bool dependent = h->caps.clusters;  // sm_90 code on an sm_90 device
  dispatch_regs(rp.R, [&](auto r) {
    launch_rows(lse_regs_kernel<T, decltype(r)::value, kCe>, as_row_plan(rp), k.N, k, s,
                kCe ? "cross-entropy kernel" : "logsumexp kernel", dependent);
  });
}

struct SumD {
  double s = 0;
  __device__ SumD() {}
  __device__ explicit SumD(double x) : s(x) {}
  __device__ SumD shfl_down(unsigned off) const { return SumD(__shfl_down_sync(0xffffffffu, s, off)); }
  __device__ void merge(const SumD& o) { s += o.s; }
};

// Mean denominator: the sum of w[t] over the non-ignored rows (an out-of-range target counts 1), in a
// fixed order; every thread of the block gets it.
__device__ double mean_denominator(const CeParams& p) {
  double den = 0;
  for (int64_t i = threadIdx.x; i < p.N; i += blockDim.x) {
    const int64_t t = load_index(p.targets, p.t64, i);
    if (t != p.ignore_index) den += (t >= 0 && t < p.V) ? (p.weights ? double(p.weights[t]) : 1.0) : 1.0;
  }
  return block_reduce(SumD(den)).s;
}

// The mean denominator and the sum of class weights, in a fixed order.
__global__ void __launch_bounds__(1024) prep_kernel(CeParams p, double* prep) {  // uses targets, weights, N, V
  const double den = mean_denominator(p);
  double W = 0;
  if (p.weights)
    for (int64_t j = threadIdx.x; j < p.V; j += blockDim.x) W += p.weights[j];
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
  double s = 0, z = 0;
  for (int64_t i = threadIdx.x; i < p.N; i += blockDim.x) {
    s += p.loss_rows[i];
    if (zloss) z += p.zl_rows[i];
  }
  s = block_reduce(SumD(s)).s;
  z = block_reduce(SumD(z)).s;
  const double den = p.reduction != FCE_REDUCTION_MEAN ? 1.0 : p.prep ? p.prep[0] : mean_denominator(p);
  if (threadIdx.x == 0) {
    if (p.reduction == FCE_REDUCTION_MEAN) {
      s = den > 0 ? s / den : 0.0;
      z = den > 0 ? z / den : 0.0;
    }
    *loss = float(s);
    if (zloss) *zloss = float(z);
  }
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
  k.inv_v = 1.f / float(r.V);
  k.weights = r.o->class_weights ? reinterpret_cast<const float*>(r.o->class_weights.data) : nullptr;
  k.reduction = r.o->reduction;
  k.prep = r.prep;
  k.loss_rows = r.loss_rows;
  k.zl_rows = r.zl_rows;
  k.lse = r.lse;
  k.entropy = r.entropy;
  k.argmax = r.argmax;
  k.a64 = r.a64;
  k.dx = r.dx;
  k.ldd = r.ldd;
  k.grad_loss = r.grad_loss;
  k.grad_scalar = r.grad_scalar;
  k.saved_lse = r.saved_lse;
  return k;
}

// Split-row scratch: per-split partial statistics, and the merged lse for the gradient kernel.
struct RowsScratch {
  CeAcc* partial;
  float* row_lse;
  size_t bytes;
  RowsScratch(void* base, int64_t N, int splits, bool grad) {
    Carver c(base);
    partial = splits > 1 ? c.take<CeAcc>(size_t(N) * size_t(splits)) : nullptr;
    row_lse = splits > 1 && grad ? c.take<float>(size_t(N)) : nullptr;
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
        const bool plain = k.softcap == 0.f && !k.weights && k.eps == 0.f && !k.entropy && !k.argmax;
        auto kernel = plain ? row_kernel_pipe_plain<T> : row_kernel_pipe<T>;
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
  if (prep_first) ce_prep(s, p.o, p.targets.data, t64, p.logits.rows, p.logits.cols, ws.prep);
  CeRows r{};
  r.x = p.logits.data;
  r.xt = p.logits.dtype;
  r.ld = p.logits.ld;
  r.N = p.logits.rows;
  r.V = p.logits.cols;
  r.targets = p.targets.data;
  r.t64 = t64;
  r.o = &p.o;
  r.prep = prep_first ? ws.prep : nullptr;
  r.loss_rows = none ? reinterpret_cast<float*>(p.loss.data) : ws.row_loss;
  r.zl_rows = none ? (p.z_loss ? reinterpret_cast<float*>(p.z_loss.data) : nullptr) : ws.row_zl;
  r.lse = p.lse ? reinterpret_cast<float*>(p.lse.data) : nullptr;
  r.entropy = p.entropy ? reinterpret_cast<float*>(p.entropy.data) : nullptr;
  r.argmax = p.argmax ? p.argmax.data : nullptr;
  r.a64 = p.argmax && p.argmax.dtype == DType::I64;
  r.dx = p.dlogits ? p.dlogits.data : nullptr;
  r.dxt = p.dlogits ? p.dlogits.dtype : p.logits.dtype;
  r.ldd = p.dlogits ? p.dlogits.ld : 0;
  r.grad_loss = p.grad_loss ? reinterpret_cast<const float*>(p.grad_loss.data) : nullptr;
  r.grad_scalar = p.grad_loss && p.grad_loss.scalar;
  r.saved_lse = p.backward() ? reinterpret_cast<const float*>(p.saved_lse.data) : nullptr;
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
