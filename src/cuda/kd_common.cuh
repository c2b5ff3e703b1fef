// Knowledge-distillation device code shared by its kernels: the partials of the exchanges, the call's
// arguments (KdArgs), log-probabilities and the slice visitors.
#pragma once
#include <cooperative_groups.h>

#include <atomic>
#include <cfloat>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/row_plan.cuh"


namespace fce::cuda {
namespace {

// ==== knowledge distillation =========================================================================

constexpr int kLastPhase = 3;
// Threads per block of the row kernels: a resident bf16 row pair takes 64 KiB of shared memory per block,
// so 3 blocks share an SM, and 3 x 256 threads leave each ~80 registers (64 made the compiler reload
// kernel parameters inside the hot loops).
constexpr int kKdThreads = 256;

struct Max2 {  // raw maxima of student (a) and teacher (b)
  float a, b;
  __device__ Max2() : a(-INFINITY), b(-INFINITY) {}
  __device__ void merge(const Max2& o) {
    a = fmaxf(a, o.a);
    b = fmaxf(b, o.b);
  }
  __device__ Max2 shfl_down(unsigned off) const {
    Max2 r;
    r.a = __shfl_down_sync(0xffffffffu, a, off);
    r.b = __shfl_down_sync(0xffffffffu, b, off);
    return r;
  }
};

struct Sum2 {  // sums of exp(z - max z) of student (a) and teacher (b)
  float a, b;
  __device__ Sum2() : a(0.f), b(0.f) {}
  __device__ void merge(const Sum2& o) {
    a += o.a;
    b += o.b;
  }
  __device__ Sum2 shfl_down(unsigned off) const {
    Sum2 r;
    r.a = __shfl_down_sync(0xffffffffu, a, off);
    r.b = __shfl_down_sync(0xffffffffu, b, off);
    return r;
  }
};

struct LossA {  // sum of the divergence terms and A = sum_j a_j
  float loss, A;
  __device__ LossA() : loss(0.f), A(0.f) {}
  __device__ void merge(const LossA& o) {
    loss += o.loss;
    A += o.A;
  }
  __device__ LossA shfl_down(unsigned off) const {
    LossA r;
    r.loss = __shfl_down_sync(0xffffffffu, loss, off);
    r.A = __shfl_down_sync(0xffffffffu, A, off);
    return r;
  }
};

struct SumL {
  long long s;
  __device__ SumL() : s(0) {}
  __device__ explicit SumL(long long x) : s(x) {}
  __device__ void merge(const SumL& o) { s += o.s; }
  __device__ SumL shfl_down(unsigned off) const { return SumL(__shfl_down_sync(0xffffffffu, s, off)); }
};

struct KdArgs {
  const void* s;  // student [N,V]
  int64_t lds;
  const void* t;  // teacher logits [N,V] (full teacher)
  int64_t ldt;
  size_t t_off;   // byte offset of the teacher's resident slice in shared memory
  const void* ids;  // top-K teacher
  int64_t ldi;
  bool ids64;
  int64_t K;
  const float* lp;
  int64_t ldlp;
  const void* targets;  // optional
  bool tgt64;
  int64_t ignore_index;
  void* ds;  // dstudent (student dtype) or null
  int64_t ldd;
  const float* grad;  // upstream gradient or null
  bool grad_scalar;
  const int* count;   // unmasked rows (MEAN with a gradient)
  float* row_loss;    // [N]: the loss output (NONE) or the workspace (SUM/MEAN)
  int* row_used;      // [N] unmasked flags for the finalize (SUM/MEAN) or null
  float* slot_val;    // [N*K] top-K gradient values saved before a streamed dense pass
  int reduction, div;
  float beta, inv_t, t2;
  float temperature;  // inv_t = 1/temperature, recomputed in the row kernels so that it lives in a register
  int64_t N, V;
  int C, p0, p1;
  bool cluster;
  void *ws0, *ws1, *ws2;  // phased partials [N*C] (8 bytes each)
};

template <class Ts, class Tt>
constexpr int kGroup = kVec<Ts> > kVec<Tt> ? kVec<Ts> : kVec<Tt>;

// z - c for z = x/T, as one fused multiply-add everywhere, so that equal inputs give bitwise-equal
// log-probabilities whatever the compiler would have contracted (identical distributions give 0 exactly).
__device__ __forceinline__ float zdiff(float x, float inv_t, float c) { return __fmaf_rn(x, inv_t, -c); }

// log p_j over z = x/T from max-shifted values: (x/T - m) - log d, with m the max of z and d the sum of
// e^(z - m). x/T - m is one fused multiply-add (exact product) and log d is at most log V, so neither
// rounding grows with a common offset of the logits (lse = m + log d rounded would: ulp(m) per element).
struct LogProb {
  float inv_t, m, logd;
  __device__ float operator()(float x) const { return __fsub_rn(zdiff(x, inv_t, m), logd); }
};
// The same in base 2 (c = log2(e)/T, m and log2 d from a fused-form OnlineSoftmax), returned in nats.
struct LogProb2 {
  float c, m, log2d;
  __device__ float operator()(float x) const { return __fsub_rn(__fmaf_rn(x, c, -m), log2d) * kLn2; }
};

// Running max of raw values (NaN ignored, as fmaxf). 16-bit types compare packed pairs, so a 16-byte
// vector costs 4 instructions, and are converted to fp32 once at the end (the max is exact in any format).
template <class T>
struct RawMax {
  float m;
  unsigned run;  // two T's (16-bit types)
  __device__ RawMax() : m(-INFINITY), run(std::is_same_v<T, __half> ? 0xfc00fc00u : 0xff80ff80u) {}
  __device__ void vec(const uint4& raw) {
    if constexpr (sizeof(T) == 4) {
      m = fmaxf(m, fmaxf(fmaxf(__uint_as_float(raw.x), __uint_as_float(raw.y)),
                         fmaxf(__uint_as_float(raw.z), __uint_as_float(raw.w))));
    } else {
      run = hmax2_bits<T>(run, raw.x);
      run = hmax2_bits<T>(run, raw.y);
      run = hmax2_bits<T>(run, raw.z);
      run = hmax2_bits<T>(run, raw.w);
    }
  }
  __device__ void one(float x) { m = fmaxf(m, x); }
  __device__ float get() const {
    if constexpr (sizeof(T) == 4) {
      return m;
    } else {
      float v[kVec<T>];
      unpack_words<T>(make_uint4(run, run, run, run), v);
      return fmaxf(m, fmaxf(v[0], v[1]));
    }
  }
};

// G values of T from p (16-byte aligned) as fp32.
template <class T, int G>
__device__ __forceinline__ void load_group(const T* p, float (&v)[G]) {
  constexpr int K = kVec<T>;
#pragma unroll
  for (int c = 0; c < G / K; ++c) {
    float w[K];
    unpack_words<T>(reinterpret_cast<const uint4*>(p)[c], w);
#pragma unroll
    for (int k = 0; k < K; ++k) v[c * K + k] = w[k];
  }
}

// Visits the student and teacher slices together: f(vs, vt, e, cnt), cnt = G (16-byte loads) or 1.
template <class Ts, class Tt, bool kResident, class F>
__device__ __forceinline__ void visit2(const Ts* s, const Tt* t, const Ts* ss, const Tt* st, int64_t n, F&& f) {
  constexpr int G = kGroup<Ts, Tt>;
  if constexpr (kResident) {
    const int m = int(n), ng = m / G;
    for (int g = threadIdx.x; g < ng; g += blockDim.x) {
      float vs[G], vt[G];
      load_group<Ts, G>(ss + g * G, vs);
      load_group<Tt, G>(st + g * G, vt);
      f(vs, vt, int64_t(g) * G, G);
    }
    for (int e = ng * G + threadIdx.x; e < m; e += blockDim.x) {
      float vs[G], vt[G];
      vs[0] = to_float(ss[e]);
      vt[0] = to_float(st[e]);
      f(vs, vt, int64_t(e), 1);
    }
  } else {
    // 16-byte loads when both slices start on a 16-byte boundary, else element by element.
    const bool aligned = ((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(t)) & 15u) == 0;
    const int64_t ng = aligned ? n / G : 0;
    for (int64_t g = threadIdx.x; g < ng; g += blockDim.x) {
      float vs[G], vt[G];
      load_group<Ts, G>(s + g * G, vs);
      load_group<Tt, G>(t + g * G, vt);
      f(vs, vt, g * G, G);
    }
    for (int64_t e = ng * G + threadIdx.x; e < n; e += blockDim.x) {
      float vs[G], vt[G];
      vs[0] = to_float(s[e]);
      vt[0] = to_float(t[e]);
      f(vs, vt, e, 1);
    }
  }
}

// Visits the student slice (resident or from global memory): f(v, e, cnt).
template <class T, bool kResident, class F>
__device__ __forceinline__ void visit1(const T* s, const T* ss, int64_t n, F&& f) {
  if constexpr (kResident) smem_visit<T>(ss, int(n), f);
  else row_visit<T>(s, 0, n, f);
}

// Writes `val` to p[0, n) (16-byte stores where aligned).
template <class O>
__device__ __forceinline__ void fill_slice(O* p, int64_t n, float val) {
  constexpr int K = kVec<O>;
  const O x = from_float<O>(val);
  const int64_t head = unaligned_head<O>(p, nullptr, 0, n);
  for (int64_t e = threadIdx.x; e < head; e += blockDim.x) p[e] = x;
  const int64_t nvec = (n - head) / K;
  float w[K];
#pragma unroll
  for (int k = 0; k < K; ++k) w[k] = val;
  const uint4 pat = pack<O>(w);
  uint4* vp = reinterpret_cast<uint4*>(p + head);
  for (int64_t i = threadIdx.x; i < nvec; i += blockDim.x) vp[i] = pat;
  for (int64_t e = head + nvec * K + threadIdx.x; e < n; e += blockDim.x) p[e] = x;
}

// A row decided before any data is read (masked, or a top-K id out of range): written by the launch that
// runs the last phase.
template <class Ts>
__device__ __forceinline__ void kd_fixed_row(const KdArgs& a, int64_t row, int rank, Ts* ds, int64_t n, float loss,
                                             float grad, int used) {
  if (a.p1 != kLastPhase) return;
  if (ds) fill_slice<Ts>(ds, n, grad);
  if (rank == 0 && threadIdx.x == 0) {
    a.row_loss[row] = loss;
    if (a.row_used) a.row_used[row] = used;
  }
}

// grad_loss * T2factor / T, divided by the unmasked rows for MEAN (as the CPU: in double, rounded once).
__device__ __forceinline__ float kd_grad_scale(const KdArgs& a, int64_t row) {
  float g = a.grad ? a.grad[a.grad_scalar ? 0 : row] : 1.f;
  if (a.reduction == FCE_REDUCTION_MEAN) g = float(double(g) / double(*a.count));
  return g * a.t2 * a.inv_t;
}

__device__ __forceinline__ bool target_masked(const KdArgs& a, int64_t row) {
  return a.targets && load_index(a.targets, a.tgt64, row) == a.ignore_index;
}

// ---- MEAN's row count and the reduction -----------------------------------------------------------

// Unmasked rows, for MEAN's gradient scale: a warp per row, integer atomics (exact in any order).
__global__ void __launch_bounds__(256) kd_count_kernel(const KdArgs a, int* count) {
  const int lane = threadIdx.x & 31;
  const int64_t row = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  bool keep = false;
  if (row < a.N) {  // the same for the whole warp
    keep = !target_masked(a, row);
    if (keep && a.ids) {  // a top-K row without a used slot is masked
      int any = 0;
      for (int64_t k = lane; k < a.K; k += 32) any |= load_index(a.ids, a.ids64, row * a.ldi + k) >= 0;
      keep = __any_sync(0xffffffffu, any) != 0;
    }
  }
  const int c = __syncthreads_count(lane == 0 && keep);
  if (threadIdx.x == 0 && c) atomicAdd(count, c);
}

// SUM/MEAN of the per-row losses in a fixed order, in fp64; MEAN divides by the unmasked rows (0 if none).
__global__ void __launch_bounds__(1024) kd_finalize_kernel(const float* row_loss, const int* row_used, int64_t N,
                                                           int mean, float* out) {
  finalize_rows(row_loss, nullptr, N, mean != 0, [&] {
    long long u = 0;
    for (int64_t i = threadIdx.x; i < N; i += blockDim.x) u += row_used[i];
    return double(block_reduce(SumL(u)).s);
  }, out, nullptr);
}

}  // namespace
}  // namespace fce::cuda
