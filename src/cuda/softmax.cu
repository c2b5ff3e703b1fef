// CUDA temperature softmax (fce_temp_softmax).
//
// A row is handled by C blocks (C = 1, 2, 4 or 8), block `rank` owning the columns split_range(V, C, rank).
// Three phases, each followed by an exchange of per-block partials that every block of the row merges
// in rank order (so all of them hold bitwise-identical row statistics):
//   phase 0  max of the raw logits, its first index, NaN flag          -> exchange 0
//   phase 1  D = sum_j exp((x_j - M)/T)                                  -> exchange 1
//   phase 2  p_j = exp((x_j - M)/T) / D and log p_j = (x_j - M)/T - log D, 16-byte stores
// How the blocks of a row work together (plan_rows, from N, V, the dtype and the GPU):
//   resident  the row's slices stay in shared memory from phase 0 on, so the row is read from DRAM once
//             and the outputs are written from shared memory: one read plus one write, the minimum. With
//             C > 1 the C blocks are one thread-block cluster (Hopper) and exchange their partials through
//             distributed shared memory; C grows until a slice fits comfortably (<= 64 KiB) and, for few
//             rows, until the GPU has ~2 blocks per SM.
//   streaming one block per row that re-reads the row from global memory in every phase (rows too long
//             for shared memory, many rows, no clusters).
//   phased    few rows too long for shared memory (or no clusters): split_count() blocks per row and one
//             launch per phase; a launch leaves its partials in the workspace and the next merges them in
//             split order.
// Every reduction has a fixed order (block_reduce trees, rank-ordered merges): bitwise repeatable.
// No float atomics, no host synchronization, no allocation; capturable in a CUDA graph.
// Calls that want probabilities only take lean kernels with one exchange of (max, sum) per row instead of
// the two above and no first-maximum index per element: softmax_smem_kernel where the resident mode applies,
// and
//   registers up to 64 rows, 16-byte aligned, probabilities only: the slices live in registers
//             (plan_regs), one launch, clusters of up to 16 blocks per row, one exchange of (max, sum)
//             (softmax_regs_kernel); rows needing the special cases fall back to the global-memory code;
//             where a block would store much, copies of the row's cluster share its stores (replicate_rows).
// fp32 output of 16-bit logits is stored 16 contiguous bytes per thread (slot_col in row_plan.cuh).
// The paths: cuda/plan.hpp (SoftmaxPath, and plan_rows for the rows path).
#include <cooperative_groups.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/row_plan.cuh"

namespace fce::cuda {
namespace {

// ==== temperature softmax ============================================================================

// Phase 0 partial: max of the raw logits (NaN left out), the first column holding it, and a NaN flag.
struct MaxArg {
  float m;
  int nan;
  long long idx;
  __device__ MaxArg() : m(-INFINITY), nan(0), idx(LLONG_MAX) {}
  __device__ void add(float x, long long j) {  // j increasing per thread: the first maximum is kept
    if (isnan(x)) nan = 1;
    else if (x > m) { m = x; idx = j; }
  }
  __device__ void merge(const MaxArg& o) {
    nan |= o.nan;
    if (o.m > m || (o.m == m && o.idx < idx)) { m = o.m; idx = o.idx; }
  }
  __device__ MaxArg shfl_down(unsigned off) const {
    MaxArg r;
    r.m = __shfl_down_sync(0xffffffffu, m, off);
    r.nan = __shfl_down_sync(0xffffffffu, nan, off);
    r.idx = __shfl_down_sync(0xffffffffu, idx, off);
    return r;
  }
};

struct SmArgs {
  const void* x;
  int64_t ldx;
  void* probs;
  int64_t ldp;
  bool probs_f32;
  void* logp;
  int64_t ldl;
  bool logp_f32;
  const float* temps;  // per-row temperatures or null
  float temperature;
  int64_t N, V;
  int C, p0, p1;
  int chunk;  // few-row kernels: slice width, slice_cols(V, C)
  bool cluster;
  MaxArg* ws0;  // phased partials [N*C]
  SumF* ws1;
};

// Where a block's slice lives between the phases.
enum Mode { kGlobal, kShared };

template <class T, int kMode, class F>
__device__ __forceinline__ void sm_visit(const T* x, const T* sm, int64_t n, F&& f) {
  if constexpr (kMode == kShared) smem_visit<T>(sm, int(n), f);
  else row_visit<T>(x, 0, n, f);
}

template <class T, int kMode>
__device__ __forceinline__ void softmax_row(const SmArgs& a, int64_t row, int rank) {
  constexpr int K = kVec<T>;
  int64_t begin, end;
  split_range(a.V, a.C, rank, &begin, &end);
  const int64_t n = end - begin;
  const T* x = static_cast<const T*>(a.x) + row * a.ldx + begin;
  T* sm = reinterpret_cast<T*>(g_smem);
  const RowCtx c{row, a.C, rank, a.p0, a.p1};
  const float temp = a.temps ? a.temps[row] : a.temperature;

  // Phase 0: max of the raw logits and its first index (the slice goes to shared memory on the way).
  MaxArg mx;
  if (a.p0 == 0) {
    if constexpr (kMode == kShared) {
      load_slice<T>(
          x, int(n), sm,
          [&](const uint4& raw, int e0) {
            float v[K];
            unpack<T>(raw, v);
#pragma unroll
            for (int k = 0; k < K; ++k) mx.add(v[k], begin + e0 + k);
          },
          [&](float xv, int e) { mx.add(xv, begin + e); });
    } else {
      row_visit<T>(x, 0, n, [&](const float(&v)[K], int64_t e0, int cnt) {
#pragma unroll
        for (int k = 0; k < K; ++k)
          if (k < cnt) mx.add(v[k], begin + e0 + k);
      });
    }
    mx = block_reduce(mx);
  }
  if (!exchange<0>(c, 0, mx, a.ws0)) return;
  // NaN row: a bad temperature (negative or NaN), a NaN logit, or no logit above -inf.
  const bool bad = !(temp >= 0.f) || mx.nan || mx.m == -INFINITY;
  const bool greedy = temp == 0.f;
  const float M = mx.m;
  // (x - M)/T with the max of the raw logits taken first, without overflow; T = +inf: the uniform
  // distribution over the finite logits.
  const SoftmaxShift scaled(M, 1.f / temp);

  // Phase 1: D = sum exp((x - M)/T).
  SumF sum;
  if (a.p0 <= 1) {
    if (!bad && !greedy) {
      sm_visit<T, kMode>(x, sm, n, [&](const float(&v)[K], int64_t, int cnt) {
#pragma unroll
        for (int k = 0; k < K; ++k)
          if (k < cnt) sum.s += fexp(scaled(v[k]));
      });
    }
    sum = block_reduce(sum);
  }
  if (!exchange<1>(c, 1, sum, a.ws1)) return;
  const float inv_d = 1.f / sum.s, log_d = logf(sum.s);
  const long long am = mx.idx;

  // Phase 2: probabilities and log-probabilities (in place allowed: each element is read before its store).
  float* pf = nullptr;
  T* pt = nullptr;
  float* lf = nullptr;
  T* lt = nullptr;
  if (a.probs) {
    if (a.probs_f32) pf = static_cast<float*>(a.probs) + row * a.ldp + begin;
    else pt = static_cast<T*>(a.probs) + row * a.ldp + begin;
  }
  if (a.logp) {
    if (a.logp_f32) lf = static_cast<float*>(a.logp) + row * a.ldl + begin;
    else lt = static_cast<T*>(a.logp) + row * a.ldl + begin;
  }
  // f(v, e0, cnt) for G = kVec or kVec / 2 values at a time
  auto write = [&](const auto& v, int64_t e0, int cnt) {
    constexpr int G = int(std::extent_v<std::remove_reference_t<decltype(v)>>);
    float d[G], o[G];
#pragma unroll
    for (int k = 0; k < G; ++k) d[k] = k < cnt ? scaled(v[k]) : 0.f;
    if (pf || pt) {
#pragma unroll
      for (int k = 0; k < G; ++k) {
        if (bad) o[k] = NAN;
        else if (greedy) o[k] = begin + e0 + k == am ? 1.f : 0.f;  // one-hot at the first maximum
        else o[k] = fexp(d[k]) * inv_d;
      }
      if (pf) store_vals<float, G>(pf + e0, o, cnt);
      else store_vals<T, G>(pt + e0, o, cnt);
    }
    if (lf || lt) {
#pragma unroll
      for (int k = 0; k < G; ++k) {
        if (bad) o[k] = NAN;
        else if (greedy) o[k] = begin + e0 + k == am ? 0.f : -INFINITY;
        else o[k] = d[k] - log_d;
      }
      if (lf) store_vals<float, G>(lf + e0, o, cnt);
      else store_vals<T, G>(lt + e0, o, cnt);
    }
  };
  // A resident slice written as fp32 from 16-bit logits: 8-byte shared loads, so that each thread stores
  // 16 contiguous bytes (see slot_col in row_plan.cuh).
  if constexpr (kMode == kShared && kStoreGroup<T, float> < K) {
    if (pf || lf) {
      smem_visit<T, kStoreGroup<T, float>>(sm, int(n), write);
      return;
    }
  }
  sm_visit<T, kMode>(x, sm, n, write);
}

template <class T, int kMode>
__global__ void __launch_bounds__(512, 2) softmax_kernel(const SmArgs a) {
  const int rank = int(blockIdx.x % unsigned(a.C));
  const int64_t stride = int64_t(gridDim.x / unsigned(a.C));
  for (int64_t row = blockIdx.x / unsigned(a.C); row < a.N; row += stride) {
    softmax_row<T, kMode>(a, row, rank);
    // The next row may reuse the shared memory only once every thread (and every peer of the cluster)
    // is done with it.
    if (a.cluster) cluster_sync_all();
    else __syncthreads();
  }
}

// The general code for a row of the few-row kernel (out of line: its registers stay out of the lean path).
template <class T>
__device__ __noinline__ void softmax_row_general(const SmArgs& a, int64_t row, int rank) {
  softmax_row<T, kGlobal>(a, row, rank);
  if (a.C > 1) cluster_sync_all();  // peers read this block's partials until here
}

// Few rows, probabilities only: one cluster of C blocks per row, the slices in registers, one cluster
// barrier (few_merge), then the probabilities from the registers. Rows that are not plain (a zero, negative,
// NaN, subnormal, infinite or above-2^100 temperature; a NaN or infinite logit; no finite logit) take the
// general code, which re-reads the slice: every block of the row agrees, as all hold bitwise the same statistics.
// gridDim.y > 1: that many copies of each row's cluster (replicate_rows), each writing the values of every
// gridDim.y-th warp; all compute bitwise the same statistics, and only copy 0 runs the general code.
// kTwo: registers for two blocks of up to kTwoThreads threads per SM (see spread_regs).
constexpr int kTwoThreads = 640;
template <class T, class O, int R, bool kTwo = false>
__global__ void __launch_bounds__(kTwo ? kTwoThreads : 1024, kTwo ? 2 : 1)
    softmax_regs_kernel(const __grid_constant__ SmArgs a) {
  constexpr int K = kVec<T>;
  constexpr int G = kStoreGroup<T, O>;  // values per store
  constexpr bool kHalf = G < K;         // fp32 out of 16-bit in: half-vector slots
  const FewCtx f = few_ctx(a.V, a.C, a.chunk);
  wait_prior_grid();  // a programmatic dependent launch: its launch overlaps the end of the kernel before
  const float temp = a.temps ? a.temps[f.row] : a.temperature;
  const T* x = static_cast<const T*>(a.x) + f.row * a.ldx + f.begin;
  O* out = static_cast<O*>(a.probs) + f.row * a.ldp + f.begin;
  uint4 raw[R];
  reg_load_lean<T, R, kHalf>(x, f.n, raw);
  few_arrive<true>(a.C);  // after the loads are issued (see lse_regs_kernel)
  // (x - max) / T in base 2: the raw max first, then the scale; 0 above kPlainMaxTemperature (the row then
  // falls back with the other rows that are not plain)
  const float c = temp <= kPlainMaxTemperature ? (1.f / temp) * kLog2e : 0.f;
  const OnlineSoftmax part = few_partial<T, R, kHalf>(raw, f.n, c);
  const FewStats t = few_merge<true>(part, c, a.C, f.rank);
  if (!(c > 0.f && c < INFINITY) || t.nan || !(t.m > -INFINITY && t.m < INFINITY)) {
    if (blockIdx.y == 0) softmax_row_general<T>(a, f.row, f.rank);
    return;
  }
  if (gridDim.y > 1 && (threadIdx.x >> 5) % gridDim.y != blockIdx.y) return;
  const float inv_d = 1.f / t.d;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float v[K];
    unpack_words<T>(raw[r], v);
#pragma unroll
    for (int h = 0; h < K / G; ++h) {
      const int e0 = slot_col<T, kHalf>(r, h);
      if (e0 < f.n) {
        float o[G];
#pragma unroll
        for (int k = 0; k < G; ++k) o[k] = ex2((v[h * G + k] - t.m) * c) * inv_d;
        store_vals<O, G>(out + e0, o, min(G, f.n - e0));
      }
    }
  }
}

// Many rows, probabilities only: the slices stay in shared memory as in the general kernel's resident mode,
// with the few-row kernels' statistics: per-thread max and sum over the thread's resident elements, merged
// once per block and once per cluster (one exchange instead of two, no first-maximum index per element).
// Rows that are not plain fall back to the general code, as in softmax_regs_kernel. One row per block.
template <class T, class O>
__global__ void __launch_bounds__(512, 2) softmax_smem_kernel(const __grid_constant__ SmArgs a) {
  constexpr int K = kVec<T>;
  few_arrive<true>(a.C);
  const FewCtx f = few_ctx(a.V, a.C, a.chunk);
  const float temp = a.temps ? a.temps[f.row] : a.temperature;
  T* sm = reinterpret_cast<T*>(g_smem);
  // (x - max) / T in base 2: the raw max first, then the scale; 0 above kPlainMaxTemperature (the row then
  // falls back with the other rows that are not plain)
  const float c = temp <= kPlainMaxTemperature ? (1.f / temp) * kLog2e : 0.f;
  // Per-thread online softmax (shifted form, raw max), as the slice streams into shared memory (the values
  // are in registers then): the max of each 16-byte vector first, one rescale per vector.
  OnlineSoftmax st;
  load_slice<T>(
      static_cast<const T*>(a.x) + f.row * a.ldx + f.begin, f.n, sm,
      [&](const uint4& raw, int) {
        float v[K];
        unpack_words<T>(raw, v);
        st.add_shifted<K>(v, K, vec_max<T>(raw), c);
      },
      [&](float xv, int) {
        const float v[1] = {xv};
        st.add_shifted<1>(v, 1, xv, c);
      });
  // block_merge_all's barrier also orders the slice's shared-memory writes before the reads below
  const FewStats t = few_merge<true>(block_merge_all(st, c), c, a.C, f.rank);
  if (!(c > 0.f && c < INFINITY) || t.nan || !(t.m > -INFINITY && t.m < INFINITY)) {
    softmax_row_general<T>(a, f.row, f.rank);
    return;
  }
  const float inv_d = 1.f / t.d;
  O* out = static_cast<O*>(a.probs) + f.row * a.ldp + f.begin;
  // fp32 out of 16-bit in: 8-byte shared loads, so that each thread stores one 16-byte vector (see slot_col)
  constexpr int G = kStoreGroup<T, O>;
  smem_visit<T, G>(sm, f.n, [&](const float(&v)[G], int e0, int cnt) {
    float o[G];
#pragma unroll
    for (int k = 0; k < G; ++k) o[k] = ex2((v[k] - t.m) * c) * inv_d;
    store_vals<O, G>(out + e0, o, cnt);
  });
}

struct SmWorkspace {
  MaxArg* ws0 = nullptr;
  SumF* ws1 = nullptr;
  size_t bytes = 0;
};

SmWorkspace softmax_layout(const RowPlan& pl, int64_t N, void* base) {
  Carver c(base);
  SmWorkspace w;
  if (pl.phased) {
    w.ws0 = c.take<MaxArg>(size_t(N) * size_t(pl.C));
    w.ws1 = c.take<SumF>(size_t(N) * size_t(pl.C));
  }
  w.bytes = c.used;
  return w;
}

// The plan of a call (src/cuda/plan.hpp: SoftmaxPath); T is the logits' type.
template <class T>
SoftmaxPlan softmax_plan(fce_handle* h, const SoftmaxProblem& p) {
  SoftmaxShape sh;
  sh.N = p.logits.rows;
  sh.V = p.logits.cols;
  sh.esize = int(sizeof(T));
  sh.out_size = p.probs && p.probs.dtype == DType::F32 ? 4 : int(sizeof(T));
  sh.probs_only = p.probs && !p.logprobs;
  sh.aligned16 = aligned16(p.logits.data, p.logits.ld, sh.esize);
  const RegKernels fit(h, reinterpret_cast<const void*>(softmax_regs_kernel<T, float, 4>));
  const RegKernels fit_two(h, reinterpret_cast<const void*>(softmax_regs_kernel<T, float, 4, true>));
  return plan_softmax(sh, h->caps, fit, fit_two, kTwoThreads);
}

}  // namespace

size_t softmax_workspace(fce_handle* h, const SoftmaxProblem& p) {
  DeviceGuard guard(h->device_id);
  const RowPlan pl = plan_rows(h->caps, p.logits.rows, p.logits.cols, int(dtype_size(p.logits.dtype)), 0, 512);
  return softmax_layout(pl, p.logits.rows, nullptr).bytes;
}

void softmax(fce_handle* h, fce_stream_t stream, const SoftmaxProblem& p, Workspace w) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const int64_t N = p.logits.rows;
  SmArgs a{};
  a.x = p.logits.data;
  a.ldx = p.logits.ld;
  a.probs = p.probs ? p.probs.data : nullptr;
  a.ldp = p.probs ? p.probs.ld : 0;
  a.probs_f32 = p.probs && p.probs.dtype == DType::F32;
  a.logp = p.logprobs ? p.logprobs.data : nullptr;
  a.ldl = p.logprobs ? p.logprobs.ld : 0;
  a.logp_f32 = p.logprobs && p.logprobs.dtype == DType::F32;
  a.temps = p.temperatures ? reinterpret_cast<const float*>(p.temperatures.data) : nullptr;
  a.temperature = p.temperature;
  a.N = N;
  a.V = p.logits.cols;
  dispatch_float(p.logits.dtype, [&](auto tag) {
    using T = decltype(tag);
    const SoftmaxPlan plan = softmax_plan<T>(h, p);
    const RowPlan& pl = plan.rows;
    const SmWorkspace ws = softmax_layout(pl, N, w.ptr);
    a.C = pl.C;
    a.cluster = pl.cluster;
    a.ws0 = ws.ws0;
    a.ws1 = ws.ws1;
    switch (plan.path) {
      case SoftmaxPath::Regs: {  // register-resident rows, probabilities only: the lean few-row kernel
        const RegPlan& rp = plan.regs;
        a.p0 = 0;
        a.p1 = 2;
        a.C = rp.C;
        a.chunk = int(slice_cols(a.V, a.C));
        a.cluster = rp.C > 1;
        const bool dependent = h->caps.clusters;  // sm_90 code on an sm_90 device
        auto launch = [&](auto r, auto two) {
          constexpr int R = decltype(r)::value;
          constexpr bool kTwo = decltype(two)::value;
          if (a.probs_f32)
            launch_rows(softmax_regs_kernel<T, float, R, kTwo>, as_row_plan(rp), N, a, s, "softmax kernel", dependent);
          else launch_rows(softmax_regs_kernel<T, T, R, kTwo>, as_row_plan(rp), N, a, s, "softmax kernel", dependent);
        };
        if (rp.two) launch(std::integral_constant<int, kMaxRegVecs>{}, std::true_type{});
        else dispatch_regs(rp.R, [&](auto r) { launch(r, std::false_type{}); });
        break;
      }
      case SoftmaxPath::Smem:  // resident slices, probabilities only: one exchange of (max, sum)
        a.p0 = 0;
        a.p1 = 2;
        a.chunk = int(slice_cols(a.V, a.C));  // a resident slice: fits
        if (a.probs_f32) launch_rows(softmax_smem_kernel<T, float>, pl, N, a, s, "softmax kernel");
        else launch_rows(softmax_smem_kernel<T, T>, pl, N, a, s, "softmax kernel");
        break;
      case SoftmaxPath::Rows:
        if (pl.phased) {
          for (int ph = 0; ph <= 2; ++ph) {
            a.p0 = a.p1 = ph;
            launch_rows(softmax_kernel<T, kGlobal>, pl, N, a, s, "softmax kernel (split rows)");
          }
        } else {
          a.p0 = 0;
          a.p1 = 2;
          if (pl.resident) launch_rows(softmax_kernel<T, kShared>, pl, N, a, s, "softmax kernel");
          else launch_rows(softmax_kernel<T, kGlobal>, pl, N, a, s, "softmax kernel");
        }
        break;
    }
  });
}

}  // namespace fce::cuda
