// The online-softmax state shared by cross-entropy, logsumexp, temperature softmax and KD (Milakov &
// Gimelshein 2018, "Online normalizer calculation for softmax"): a running max m and d = sum 2^((u - m) k)
// over the values u seen, in base 2 (one SFU ex2 per element). k is the op's factor: log2(e) for
// cross-entropy's transformed logits, scale * log2(e) / T on raw logits.
//
// Two forms of the element term, each where its property matters:
//  - shifted (add_shifted): u and m in the same units, term 2^((u - m) k). The max element adds exactly 1,
//    so a lone logit gives lse = z exactly. Cross-entropy's statistics, the few-row kernels, softmax.
//  - fused (add_fused): m held in units of x c, term 2^(fma(x, c, -m)) with the product x c unrounded (no
//    error that grows with an offset of the logits), every step explicitly rounded so that two equal rows
//    give bitwise-equal states in any context. KD, cross-entropy's pipelined gradient pass. Merges take k = 1.
//
// The merges (pairwise here, warp and block below, the cluster exchange in few_rows.cuh) are the same for
// both forms and run in a fixed order. A part that saw nothing finite has m = -inf and d = 0, or d = NaN if
// it saw a NaN; a NaN d survives every merge; +inf values make d NaN in the element terms, and a merge at
// m = +inf keeps only the +inf parts (no inf - inf).
#pragma once
#include <cmath>

namespace fce::cuda {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 2^x by the SFU (relative error ~2^-22; results below 2^-126 flush to 0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fexp(float x) { return ex2(x * kLog2e); }

struct OnlineSoftmax {
  float m, d;
  __device__ OnlineSoftmax() : m(-INFINITY), d(0.f) {}
  __device__ OnlineSoftmax(float m_, float d_) : m(m_), d(d_) {}

  // The factor that brings a sum at max m to max mn >= m: 2^((m - mn) k), exactly 1 when m == mn.
  __device__ static float rescale(float m, float mn, float k) {
    return m == mn ? 1.f : ex2(__fmul_rn(__fsub_rn(m, mn), k));
  }
  __device__ static float rescale(float m, float mn) { return m == mn ? 1.f : ex2(__fsub_rn(m, mn)); }

  // Factors the two parts of a merge were scaled by, for the sums a caller keeps beside d (cross-entropy's
  // entropy sum, KD's W): a for this part, b for the other.
  struct Factors {
    float a, b;
  };
  // This part, then o (a fixed order).
  __device__ Factors merge(const OnlineSoftmax& o, float k) {
    const float mn = fmaxf(m, o.m);
    Factors f{1.f, 1.f};
    if (mn == INFINITY) {  // only the +inf parts count
      f.a = m == mn ? 1.f : 0.f;
      f.b = o.m == mn ? 1.f : 0.f;
      d = __fadd_rn(m == mn ? d : 0.f, o.m == mn ? o.d : 0.f);
    } else if (mn == -INFINITY) {  // nothing finite on either side: a NaN survives
      d = __fadd_rn(d, o.d);
    } else {
      f.a = rescale(m, mn, k);
      f.b = rescale(o.m, mn, k);
      d = __fadd_rn(__fmul_rn(d, f.a), __fmul_rn(o.d, f.b));
    }
    m = mn;
    return f;
  }

  // block_reduce's merge (common.cuh), for fused-form states only: their merges take k = 1.
  __device__ void merge(const OnlineSoftmax& o) { merge(o, 1.f); }

  // Shifted form: n values u (the op's units) whose max is g. on_shift(r) sees the factor the earlier sum
  // was rescaled by (only when g raises the max) before the values are added; on_e(i, e) sees each term
  // e = 2^((u_i - m) k). A +inf value makes d NaN by its own term.
  template <int G, class S, class F>
  __device__ __forceinline__ void add_shifted(const float (&u)[G], int n, float g, float k, S&& on_shift, F&& on_e) {
    const float mn = fmaxf(m, g);
    if (mn == -INFINITY) {  // nothing finite yet: only a NaN matters (keeps NaN out of -inf - -inf)
#pragma unroll
      for (int i = 0; i < G; ++i)
        if (i < n && isnan(u[i])) d = NAN;
      return;
    }
    if (mn > m) {  // a new max: one rescale (none for the many groups that do not raise it)
      const float r = ex2((m - mn) * k);
      d *= r;
      on_shift(r);
      m = mn;
    }
#pragma unroll
    for (int i = 0; i < G; ++i) {
      if (i < n) {
        const float e = ex2((u[i] - mn) * k);
        d += e;
        on_e(i, e);
      }
    }
  }
  template <int G>
  __device__ __forceinline__ void add_shifted(const float (&u)[G], int n, float g, float k) {
    add_shifted<G>(u, n, g, k, [](float) {}, [](int, float) {});
  }

  // Fused form: n raw values x whose raw max is g, with c > 0 (max(x c) = (max x) c: rounding is monotonic).
  // on_shift and on_e as for add_shifted, e = 2^(fma(x_i, c, -m)).
  template <class S, class F>
  __device__ __forceinline__ void add_fused(const float* x, int n, float g, float c, S&& on_shift, F&& on_e) {
    const float mn = fmaxf(m, __fmul_rn(g, c));
    if (mn == -INFINITY) {
      for (int i = 0; i < n; ++i)
        if (isnan(x[i])) d = NAN;
      return;
    }
    const float r = rescale(m, mn);
    d = __fmul_rn(d, r);
    on_shift(r);
    m = mn;
    for (int i = 0; i < n; ++i) {
      const float e = ex2(__fmaf_rn(x[i], c, -mn));
      d = __fadd_rn(d, e);
      on_e(i, e);
    }
  }
  __device__ __forceinline__ void add_fused(const float* x, int n, float g, float c) {
    add_fused(x, n, g, c, [](float) {}, [](int, float) {});
  }
  // The same with the group's max taken here.
  template <int G, class S, class F>
  __device__ __forceinline__ void add_fused_group(const float (&x)[G], int n, float c, S&& on_shift, F&& on_e) {
    float g = -INFINITY;
#pragma unroll
    for (int i = 0; i < G; ++i)
      if (i < n) g = fmaxf(g, x[i]);
    add_fused(x, n, g, c, on_shift, on_e);
  }
  template <int G>
  __device__ __forceinline__ void add_fused_group(const float (&x)[G], int n, float c) {
    add_fused_group<G>(x, n, c, [](float) {}, [](int, float) {});
  }

  __device__ OnlineSoftmax shfl_down(unsigned off) const {
    return {__shfl_down_sync(0xffffffffu, m, off), __shfl_down_sync(0xffffffffu, d, off)};
  }
};

// A part's sum at the max M >= v.m: a NaN d survives (NaN * 0), -inf parts add 0.
__device__ __forceinline__ float sum_at(OnlineSoftmax v, float M, float k) {
  return v.m == M ? v.d : v.d * ex2((v.m - M) * k);
}

// Warp max in every lane of partial maxima, which are never NaN (fmaxf drops NaNs; the sums carry them): one
// redux on integer keys ordered as the floats (sm_80 and later) instead of five shuffles. Exact either way.
__device__ __forceinline__ float warp_max_all(float m) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  int key = __float_as_int(m);
  key ^= (key >> 31) & 0x7fffffff;  // sign-magnitude to two's complement order
  key = __reduce_max_sync(0xffffffffu, key);
  return __int_as_float(key ^ ((key >> 31) & 0x7fffffff));
#else
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  return m;
#endif
}

// Lanes in a group of a warp merge: the next power of two >= n (n <= 32 partials). Lane l takes partial
// l % group, so every group holds all of them and the butterfly needs log2(group) steps; the dropped steps
// would only add zeros, so the sums are bitwise those of five steps.
__device__ __forceinline__ int merge_group(int n) { return n <= 1 ? 1 : 1 << (32 - __clz(n - 1)); }

// Warp merge, the result bitwise the same in every lane: the max first (exact), then each lane's d rescaled
// once to it and summed by a butterfly (commutative adds) over groups of `group` lanes that each hold every
// partial. Half the latency of five pairwise merges, whose exponentials sit on the chain.
__device__ __forceinline__ OnlineSoftmax warp_merge_all(OnlineSoftmax v, float k, int group = 32) {
  const float M = warp_max_all(v.m);
  float d = sum_at(v, M, k);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1)
    if (o < group) d += __shfl_xor_sync(0xffffffffu, d, o);
  return {M, d};
}

// Block merge of the threads' parts in a fixed order, in every thread (one __syncthreads), or in warp 0
// only (kWarp0Only: the other warps get their warp's part; a caller that needs the result in one thread
// lets them leave, so that they take no issue slots from warp 0's merge and exchange).
template <bool kWarp0Only = false>
__device__ __forceinline__ OnlineSoftmax block_merge_all(OnlineSoftmax v, float k) {
  __shared__ float2 sh[32];
  v = warp_merge_all(v, k);
  const int lane = threadIdx.x & 31;
  if (lane == 0) sh[threadIdx.x >> 5] = make_float2(v.m, v.d);
  __syncthreads();
  if (kWarp0Only && threadIdx.x >= 32) return v;
  const int nw = int(blockDim.x) >> 5, g = merge_group(nw), i = lane & (g - 1);
  const float2 w = i < nw ? sh[i] : make_float2(-INFINITY, 0.f);
  return warp_merge_all({w.x, w.y}, k, g);
}

}  // namespace
}  // namespace fce::cuda
