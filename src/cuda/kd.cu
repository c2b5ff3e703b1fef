// CUDA knowledge-distillation losses (fce_kd_loss): full teacher logits or a top-K teacher.
//
// A row is handled by C blocks (C = 1, 2, 4 or 8), block `rank` owning the columns split_range(V, C, rank).
// Phases, each followed by an exchange of per-block partials that every block of the row merges in rank
// order (so all of them hold bitwise-identical row statistics):
//   phase 0  raw maxima of the student (and teacher) logits                       -> exchange 0
//   phase 1  sums of exp(z - max z), z = logits / T: log d_s (and log d_t)        -> exchange 1
//   phase 2  the divergence terms of KdTerm (log p = (t/T - max) - log d_t, log q likewise, LogProb: from
//            max-shifted values, so no error grows with a common offset of the logits): the row's loss
//            and A = sum_j a_j                                                     -> exchange 2
//   phase 3  dstudent_j = scale * (a_j - q_j A) (kd_grad), scale = grad * T2factor / T (/ rows)
// The gradient needs A, known only once the whole row has been seen, so phase 3 recomputes a_j with KdTerm
// from the slices still in shared memory (one more exp per column for forward KL, two for reverse KL/JSD,
// plus q_j) rather than keeping it: keeping a_j in fp32 would double the shared memory of a resident bf16
// row pair (4 -> 8 bytes per column: fewer blocks per SM, or rows too long to stay resident), and keeping
// it in DRAM would add a write and a read of 4 bytes per column to the 6 the op moves. The recomputation
// is ~20 instructions per column, hidden behind the memory traffic.
// How the blocks of a row work together (plan_rows, from N, V, the dtypes and the GPU):
//   resident  the row's slices of student and teacher stay in shared memory from phase 0 on, so each is
//             read from DRAM exactly once whatever the number of phases: two reads (plus one write of
//             dstudent), the minimum. With C > 1 the C blocks are one thread-block cluster (Hopper) and
//             exchange partials through distributed shared memory. (A row of 128256 bf16 columns is
//             500 KiB for the pair: re-reading it "from L2" is not an option with ~400 rows in flight.)
//   streaming one block per row, re-reading the row from global memory in every phase (many rows too
//             long for shared memory, or no clusters).
//   phased    few rows too long for shared memory (or no clusters): split_count() blocks per row and one
//             launch per phase, partials through the workspace, merged in split order.
// Top-K teacher: ids [N,K] and teacher log-probs [N,K]; teacher p = softmax over the used slots of
// logprobs/T (every block computes it: K is small). Full-vocabulary normalization uses the same phases on
// the student alone, phase 2 taking the terms at the ids inside the block's own columns, phase 3 writing
// -q_j A everywhere and then a_k - q_k A at the ids (each element formed in fp32 and stored once per
// store; the id values overwrite the dense ones after a barrier). Renormalized over the K: one block per
// row that never reads the rest of the student row (gathers only; the gradient is 0 outside the K).
// Masked rows (targets == ignore_index, or a top-K row without a used slot): loss 0, gradient 0. A top-K
// id >= V: loss and gradient NaN. MEAN is batchmean over unmasked rows: with a gradient a tiny pre-kernel
// counts them (integer atomics: exact), and SUM/MEAN go through a single-block finalize that sums the
// per-row losses in a fixed order in fp64 (and counts the rows' unmasked flags for MEAN). No float atomics, no host sync, no allocation: bitwise
// repeatable and capturable in a CUDA graph.
// Faster paths when rows fill the GPU (at least one block per SM): forward only, forward and reverse KL and
// the full-vocabulary top-K need no normalized probability per element, so one streaming pass computes the
// loss (kd_kl_onepass_kernel, kd_topk_onepass_kernel: each row read once); with dstudent, forward and
// reverse KL of one dtype with aligned rows use persistent blocks (or clusters of two for long rows) that
// pipeline the rows through shared memory (kd_kl_grad_pipe_kernel: two passes, A known in closed form).
// The paths: cuda/plan.hpp (KdPath, and plan_rows for the rows path).
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

struct SumD {
  double s;
  __device__ SumD() : s(0.0) {}
  __device__ explicit SumD(double x) : s(x) {}
  __device__ void merge(const SumD& o) { s += o.s; }
  __device__ SumD shfl_down(unsigned off) const { return SumD(__shfl_down_sync(0xffffffffu, s, off)); }
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
// The same in base 2 (c = log2(e)/T, m and log2 d from Lse2), returned in nats.
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

// ---- full teacher ----------------------------------------------------------------------------------

template <class Ts, class Tt, int DIV, bool kResident>
__device__ __forceinline__ void kd_full_row(const KdArgs& a, int64_t row, int rank) {
  constexpr int G = kGroup<Ts, Tt>;
  int64_t begin, end;
  split_range(a.V, a.C, rank, &begin, &end);
  const int64_t n = end - begin;
  const Ts* s = static_cast<const Ts*>(a.s) + row * a.lds + begin;
  const Tt* t = static_cast<const Tt*>(a.t) + row * a.ldt + begin;
  Ts* ds = a.ds ? static_cast<Ts*>(a.ds) + row * a.ldd + begin : nullptr;
  Ts* ss = reinterpret_cast<Ts*>(g_smem);
  Tt* st = reinterpret_cast<Tt*>(reinterpret_cast<char*>(g_smem) + a.t_off);
  const RowCtx c{row, a.C, rank, a.p0, a.p1};
  if (target_masked(a, row)) {
    kd_fixed_row<Ts>(a, row, rank, ds, n, 0.f, 0.f, 0);
    return;
  }
  const float inv_t = 1.f / a.temperature;

  // Phase 0: raw maxima (the slices go to shared memory on the way).
  Max2 mx;
  if (a.p0 == 0) {
    RawMax<Ts> rs;
    RawMax<Tt> rt;
    if constexpr (kResident) {
      load_slice<Ts>(
          s, int(n), ss, [&](const uint4& raw, int) { rs.vec(raw); }, [&](float x, int) { rs.one(x); });
      load_slice<Tt>(
          t, int(n), st, [&](const uint4& raw, int) { rt.vec(raw); }, [&](float x, int) { rt.one(x); });
    } else {
      row_visit<Ts>(s, 0, n, [&](const float(&v)[kVec<Ts>], int64_t, int cnt) {
#pragma unroll
        for (int k = 0; k < kVec<Ts>; ++k)
          if (k < cnt) rs.one(v[k]);
      });
      row_visit<Tt>(t, 0, n, [&](const float(&v)[kVec<Tt>], int64_t, int cnt) {
#pragma unroll
        for (int k = 0; k < kVec<Tt>; ++k)
          if (k < cnt) rt.one(v[k]);
      });
    }
    mx.a = rs.get();
    mx.b = rt.get();
    mx = block_reduce(mx);
  }
  if (!exchange<0>(c, 0, mx, static_cast<Max2*>(a.ws0))) return;
  // Max of z = x/T is (max x)/T: rounding is monotonic and T > 0.
  const float ms = mx.a * inv_t, mt = mx.b * inv_t;

  // Phase 1: sums of exp(z - max z) -> log d_s, log d_t.
  Sum2 sum;
  if (a.p0 <= 1) {
    const bool live_s = ms != -INFINITY, live_t = mt != -INFINITY;
    visit2<Ts, Tt, kResident>(s, t, ss, st, n, [&](const float(&vs)[G], const float(&vt)[G], int64_t, int cnt) {
#pragma unroll
      for (int k = 0; k < G; ++k) {
        if (k < cnt) {
          if (live_s) sum.a += fexp(zdiff(vs[k], inv_t, ms));
          if (live_t) sum.b += fexp(zdiff(vt[k], inv_t, mt));
        }
      }
    });
    sum = block_reduce(sum);
  }
  if (!exchange<1>(c, 1, sum, static_cast<Sum2*>(a.ws1))) return;
  const LogProb lq{inv_t, ms, logf(sum.a)}, lp{inv_t, mt, logf(sum.b)};  // NaN rows without a finite logit
  const KdTerm term(DIV >= 0 ? DIV : a.div, a.beta);

  // Phase 2: the loss and A = sum_j a_j.
  LossA la;
  if (a.p0 <= 2) {
    visit2<Ts, Tt, kResident>(s, t, ss, st, n, [&](const float(&vs)[G], const float(&vt)[G], int64_t, int cnt) {
#pragma unroll
      for (int k = 0; k < G; ++k) {
        if (k < cnt) {
          float aj;
          la.loss += term(lp(vt[k]), lq(vs[k]), &aj);
          la.A += aj;
        }
      }
    });
    la = block_reduce(la);
  }
  if (!exchange<2>(c, 2, la, static_cast<LossA*>(a.ws2))) return;
  if (rank == 0 && threadIdx.x == 0) {
    a.row_loss[row] = la.loss * a.t2;
    if (a.row_used) a.row_used[row] = 1;
  }
  if (!ds) return;

  // Phase 3: dstudent = scale * (a - q*A) (kd_grad), a recomputed (in place allowed: every element is read
  // before its store, from shared memory or by the thread that stores it).
  const float scale = kd_grad_scale(a, row), A = la.A;
  constexpr bool kMayInf = DIV < 0 || DIV == FCE_KD_REVERSE_KL;  // A = +inf only for reverse KL
  visit2<Ts, Tt, kResident>(s, t, ss, st, n, [&](const float(&vs)[G], const float(&vt)[G], int64_t e0, int cnt) {
    float g[G];
#pragma unroll
    for (int k = 0; k < G; ++k) {
      g[k] = 0.f;
      if (k < cnt) {
        float aj;
        const float lqk = lq(vs[k]);
        (void)term(lp(vt[k]), lqk, &aj);
        const float q = fexp(lqk);
        g[k] = kMayInf ? kd_grad(aj, q, A, scale) : (q == 0.f ? aj : aj - q * A) * scale;
      }
    }
    store_vals<Ts, G>(ds + e0, g, cnt);
  });
}

template <class Ts, class Tt, int DIV, bool kResident>
__global__ void __launch_bounds__(kKdThreads, 3) kd_full_kernel(const KdArgs a) {
  const int rank = int(blockIdx.x % unsigned(a.C));
  const int64_t stride = int64_t(gridDim.x / unsigned(a.C));
  for (int64_t row = blockIdx.x / unsigned(a.C); row < a.N; row += stride) {
    kd_full_row<Ts, Tt, DIV, kResident>(a, row, rank);
    if (a.cluster) cluster_sync_all();  // shared memory reusable: every thread and peer is done with it
    else __syncthreads();
  }
}

// ---- forward only, one pass (forward or reverse KL, many rows) --------------------------------------
// KL(P || Q) = sum_j p_j (z^P_j - z^Q_j) - lse_P + lse_Q (z = logits / T, sum p = 1), so forward and reverse
// KL need no normalized probability per element: one online-softmax pass (Milakov & Gimelshein 2018) over
// both rows keeps (max, sum of e^(z - max)) of each and W = sum_j e^(z^P_j - max P) (z^P_j - z^Q_j), rescaled
// with the P sum. Each row is read once from DRAM, as for a cross-entropy forward. Elements with p_j = 0 add
// nothing (no 0 * inf); identical inputs give W = 0 and equal lse's: exactly 0.
// Running max m and sum d of 2^(z2 - m) of one row. Every operation is explicitly rounded (no contraction),
// so two equal rows give bitwise-equal states whichever side of KlAcc they are on.
struct Lse2 {
  float m, d;
  __device__ Lse2() : m(-INFINITY), d(0.f) {}
  __device__ static float rescale(float m, float mn) { return m == mn ? 1.f : ex2(__fsub_rn(m, mn)); }
  __device__ float shift(float mn) {  // to the new max mn (finite or +inf); returns the factor
    const float r = rescale(m, mn);
    d = __fmul_rn(d, r);
    m = mn;
    return r;
  }
  __device__ void merge(const Lse2& o) {
    const float mn = fmaxf(m, o.m);
    if (mn == -INFINITY) return;
    d = __fadd_rn(__fmul_rn(d, rescale(m, mn)), __fmul_rn(o.d, rescale(o.m, mn)));
    m = mn;
  }
  // Adds n raw values x (z2 = x c; the group max first), calling on_e(k, 2^(x_k c - m)) for each, the
  // exponent one fused multiply-add (exact product: no rounding of x c that grows with an offset of x);
  // NaN propagates. Returns the factor the earlier sum was rescaled by (1 when nothing finite was seen).
  template <int G, class F>
  __device__ __forceinline__ float add(const float (&x)[G], int n, float c, F&& on_e) {
    float g = -INFINITY;
#pragma unroll
    for (int k = 0; k < G; ++k)
      if (k < n) g = fmaxf(g, x[k]);
    const float mn = fmaxf(m, __fmul_rn(g, c));  // the max of x c is (max x) c: rounding is monotonic
    if (mn == -INFINITY) {
#pragma unroll
      for (int k = 0; k < G; ++k)
        if (k < n && isnan(x[k])) d = NAN;
      return 1.f;
    }
    const float r = shift(mn);
#pragma unroll
    for (int k = 0; k < G; ++k)
      if (k < n) {
        const float e = ex2(__fmaf_rn(x[k], c, -mn));
        d = __fadd_rn(d, e);
        on_e(k, e);
      }
    return r;
  }
  template <int G>
  __device__ __forceinline__ void add(const float (&x)[G], int n, float c) {
    add<G>(x, n, c, [](int, float) {});
  }
  __device__ Lse2 shfl_down(unsigned off) const {
    Lse2 r;
    r.m = __shfl_down_sync(0xffffffffu, m, off);
    r.d = __shfl_down_sync(0xffffffffu, d, off);
    return r;
  }
};

struct KlAcc {  // P and Q states, and W = sum 2^(zP - mP) (zP - zQ) at P's max
  Lse2 p, q;
  float w;  // while a thread adds values: in raw units (xP - xQ); times c before any merge
  __device__ KlAcc() : w(0.f) {}
  __device__ void merge(const KlAcc& o) {
    const float np = fmaxf(p.m, o.p.m);
    if (np != -INFINITY) w = __fadd_rn(__fmul_rn(w, Lse2::rescale(p.m, np)), __fmul_rn(o.w, Lse2::rescale(o.p.m, np)));
    p.merge(o.p);
    q.merge(o.q);
  }
  template <int G>
  __device__ __forceinline__ void add(const float (&xp)[G], const float (&xq)[G], int n, float c) {
    float wk = 0.f;  // this group's part, at the new max
    const float r = p.add<G>(xp, n, c, [&](int k, float e) {
      if (e != 0.f) wk = fmaf(e, xp[k] - xq[k], wk);
    });
    w = __fadd_rn(__fmul_rn(w, r), wk);
    q.add<G>(xq, n, c);
  }
  // KL(P || Q) / ln 2 = W/d_P + lse_Q - lse_P, the lse difference taken as (m_Q - m_P) + (log2 d_Q - log2 d_P):
  // each max is the reference its own sum was taken against, so their rounding cancels exactly, where
  // m + log2 d rounded would leave ulp(m), an error that grows with an offset of the logits.
  __device__ float kl2() const {
    return w / p.d + __fadd_rn(__fsub_rn(q.m, p.m), __fsub_rn(log2f(q.d), log2f(p.d)));
  }
};

// Warp merge of KlAcc partials, the result bitwise the same in every lane: the maxima first (exact), then
// each lane's sums rescaled once and added by butterflies, P and Q by the same explicitly rounded steps
// (equal rows give equal states). Shorter than five pairwise merges, whose exponentials sit on the chain.
__device__ __forceinline__ KlAcc kl_warp_all(const KlAcc& v) {
  float pm = v.p.m, qm = v.q.m;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    pm = fmaxf(pm, __shfl_xor_sync(0xffffffffu, pm, o));
    qm = fmaxf(qm, __shfl_xor_sync(0xffffffffu, qm, o));
  }
  const float rp = Lse2::rescale(v.p.m, pm), rq = Lse2::rescale(v.q.m, qm);  // a NaN sum stays NaN
  float pd = __fmul_rn(v.p.d, rp), qd = __fmul_rn(v.q.d, rq), w = __fmul_rn(v.w, rp);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    pd = __fadd_rn(pd, __shfl_xor_sync(0xffffffffu, pd, o));
    qd = __fadd_rn(qd, __shfl_xor_sync(0xffffffffu, qd, o));
    w = __fadd_rn(w, __shfl_xor_sync(0xffffffffu, w, o));
  }
  KlAcc r;
  r.p.m = pm;
  r.p.d = pd;
  r.q.m = qm;
  r.q.d = qd;
  r.w = w;
  return r;
}

// Block merge with kl_warp_all, in every thread; the block reduction of every KlAcc (the shared scratch is
// free again on return, as with block_reduce).
__device__ __forceinline__ KlAcc kl_block_all(const KlAcc& v) {
  __shared__ float sh[5][32];
  const KlAcc t = kl_warp_all(v);
  const int lane = int(threadIdx.x & 31u), warp = int(threadIdx.x >> 5);
  if (lane == 0) {
    sh[0][warp] = t.p.m;
    sh[1][warp] = t.p.d;
    sh[2][warp] = t.q.m;
    sh[3][warp] = t.q.d;
    sh[4][warp] = t.w;
  }
  __syncthreads();
  KlAcc u;  // -inf maxima and zero sums past the last warp
  if (lane < int(blockDim.x >> 5)) {
    u.p.m = sh[0][lane];
    u.p.d = sh[1][lane];
    u.q.m = sh[2][lane];
    u.q.d = sh[3][lane];
    u.w = sh[4][lane];
  }
  u = kl_warp_all(u);
  __syncthreads();  // every warp has read sh
  return u;
}

// One block per row; DIV is forward KL (P = teacher) or reverse KL (P = student).
template <class Ts, class Tt, int DIV>
__global__ void __launch_bounds__(kKdThreads) kd_kl_onepass_kernel(const KdArgs a) {
  constexpr int G = kGroup<Ts, Tt>;
  const float c = kLog2e / a.temperature;  // z2 = x * log2(e) / T
  for (int64_t row = blockIdx.x; row < a.N; row += gridDim.x) {
    if (target_masked(a, row)) {
      if (threadIdx.x == 0) {
        a.row_loss[row] = 0.f;
        if (a.row_used) a.row_used[row] = 0;
      }
      continue;
    }
    const Ts* s = static_cast<const Ts*>(a.s) + row * a.lds;
    const Tt* t = static_cast<const Tt*>(a.t) + row * a.ldt;
    KlAcc acc;
    visit2<Ts, Tt, false>(s, t, nullptr, nullptr, a.V, [&](const float(&vs)[G], const float(&vt)[G], int64_t, int cnt) {
      if constexpr (DIV == FCE_KD_FORWARD_KL) acc.add<G>(vt, vs, cnt, c);
      else acc.add<G>(vs, vt, cnt, c);
    });
    acc.w = __fmul_rn(acc.w, c);
    acc = kl_block_all(acc);
    if (threadIdx.x == 0) {
      // Every P and Q step mirrors the other, so equal rows give exactly 0.
      const float loss = acc.kl2() * kLn2;
      a.row_loss[row] = loss * a.t2;
      if (a.row_used) a.row_used[row] = 1;
    }
  }
}


// ---- with the gradient, forward or reverse KL (many rows, one dtype, 16-byte aligned rows) -------------
// Two passes per row: the statistics (KlAcc), then dstudent. With P = teacher for forward KL and P = student
// for reverse KL, a_j sums in closed form (A = -1, and A = KL + 1), so the gradient needs no third pass:
//   forward KL  dL/dz_j = q_j - p_j                        reverse KL  dL/dz_j = q_j (log q_j - log p_j - KL)
// Persistent clusters of C = 1 or 2 blocks (one block per SM), block `rank` owning a C-th of every row
// pair (16-byte vectors; the last rank also the scalar tail): the first cache_vecs vectors of its slice of
// both rows sit in shared memory, brought there by asynchronous copies issued as the previous row's gradient
// pass frees each slot, so the loads of row r + 1 overlap the stores of row r; the rest of the slice is
// re-read from L2. Splitting a row pair over C SMs keeps most of it in shared memory (bf16, V = 128256: 45%
// of a row pair fits one SM, 88% of a half), instead of re-reading it through an L2 that keeps only part of
// it. The C blocks swap their row statistics through distributed shared memory (double-buffered slots: one
// cluster barrier per row) and merge them in rank order, so every block holds bitwise the same statistics.
template <class T, int DIV, int C>
__global__ void __launch_bounds__(1024, 1) kd_kl_grad_pipe_kernel(const KdArgs a, int64_t cache_vecs) {
  extern __shared__ uint4 cache[];  // [0, cache_vecs) student, [cache_vecs, 2 cache_vecs) teacher
  constexpr int K = kVec<T>;
  const float c = kLog2e / a.temperature;
  const int64_t nvec = a.V / K;
  const int rank = C > 1 ? int(blockIdx.x % unsigned(C)) : 0;
  const int64_t per = (nvec + C - 1) / C;
  const int v0 = int(per * rank < nvec ? per * rank : nvec);  // this block's vectors [v0, v1) of each row
  const int v1 = int(per * (rank + 1) < nvec ? per * (rank + 1) : nvec);
  const bool tail = rank == C - 1;  // the scalar tail past the last full vector
  const int cv = int(cache_vecs < v1 - v0 ? cache_vecs : v1 - v0);
  auto srow = [&](int64_t r) { return static_cast<const T*>(a.s) + r * a.lds; };
  auto trow = [&](int64_t r) { return static_cast<const T*>(a.t) + r * a.ldt; };
  const unsigned long long once = l2_policy_evict_first(), keep = l2_policy_evict_last();
  auto fetch = [&](int64_t r, int i) {  // slot i of row r into shared memory (read once: evict first)
    cp_async16_first(cache + i, reinterpret_cast<const uint4*>(srow(r)) + v0 + i, once);
    cp_async16_first(cache + cache_vecs + i, reinterpret_cast<const uint4*>(trow(r)) + v0 + i, once);
  };
  const int64_t stride = int64_t(gridDim.x / unsigned(C));
  int64_t row = int64_t(blockIdx.x / unsigned(C));
  if (row >= a.N) return;  // every block of the cluster alike
  for (int i = int(threadIdx.x); i < cv; i += int(blockDim.x)) fetch(row, i);
  cp_async_commit();
  for (int it = 0; row < a.N; row += stride, ++it) {
    const bool masked = target_masked(a, row);
    const T* s = srow(row);
    const T* t = trow(row);
    const uint4* sv = reinterpret_cast<const uint4*>(s);
    const uint4* tv = reinterpret_cast<const uint4*>(t);
    // Per thread: P and Q states in base 2 (max of x c, sum of 2^(x c - max)) and W in raw units, each
    // side updated by the same explicitly rounded steps (equal rows give bitwise-equal states).
    float pm = -INFINITY, pd = 0.f, qm = -INFINITY, qd = 0.f, w = 0.f;
    auto add = [&](const float* xp, const float* xq, int n, float vmp, float vmq) {
      const float np = fmaxf(pm, vmp * c), nq = fmaxf(qm, vmq * c);
      if (np == -INFINITY) {
        for (int k = 0; k < n; ++k)
          if (isnan(xp[k])) pd = NAN;
      } else {
        const float r = ex2(pm - np);
        pd = __fmul_rn(pd, r);
        w = __fmul_rn(w, r);
        pm = np;
        for (int k = 0; k < n; ++k) {
          const float e = ex2(fmaf(xp[k], c, -np));
          pd = __fadd_rn(pd, e);
          if (e != 0.f) w = fmaf(e, xp[k] - xq[k], w);
        }
      }
      if (nq == -INFINITY) {
        for (int k = 0; k < n; ++k)
          if (isnan(xq[k])) qd = NAN;
      } else {
        qd = __fmul_rn(qd, ex2(qm - nq));
        qm = nq;
        for (int k = 0; k < n; ++k) qd = __fadd_rn(qd, ex2(fmaf(xq[k], c, -nq)));
      }
    };
    auto add_vec = [&](const uint4& rs, const uint4& rt) {
      float vs[K], vt[K];
      unpack_words<T>(rs, vs);
      unpack_words<T>(rt, vt);
      const float ms = vec_max<T>(rs), mt = vec_max<T>(rt);
      if constexpr (DIV == FCE_KD_FORWARD_KL) add(vt, vs, K, mt, ms);
      else add(vs, vt, K, ms, mt);
    };
    // The uncached part first: its loads need no wait, and the slots' copies issued at the end of the
    // previous row land meanwhile.
    if (!masked) {
      for (int base = v0 + cv + int(threadIdx.x); base < v1; base += 2 * int(blockDim.x)) {
        uint4 rs[2], rt[2];
#pragma unroll
        for (int u = 0; u < 2; ++u)
          if (base + u * int(blockDim.x) < v1) {
            rs[u] = ld_hint_nc(sv + base + u * blockDim.x, keep);  // read again by the gradient pass
            rt[u] = ld_hint_nc(tv + base + u * blockDim.x, keep);
          }
#pragma unroll
        for (int u = 0; u < 2; ++u)
          if (base + u * int(blockDim.x) < v1) add_vec(rs[u], rt[u]);
      }
      if (tail)
        for (int64_t j = nvec * K + threadIdx.x; j < a.V; j += blockDim.x) {
          const float xs = to_float(s[j]), xt = to_float(t[j]);
          if constexpr (DIV == FCE_KD_FORWARD_KL) add(&xt, &xs, 1, xt, xs);
          else add(&xs, &xt, 1, xs, xt);
        }
    }
    cp_async_wait_all();  // this thread's slots (only it reads them); a masked row's too, before refilling
    if (!masked)
      for (int i = int(threadIdx.x); i < cv; i += int(blockDim.x)) add_vec(cache[i], cache[cache_vecs + i]);
    KlAcc acc;
    acc.p.m = pm;
    acc.p.d = pd;
    acc.q.m = qm;
    acc.q.d = qd;
    acc.w = w * c;
    acc = kl_block_all(acc);
    if constexpr (C > 1) {  // the row's C partials, merged in rank order in every block
      KlAcc* slot = exchange_slot<KlAcc[2], 0>()[0];
      KlAcc* merged = exchange_slot<KlAcc, 1>();
      if (threadIdx.x == 0) slot[it & 1] = acc;
      cluster_sync_all();
      if (threadIdx.x == 0) {
        KlAcc m = cluster_peer(slot + (it & 1), 0);
        for (int r = 1; r < C; ++r) m.merge(cluster_peer(slot + (it & 1), r));
        *merged = m;
      }
      __syncthreads();
      acc = *merged;
    }
    const float kl2 = acc.kl2();  // KL / ln 2
    if (rank == 0 && threadIdx.x == 0) {
      a.row_loss[row] = masked ? 0.f : kl2 * kLn2 * a.t2;
      if (a.row_used) a.row_used[row] = masked ? 0 : 1;
    }
    const float scale = masked ? 0.f : kd_grad_scale(a, row);
    // Student (s) and teacher (t) from max-shifted values, as KlAcc::kl2: u_j = x_j c - m (one fused
    // multiply-add), q_j = 2^(u_j) / d. Forward KL: (q_j - p_j) scale, the 1/d folded into the scale.
    // Reverse KL: q_j (log2 q_j - log2 p_j - KL/ln2) ln2 scale = q_j ((us_j - ut_j) - K2) ln2 scale, with
    // K2 = (log2 d_s - log2 d_t) + KL/ln2 (no max in it: nothing grows with an offset of the logits). Few
    // live values: the kernel has 64 registers.
    const Lse2& st = DIV == FCE_KD_FORWARD_KL ? acc.q : acc.p;
    const Lse2& tt = DIV == FCE_KD_FORWARD_KL ? acc.p : acc.q;
    const float ms = st.m, mt = tt.m;
    const float qscale = scale / st.d, pscale = scale / tt.d;  // forward KL
    // A reverse-KL row whose KL is +inf (the teacher has probability 0 where the student has mass) takes
    // kd_grad's limit through the same arithmetic: K2 = FLT_MAX and rscale = +-inf (the scale's sign) make
    // e ((us - ut) - K2) rscale +inf at ut = -inf and -inf elsewhere; a zero scale writes zeros.
    const bool inf_row = DIV == FCE_KD_REVERSE_KL && kl2 == INFINITY;
    const bool zero = masked || (inf_row && scale == 0.f);
    const float K2 = inf_row ? FLT_MAX : __fadd_rn(__fsub_rn(log2f(st.d), log2f(tt.d)), kl2);  // reverse KL
    const float rscale = inf_row ? INFINITY * scale : kLn2 * scale / st.d;
    auto grad = [&](float xs, float xt) {
      const float us = fmaf(xs, c, -ms), ut = fmaf(xt, c, -mt);
      if (DIV == FCE_KD_FORWARD_KL) return ex2(us) * qscale - ex2(ut) * pscale;
      const float e = ex2(us);  // q_j d_s
      if (e == 0.f) return 0.f;  // a -inf student logit: exactly 0
      return e * ((us - ut) - K2) * rscale;
    };
    T* ds = static_cast<T*>(a.ds) + row * a.ldd;
    uint4* dv = reinterpret_cast<uint4*>(ds);
    const int64_t next = row + stride;
    auto grad_vec = [&](const uint4& rs, const uint4& rt) {
      float vs[K], vt[K], g[K];
      unpack_words<T>(rs, vs);
      unpack_words<T>(rt, vt);
#pragma unroll
      for (int k = 0; k < K; ++k) g[k] = zero ? 0.f : grad(vs[k], vt[k]);
      return pack<T>(g);
    };
    // The uncached part first and backwards, the most recently read (still in L2) first; then the cached
    // slots, each refilled with the next row as soon as it is used. dstudent is stored evict-first, so
    // that it does not push the rows out of L2.
    const int nu = v1 - v0 - cv;
    for (int base = int(threadIdx.x); base < nu; base += 2 * int(blockDim.x)) {
      uint4 rs[2], rt[2];
#pragma unroll
      for (int u = 0; u < 2; ++u)
        if (base + u * int(blockDim.x) < nu) {
          const int i = v1 - 1 - (base + u * int(blockDim.x));
          rs[u] = ld_hint(sv + i, once);  // coherent loads (dstudent may be the student), last use
          rt[u] = ld_hint(tv + i, once);
        }
#pragma unroll
      for (int u = 0; u < 2; ++u)
        if (base + u * int(blockDim.x) < nu) {
          const int i = v1 - 1 - (base + u * int(blockDim.x));
          store_stream(dv + i, grad_vec(rs[u], rt[u]));
        }
    }
    for (int i = int(threadIdx.x); i < cv; i += int(blockDim.x)) {
      store_stream(dv + v0 + i, grad_vec(cache[i], cache[cache_vecs + i]));
      if (next < a.N) fetch(next, i);
    }
    if (tail)
      for (int64_t j = nvec * K + threadIdx.x; j < a.V; j += blockDim.x) {
        const float xs = to_float(s[j]), xt = to_float(t[j]);
        ds[j] = from_float<T>(zero ? 0.f : grad(xs, xt));
      }
    cp_async_commit();
  }
  if constexpr (C > 1) cluster_sync_all();  // peers may read this block's slots until here
}


// ---- top-K teacher ---------------------------------------------------------------------------------

// Used slots (id >= 0) and ids out of range (id >= V) of a row, the same in every thread.
__device__ __forceinline__ void topk_status(const KdArgs& a, int64_t ib, bool* any_used, bool* any_oob) {
  int used = 0, oob = 0;
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
    const int64_t id = load_index(a.ids, a.ids64, ib + k);
    used |= id >= 0;
    oob |= id >= a.V;
  }
  *any_used = __syncthreads_or(used) != 0;
  *any_oob = __syncthreads_or(oob) != 0;
}

// The teacher's log-probabilities over its used slots of logprobs/T (every block of the row computes the same).
__device__ __forceinline__ LogProb topk_teacher_logp(const KdArgs& a, int64_t ib, const float* lp) {
  MaxF m;
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x)
    if (load_index(a.ids, a.ids64, ib + k) >= 0) m.m = fmaxf(m.m, lp[k] * a.inv_t);
  m = block_reduce(m);
  SumF sum;
  if (m.m != -INFINITY)
    for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x)
      if (load_index(a.ids, a.ids64, ib + k) >= 0) sum.s += fexp(zdiff(lp[k], a.inv_t, m.m));
  sum = block_reduce(sum);
  return LogProb{a.inv_t, m.m, logf(sum.s)};
}

// The divergence terms at the used top-K slots of a row (a block-wide sum, loss and A), from the teacher's
// and the student's log-probabilities (LogProb or LogProb2); student logits gathered from srow.
template <class Ts, class LQ>
__device__ __forceinline__ LossA topk_terms(const KdArgs& a, int64_t ib, const float* lp, const Ts* srow,
                                            const LogProb& logp, const LQ& logq) {
  const KdTerm term(a.div, a.beta);
  LossA la;
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
    const int64_t id = load_index(a.ids, a.ids64, ib + k);
    if (id >= 0) {
      float ak;
      la.loss += term(logp(lp[k]), logq(to_float(srow[id])), &ak);
      la.A += ak;
    }
  }
  return block_reduce(la);
}

// Full-vocabulary normalization of the student.
template <class Ts, bool kResident>
__device__ __forceinline__ void kd_topk_row(const KdArgs& a, int64_t row, int rank) {
  constexpr int KV = kVec<Ts>;  // values per 16-byte vector (a.K is the number of top-K slots)
  int64_t begin, end;
  split_range(a.V, a.C, rank, &begin, &end);
  const int64_t n = end - begin;
  const Ts* srow = static_cast<const Ts*>(a.s) + row * a.lds;
  const Ts* s = srow + begin;
  Ts* ds = a.ds ? static_cast<Ts*>(a.ds) + row * a.ldd + begin : nullptr;
  Ts* ss = reinterpret_cast<Ts*>(g_smem);
  const int64_t ib = row * a.ldi;
  const float* lp = a.lp + row * a.ldlp;
  const RowCtx c{row, a.C, rank, a.p0, a.p1};
  bool any_used, any_oob;
  topk_status(a, ib, &any_used, &any_oob);
  const bool masked = !any_used || target_masked(a, row);
  if (masked || any_oob) {
    kd_fixed_row<Ts>(a, row, rank, ds, n, masked ? 0.f : NAN, masked ? 0.f : NAN, masked ? 0 : 1);
    return;
  }
  const float inv_t = 1.f / a.temperature;

  // Phase 0: raw max of the student (its slice goes to shared memory on the way).
  MaxF mx;
  if (a.p0 == 0) {
    RawMax<Ts> rs;
    if constexpr (kResident) {
      load_slice<Ts>(
          s, int(n), ss, [&](const uint4& raw, int) { rs.vec(raw); }, [&](float x, int) { rs.one(x); });
    } else {
      row_visit<Ts>(s, 0, n, [&](const float(&v)[KV], int64_t, int cnt) {
#pragma unroll
        for (int k = 0; k < KV; ++k)
          if (k < cnt) rs.one(v[k]);
      });
    }
    mx.m = rs.get();
    mx = block_reduce(mx);
  }
  if (!exchange<0>(c, 0, mx, static_cast<MaxF*>(a.ws0))) return;
  const float ms = mx.m * inv_t;

  // Phase 1: the student's lse over the full vocabulary.
  SumF sum;
  if (a.p0 <= 1) {
    if (ms != -INFINITY)
      visit1<Ts, kResident>(s, ss, n, [&](const float(&v)[KV], int64_t, int cnt) {
#pragma unroll
        for (int k = 0; k < KV; ++k)
          if (k < cnt) sum.s += fexp(zdiff(v[k], inv_t, ms));
      });
    sum = block_reduce(sum);
  }
  if (!exchange<1>(c, 1, sum, static_cast<SumF*>(a.ws1))) return;
  const LogProb logq{inv_t, ms, logf(sum.s)}, logp = topk_teacher_logp(a, ib, lp);
  const KdTerm term(a.div, a.beta);
  // Student logit at a column of this block's slice (shared memory or global memory).
  auto s_at = [&](int64_t id) -> float {
    if constexpr (kResident) return to_float(ss[id - begin]);
    else return to_float(srow[id]);
  };

  // Phase 2: the terms at the ids inside this block's columns.
  LossA la;
  if (a.p0 <= 2) {
    for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
      const int64_t id = load_index(a.ids, a.ids64, ib + k);
      if (id >= begin && id < end) {
        float ak;
        la.loss += term(logp(lp[k]), logq(s_at(id)), &ak);
        la.A += ak;
      }
    }
    la = block_reduce(la);
  }
  if (!exchange<2>(c, 2, la, static_cast<LossA*>(a.ws2))) return;
  if (rank == 0 && threadIdx.x == 0) {
    a.row_loss[row] = la.loss * a.t2;
    if (a.row_used) a.row_used[row] = 1;
  }
  if (!ds) return;

  // Phase 3: -q_j A everywhere, then a_k - q_k A at the ids (as the CPU), times scale (kd_grad).
  const float scale = kd_grad_scale(a, row), A = la.A;
  auto id_value = [&](int64_t k, int64_t id) {
    const float lq = logq(s_at(id));
    float ak;
    (void)term(logp(lp[k]), lq, &ak);
    return kd_grad(ak, fexp(lq), A, scale);
  };
  if constexpr (!kResident) {  // in place, the dense pass overwrites the student: take the ids first
    for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
      const int64_t id = load_index(a.ids, a.ids64, ib + k);
      if (id >= begin && id < end) a.slot_val[row * a.K + k] = id_value(k, id);
    }
    __syncthreads();
  }
  visit1<Ts, kResident>(s, ss, n, [&](const float(&v)[KV], int64_t e0, int cnt) {
    float g[KV];
#pragma unroll
    for (int k = 0; k < KV; ++k) g[k] = k < cnt ? kd_grad(0.f, fexp(logq(v[k])), A, scale) : 0.f;
    store_vals<Ts, KV>(ds + e0, g, cnt);
  });
  __syncthreads();  // the dense stores are done before the id values replace them
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
    const int64_t id = load_index(a.ids, a.ids64, ib + k);
    if (id >= begin && id < end) {
      float val;
      if constexpr (kResident) val = id_value(k, id);
      else val = a.slot_val[row * a.K + k];
      ds[id - begin] = from_float<Ts>(val);
    }
  }
}

template <class Ts, bool kResident>
__global__ void __launch_bounds__(kKdThreads, 3) kd_topk_kernel(const KdArgs a) {
  const int rank = int(blockIdx.x % unsigned(a.C));
  const int64_t stride = int64_t(gridDim.x / unsigned(a.C));
  for (int64_t row = blockIdx.x / unsigned(a.C); row < a.N; row += stride) {
    kd_topk_row<Ts, kResident>(a, row, rank);
    if (a.cluster) cluster_sync_all();
    else __syncthreads();
  }
}

// Forward only with full-vocabulary normalization (many rows): one block per row streams the student row once
// for its lse (online softmax in base 2), then takes the K terms at the ids (the row is still in L2).
template <class Ts>
__global__ void __launch_bounds__(kKdThreads) kd_topk_onepass_kernel(const KdArgs a) {
  constexpr int KV = kVec<Ts>;
  const float inv_t = 1.f / a.temperature, c = kLog2e * inv_t;
  for (int64_t row = blockIdx.x; row < a.N; row += gridDim.x) {
    const Ts* srow = static_cast<const Ts*>(a.s) + row * a.lds;
    const int64_t ib = row * a.ldi;
    const float* lp = a.lp + row * a.ldlp;
    bool any_used, any_oob;
    topk_status(a, ib, &any_used, &any_oob);
    const bool masked = !any_used || target_masked(a, row);
    if (masked || any_oob) {
      if (threadIdx.x == 0) {
        a.row_loss[row] = masked ? 0.f : NAN;
        if (a.row_used) a.row_used[row] = masked ? 0 : 1;
      }
      continue;
    }
    Lse2 acc;
    row_visit<Ts>(srow, 0, a.V, [&](const float(&v)[KV], int64_t, int cnt) { acc.add<KV>(v, cnt, c); });
    acc = block_reduce(acc);
    const LossA la = topk_terms<Ts>(a, ib, lp, srow, topk_teacher_logp(a, ib, lp), LogProb2{c, acc.m, log2f(acc.d)});
    if (threadIdx.x == 0) {
      a.row_loss[row] = la.loss * a.t2;
      if (a.row_used) a.row_used[row] = 1;
    }
  }
}

// Renormalized over the K: one block per row; only the student logits at the ids are read.
template <class Ts>
__global__ void __launch_bounds__(128) kd_topk_renorm_kernel(const KdArgs a) {
  for (int64_t row = blockIdx.x; row < a.N; row += gridDim.x) {
    const Ts* srow = static_cast<const Ts*>(a.s) + row * a.lds;
    Ts* ds = a.ds ? static_cast<Ts*>(a.ds) + row * a.ldd : nullptr;
    const int64_t ib = row * a.ldi;
    const float* lp = a.lp + row * a.ldlp;
    const float inv_t = 1.f / a.temperature;
    bool any_used, any_oob;
    topk_status(a, ib, &any_used, &any_oob);
    const bool masked = !any_used || target_masked(a, row);
    if (masked || any_oob) {
      if (ds) fill_slice<Ts>(ds, a.V, masked ? 0.f : NAN);
      if (threadIdx.x == 0) {
        a.row_loss[row] = masked ? 0.f : NAN;
        if (a.row_used) a.row_used[row] = masked ? 0 : 1;
      }
      __syncthreads();
      continue;
    }
    const LogProb logp = topk_teacher_logp(a, ib, lp);
    // The student's log-probabilities over the used slots.
    MaxF m;
    for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
      const int64_t id = load_index(a.ids, a.ids64, ib + k);
      if (id >= 0) m.m = fmaxf(m.m, to_float(srow[id]) * inv_t);
    }
    m = block_reduce(m);
    SumF sum;
    if (m.m != -INFINITY)
      for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
        const int64_t id = load_index(a.ids, a.ids64, ib + k);
        if (id >= 0) sum.s += fexp(zdiff(to_float(srow[id]), inv_t, m.m));
      }
    sum = block_reduce(sum);
    const LogProb logq{inv_t, m.m, logf(sum.s)};
    const KdTerm term(a.div, a.beta);
    const LossA la = topk_terms<Ts>(a, ib, lp, srow, logp, logq);
    if (threadIdx.x == 0) {
      a.row_loss[row] = la.loss * a.t2;
      if (a.row_used) a.row_used[row] = 1;
    }
    if (ds) {
      // a_k - q_k A at the ids, 0 elsewhere; the ids' values are taken before the zeros go in (in place).
      const float scale = kd_grad_scale(a, row), A = la.A;
      for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
        const int64_t id = load_index(a.ids, a.ids64, ib + k);
        if (id >= 0) {
          const float lq = logq(to_float(srow[id]));
          float ak;
          (void)term(logp(lp[k]), lq, &ak);
          a.slot_val[row * a.K + k] = kd_grad(ak, fexp(lq), A, scale);
        }
      }
      __syncthreads();
      fill_slice<Ts>(ds, a.V, 0.f);
      __syncthreads();
      for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
        const int64_t id = load_index(a.ids, a.ids64, ib + k);
        if (id >= 0) ds[id] = from_float<Ts>(a.slot_val[row * a.K + k]);
      }
    }
    __syncthreads();
  }
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
  double s = 0;
  long long u = 0;
  for (int64_t i = threadIdx.x; i < N; i += blockDim.x) {
    s += row_loss[i];
    u += row_used[i];
  }
  s = block_reduce(SumD(s)).s;
  u = block_reduce(SumL(u)).s;
  if (threadIdx.x == 0) *out = float(mean ? (u > 0 ? s / double(u) : 0.0) : s);
}

// ---- host side -------------------------------------------------------------------------------------

bool renormalized(const KdProblem& p) { return p.topk() && p.o.topk_norm == FCE_KD_TOPK_RENORMALIZE; }

// Generalized JSD at beta 0 / 1 is exactly forward / reverse KL (KdTerm's convention), decided here so
// the kernels specialize on it.
int effective_div(const KdProblem& p) {
  int div = p.o.divergence;
  if (div == FCE_KD_JSD && p.o.beta == 0.f) div = FCE_KD_FORWARD_KL;
  if (div == FCE_KD_JSD && p.o.beta == 1.f) div = FCE_KD_REVERSE_KL;
  return div;
}

// The plan of a call (src/cuda/plan.hpp: KdPath).
KdPlan kd_plan(const fce_handle* h, const KdProblem& p) {
  KdShape sh;
  sh.N = p.student.rows;
  sh.V = p.student.cols;
  sh.student_size = int(dtype_size(p.student.dtype));
  sh.teacher_size = p.topk() ? 0 : int(dtype_size(p.teacher.dtype));
  sh.dstudent = static_cast<bool>(p.dstudent);
  sh.topk = p.topk();
  sh.renormalized = renormalized(p);
  const int div = effective_div(p);
  sh.kl = div == FCE_KD_FORWARD_KL || div == FCE_KD_REVERSE_KL;
  if (p.dstudent && !p.topk() && p.teacher.dtype == p.student.dtype && p.dstudent.dtype == p.student.dtype) {
    const int es = sh.student_size;
    sh.pipe_layout = aligned16(p.student.data, p.student.ld, es) && aligned16(p.teacher.data, p.teacher.ld, es) &&
                     aligned16(p.dstudent.data, p.dstudent.ld, es) && p.student.cols * int64_t(es) >= 16 * 1024;
  }
  return plan_kd(sh, h->caps, kKdThreads);
}

struct KdWorkspace {
  int* count = nullptr;
  float* row_loss = nullptr;
  int* row_used = nullptr;
  LossA *ws0 = nullptr, *ws1 = nullptr, *ws2 = nullptr;  // 8-byte partials of any exchange
  float* slot_val = nullptr;
  size_t bytes = 0;
};

KdWorkspace kd_layout(const KdProblem& p, const RowPlan& pl, void* base) {
  Carver c(base);
  KdWorkspace w;
  const size_t N = size_t(p.student.rows), NC = N * size_t(pl.C);
  if (p.o.reduction == FCE_REDUCTION_MEAN && p.dstudent) w.count = c.take<int>(1);
  if (p.o.reduction != FCE_REDUCTION_NONE) {
    w.row_loss = c.take<float>(N);
    w.row_used = c.take<int>(N);
  }
  if (pl.phased) {
    w.ws0 = c.take<LossA>(NC);
    w.ws1 = c.take<LossA>(NC);
    w.ws2 = c.take<LossA>(NC);
  }
  if (p.dstudent && p.topk() && (renormalized(p) || !pl.resident))
    w.slot_val = c.take<float>(N * size_t(p.topk_ids.cols));
  w.bytes = c.used;
  return w;
}

static_assert(sizeof(Max2) == 8 && sizeof(Sum2) == 8 && sizeof(LossA) == 8, "8-byte partials");

// Runs the phases of a row kernel: one fused launch, or one launch per phase.
template <class Args>
void run_phases(void (*kernel)(Args), const RowPlan& pl, int64_t N, Args a, cudaStream_t s, const char* what) {
  if (pl.phased) {
    for (int ph = 0; ph <= kLastPhase; ++ph) {
      a.p0 = a.p1 = ph;
      launch_rows(kernel, pl, N, a, s, what);
    }
  } else {
    a.p0 = 0;
    a.p1 = kLastPhase;
    launch_rows(kernel, pl, N, a, s, what);
  }
}

}  // namespace

size_t kd_workspace(fce_handle* h, const KdProblem& p) {
  DeviceGuard guard(h->device_id);
  return kd_layout(p, kd_plan(h, p).rows, nullptr).bytes;
}

void kd(fce_handle* h, fce_stream_t stream, const KdProblem& p, Workspace w) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const int64_t N = p.student.rows, V = p.student.cols;
  const KdPlan plan = kd_plan(h, p);
  const RowPlan& pl = plan.rows;
  const KdWorkspace ws = kd_layout(p, pl, w.ptr);
  const bool reduced = p.o.reduction != FCE_REDUCTION_NONE;

  KdArgs a{};
  a.s = p.student.data;
  a.lds = p.student.ld;
  if (p.topk()) {
    a.ids = p.topk_ids.data;
    a.ldi = p.topk_ids.ld;
    a.ids64 = p.topk_ids.dtype == DType::I64;
    a.K = p.topk_ids.cols;
    a.lp = reinterpret_cast<const float*>(p.topk_lp.data);
    a.ldlp = p.topk_lp.ld;
  } else {
    a.t = p.teacher.data;
    a.ldt = p.teacher.ld;
    a.t_off = round16(slice_cols(V, pl.C) * int64_t(dtype_size(p.student.dtype)));
  }
  a.targets = p.targets ? p.targets.data : nullptr;
  a.tgt64 = p.targets && p.targets.dtype == DType::I64;
  a.ignore_index = p.o.ignore_index;
  a.ds = p.dstudent ? p.dstudent.data : nullptr;
  a.ldd = p.dstudent ? p.dstudent.ld : 0;
  a.grad = p.grad_loss ? reinterpret_cast<const float*>(p.grad_loss.data) : nullptr;
  a.grad_scalar = p.grad_loss && p.grad_loss.scalar;
  a.count = ws.count;
  a.row_loss = reduced ? ws.row_loss : reinterpret_cast<float*>(p.loss.data);
  a.row_used = ws.row_used;
  a.slot_val = ws.slot_val;
  a.reduction = p.o.reduction;
  const int div = effective_div(p);
  a.div = div;
  a.beta = p.o.beta;
  a.inv_t = 1.f / p.o.temperature;
  a.temperature = p.o.temperature;
  a.t2 = p.o.scale_by_t2 ? p.o.temperature * p.o.temperature : 1.f;
  a.N = N;
  a.V = V;
  a.C = pl.C;
  a.cluster = pl.cluster;
  a.ws0 = ws.ws0;
  a.ws1 = ws.ws1;
  a.ws2 = ws.ws2;

  if (ws.count) {
    check(cudaMemsetAsync(ws.count, 0, sizeof(int), s), "cudaMemsetAsync (KD row count)");
    const int64_t blocks = (N + 7) / 8;
    kd_count_kernel<<<unsigned(blocks), 256, 0, s>>>(a, ws.count);
    check_launch("KD row-count kernel");
  }
  dispatch_float(p.student.dtype, [&](auto stag) {
    using Ts = decltype(stag);
    const unsigned grid = unsigned(N < (int64_t(1) << 30) ? N : (int64_t(1) << 30));
    switch (plan.path) {
      case KdPath::Renorm:
        kd_topk_renorm_kernel<Ts><<<grid, pl.threads, 0, s>>>(a);
        check_launch("KD top-K kernel");
        break;
      case KdPath::Onepass:
        if (p.topk()) {
          kd_topk_onepass_kernel<Ts><<<grid, kKdThreads, 0, s>>>(a);
          check_launch("KD top-K kernel");
          break;
        }
        dispatch_float(p.teacher.dtype, [&](auto ttag) {
          using Tt = decltype(ttag);
          if (div == FCE_KD_FORWARD_KL) kd_kl_onepass_kernel<Ts, Tt, FCE_KD_FORWARD_KL><<<grid, kKdThreads, 0, s>>>(a);
          else kd_kl_onepass_kernel<Ts, Tt, FCE_KD_REVERSE_KL><<<grid, kKdThreads, 0, s>>>(a);
        });
        check_launch("KD kernel");
        break;
      case KdPath::Pipe:
      case KdPath::PipeC1: {
        const int64_t vecs = V * int64_t(sizeof(Ts)) / 16;
        const int64_t fit = pipe_smem(h->caps) / 32;  // both rows' slots
        const int C = plan.pipe_blocks;
        const int64_t slice = (vecs + C - 1) / C;
        const int64_t cache_vecs = slice < fit ? slice : fit;
        const size_t smem = size_t(cache_vecs) * 32;
        void (*kernel)(const KdArgs, int64_t) = nullptr;
        auto pick = [&](auto cc) {
          constexpr int CC = decltype(cc)::value;
          kernel = div == FCE_KD_FORWARD_KL ? kd_kl_grad_pipe_kernel<Ts, FCE_KD_FORWARD_KL, CC>
                                            : kd_kl_grad_pipe_kernel<Ts, FCE_KD_REVERSE_KL, CC>;
        };
        if (C == 2) pick(std::integral_constant<int, 2>{});
        else pick(std::integral_constant<int, 1>{});
        check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)),
              "cudaFuncSetAttribute");
        // Persistent clusters (blocks when C = 1): as few as give the same rows each as all that fit at once.
        const int sm = h->caps.sm_count > 0 ? h->caps.sm_count : 1;
        int64_t groups = C > 1 ? max_active_clusters(h, reinterpret_cast<const void*>(kernel), C, 1024, smem) : sm;
        if (groups <= 0) groups = sm / C > 0 ? sm / C : 1;
        const int64_t rows_each = (N + groups - 1) / groups;
        const int64_t g = (N + rows_each - 1) / rows_each;
        RowPlan lp;
        lp.C = C;
        lp.cluster = C > 1;
        lp.threads = 1024;
        lp.smem = smem;
        lp.resident = false;
        launch_grid(kernel, lp, g * C, s, "KD kernel", false, a, cache_vecs);
        break;
      }
      case KdPath::Rows:
        if (p.topk()) {
          if (pl.resident) run_phases(kd_topk_kernel<Ts, true>, pl, N, a, s, "KD top-K kernel");
          else run_phases(kd_topk_kernel<Ts, false>, pl, N, a, s, "KD top-K kernel");
          break;
        }
        dispatch_float(p.teacher.dtype, [&](auto ttag) {
          using Tt = decltype(ttag);
          if (!pl.resident) {
            run_phases(kd_full_kernel<Ts, Tt, -1, false>, pl, N, a, s, "KD kernel");
          } else if (div == FCE_KD_FORWARD_KL) {
            run_phases(kd_full_kernel<Ts, Tt, FCE_KD_FORWARD_KL, true>, pl, N, a, s, "KD kernel");
          } else if (div == FCE_KD_REVERSE_KL) {
            run_phases(kd_full_kernel<Ts, Tt, FCE_KD_REVERSE_KL, true>, pl, N, a, s, "KD kernel");
          } else {
            run_phases(kd_full_kernel<Ts, Tt, FCE_KD_JSD, true>, pl, N, a, s, "KD kernel");
          }
        });
        break;
    }
  });
  if (reduced) {
    kd_finalize_kernel<<<1, 1024, 0, s>>>(ws.row_loss, ws.row_used, N, p.o.reduction == FCE_REDUCTION_MEAN,
                                          reinterpret_cast<float*>(p.loss.data));
    check_launch("KD finalize kernel");
  }
}

}  // namespace fce::cuda
