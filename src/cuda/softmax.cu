// CUDA temperature softmax (fce_temp_softmax).
//
// A row is handled by C blocks (C = 1, 2, 4 or 8), block `rank` owning the columns split_range(V, C, rank).
// Three phases, each followed by an exchange of per-block partials that every block of the row merges
// in rank order (so all of them hold bitwise-identical row statistics):
//   phase 0  max of the raw logits, its first index, NaN flag          -> exchange 0
//   phase 1  D = sum_j exp((x_j - M)/T)                                  -> exchange 1
//   phase 2  p_j = exp((x_j - M)/T) / D and log p_j = (x_j - M)/T - log D, 16-byte stores
// How the blocks of a row work together (chosen per call by plan_rows from N, V, the dtype and the GPU):
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
// FCE_DEBUG_ROWS=nocluster|stream|split in the environment forces a fallback (to test those paths).
#include <cooperative_groups.h>

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "cuda/common.cuh"

namespace fce::cuda {
namespace {

// ==== row machinery (kd.cu has the same) =============================================================

constexpr int kMaxCluster = 8;                    // portable cluster size
constexpr size_t kSoftSmem = size_t(64) << 10;    // preferred shared bytes per block (3 blocks per SM)
constexpr int64_t kMinCols = 4096;                // fewest columns worth one more block for few rows
constexpr int kLoadUnroll = 8;                    // 16-byte loads in flight per thread loading a slice
constexpr float kLog2e = 1.4426950408889634f;

extern __shared__ uint4 g_smem[];  // resident row slices

// 2^x by the SFU (relative error ~2^-22; results below 2^-126 flush to 0).
__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float fexp(float x) { return ex2(x * kLog2e); }

// Unpacks a 16-byte vector of T by whole 32-bit words, so that a vector read from shared memory stays one
// 16-byte load (reinterpreting it element by element lets the compiler split it into 2-byte loads).
template <class T>
__device__ __forceinline__ void unpack_words(const uint4& raw, float (&v)[kVec<T>]) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) v[i] = __uint_as_float(w[i]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      v[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
      v[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  }
}

__device__ __forceinline__ void cluster_sync_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // never launched as a cluster below sm_90 (see clusters_available)
#else
  cooperative_groups::this_cluster().sync();
#endif
}

template <class P>
__device__ __forceinline__ P cluster_peer(P* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();
  return *p;
#else
  return *cooperative_groups::this_cluster().map_shared_rank(p, rank);
#endif
}

// One shared slot per exchange (raw storage: no constructor may run for a __shared__ variable).
template <class P, int kTag>
__device__ __forceinline__ P* exchange_slot() {
  __shared__ alignas(alignof(P)) unsigned char buf[sizeof(P)];
  return reinterpret_cast<P*>(buf);
}

// Where this block stands: its row, rank among the C blocks of the row, and the phases [p0, p1] this
// launch runs (fused launches run all of them).
struct RowCtx {
  int64_t row;
  int C, rank, p0, p1;
};

// Row total of the block partial `v` (the same in every thread) after phase `e`:
//  - phase e ran in an earlier launch: merge the C partials it left in `ws`, in rank order;
//  - this launch ends with phase e: leave the partial in `ws` and return false (the caller returns);
//  - otherwise the C blocks of the cluster swap partials through distributed shared memory and each
//    merges them in rank order.
template <int kTag, class P>
__device__ __forceinline__ bool exchange(const RowCtx& c, int e, P& v, P* ws) {
  if (e < c.p0) {
    const P* w = ws + c.row * c.C;
    P t = w[0];
    for (int r = 1; r < c.C; ++r) t.merge(w[r]);
    v = t;
    return true;
  }
  if (e == c.p1) {
    if (threadIdx.x == 0) ws[c.row * c.C + c.rank] = v;
    return false;
  }
  if (c.C == 1) return true;
  P* slot = exchange_slot<P, kTag>();
  if (threadIdx.x == 0) *slot = v;
  cluster_sync_all();
  P t = cluster_peer(slot, 0);
  for (int r = 1; r < c.C; ++r) t.merge(cluster_peer(slot, r));
  v = t;
  return true;
}

// Copies src[0, n) (a row slice in global memory) to the 16-byte aligned shared buffer dst[0, n) and shows
// the values on the way: fv(raw, e) for each full 16-byte vector (elements e .. e + kVec - 1, as read) and
// fs(x, e) for single elements, e relative to the slice and increasing per thread. Global reads are 16-byte
// vectors, kLoadUnroll in flight per thread; unaligned head and tail elements are read one by one (never
// anything outside the slice). A resident slice fits in shared memory, so 32-bit indices do.
template <class T, class FV, class FS>
__device__ __forceinline__ void load_slice(const T* __restrict__ src, int n, T* __restrict__ dst, FV&& fv, FS&& fs) {
  constexpr int K = kVec<T>;
  const int head = int(unaligned_head(src, nullptr, 0, n));
  for (int e = threadIdx.x; e < head; e += blockDim.x) {
    const T x = src[e];
    dst[e] = x;
    fs(to_float(x), e);
  }
  const int nvec = (n - head) / K;
  const uint4* __restrict__ vp = reinterpret_cast<const uint4*>(src + head);
  const int step = int(blockDim.x);
  for (int base = threadIdx.x; base < nvec; base += kLoadUnroll * step) {
    uint4 raw[kLoadUnroll];
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      const int i = base + u * step;
      if (i < nvec) raw[u] = __ldg(vp + i);
    }
#pragma unroll
    for (int u = 0; u < kLoadUnroll; ++u) {
      const int i = base + u * step;
      if (i < nvec) {
        const int e0 = head + i * K;
        if (head == 0) {
          reinterpret_cast<uint4*>(dst)[i] = raw[u];
        } else {  // the slice starts off a 16-byte boundary: shared memory keeps element e at offset e
          const T* el = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
          for (int k = 0; k < K; ++k) dst[e0 + k] = el[k];
        }
        fv(raw[u], e0);
      }
    }
  }
  for (int e = head + nvec * K + threadIdx.x; e < n; e += blockDim.x) {
    const T x = src[e];
    dst[e] = x;
    fs(to_float(x), e);
  }
}

// Visits a resident slice sm[0, n): f(v, e, cnt) with cnt = kVec (16-byte shared loads) or 1 (tail).
template <class T, class F>
__device__ __forceinline__ void smem_visit(const T* sm, int n, F&& f) {
  constexpr int K = kVec<T>;
  const int ng = n / K;
  const uint4* sv = reinterpret_cast<const uint4*>(sm);
  for (int g = threadIdx.x; g < ng; g += blockDim.x) {
    float v[K];
    unpack_words<T>(sv[g], v);
    f(v, g * K, K);
  }
  for (int e = ng * K + threadIdx.x; e < n; e += blockDim.x) {
    float v[K];
    v[0] = to_float(sm[e]);
    f(v, e, 1);
  }
}

// Stores v[0, cnt) to out[0, cnt) as O: 16-byte stores for a full group at an aligned address, else one
// element at a time. Each value is rounded once, here.
template <class O, int G>
__device__ __forceinline__ void store_vals(O* out, const float (&v)[G], int cnt) {
  constexpr int KO = kVec<O>;
  if constexpr (G % KO == 0) {
    if (cnt == G && (reinterpret_cast<uintptr_t>(out) & 15u) == 0) {
#pragma unroll
      for (int c = 0; c < G / KO; ++c) {
        float w[KO];
#pragma unroll
        for (int k = 0; k < KO; ++k) w[k] = v[c * KO + k];
        reinterpret_cast<uint4*>(out)[c] = pack<O>(w);
      }
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < G; ++k)
    if (k < cnt) out[k] = from_float<O>(v[k]);
}

// ---- host side: the plan of a call -----------------------------------------------------------------

__global__ void arch_probe_kernel() {}

// Thread-block clusters need a device that launches them and device code built for sm_90 or later (a
// build that only JIT-compiles older PTX has no cluster code).
bool clusters_available(const fce_handle* h) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices];  // 0 unknown, 1 yes, 2 no
  const int dev = h->device_id;
  const bool cacheable = dev >= 0 && dev < kMaxDevices;
  if (cacheable) {
    const int c = cache[dev].load(std::memory_order_relaxed);
    if (c) return c == 1;
  }
  int launch = 0;
  bool ok = cudaDeviceGetAttribute(&launch, cudaDevAttrClusterLaunch, dev) == cudaSuccess && launch != 0;
  if (ok) {
    cudaFuncAttributes fa{};
    ok = cudaFuncGetAttributes(&fa, arch_probe_kernel) == cudaSuccess && fa.ptxVersion >= 90;
  }
  if (!ok) cudaGetLastError();  // a failed query is an answer, not an error to report later
  if (cacheable) cache[dev].store(ok ? 1 : 2, std::memory_order_relaxed);
  return ok;
}

enum class Force { None, NoCluster, Stream, Split };

Force forced_path() {
  const char* e = std::getenv("FCE_DEBUG_ROWS");
  if (!e) return Force::None;
  if (!std::strcmp(e, "nocluster")) return Force::NoCluster;
  if (!std::strcmp(e, "stream")) return Force::Stream;
  if (!std::strcmp(e, "split")) return Force::Split;
  return Force::None;
}

struct RowPlan {
  int C = 1;              // blocks per row
  bool cluster = false;   // fused launch whose C > 1 blocks per row form a cluster
  bool resident = false;  // slices kept in shared memory
  bool phased = false;    // one launch per phase, partials through the workspace
  int threads = 256;
  size_t smem = 0;        // dynamic shared bytes per block
};

size_t round16(int64_t bytes) { return size_t((bytes + 15) / 16 * 16); }

int64_t slice_cols(int64_t V, int C) {
  int64_t b, e;
  split_range(V, C, 0, &b, &e);  // rank 0 has the widest slice
  return e - b;
}

// Threads per block: short slices get small blocks; long ones wide blocks when the blocks are few (or when
// a streamed row is long), 256 otherwise (several blocks per SM overlap their phases).
int threads_for(int64_t blocks, int64_t cols, int sm, bool streaming, int max_threads) {
  int t = 256;
  if (cols <= 1024) t = 64;
  else if (cols <= 4096) t = 128;
  else if (blocks < sm || (streaming && cols > 16384)) t = 512;
  return t < max_threads ? t : max_threads;
}

// The plan for N rows of V columns whose resident slices take `sa` (+ `sb`) bytes per column, for a kernel
// of at most `max_threads` threads per block.
RowPlan plan_rows(const fce_handle* h, int64_t N, int64_t V, int sa, int sb, int max_threads) {
  const Force force = forced_path();
  const int sm = h->sm_count > 0 ? h->sm_count : 1;
  const size_t budget = h->max_smem_optin > 8192 ? size_t(h->max_smem_optin) - 4096 : 0;  // static smem margin
  RowPlan p;
  if (force == Force::None || force == Force::NoCluster) {
    const int cmax = force == Force::None && clusters_available(h) ? kMaxCluster : 1;
    for (int C = 1; C <= cmax; C *= 2) {
      const int64_t cols = slice_cols(V, C);
      const size_t smem = round16(cols * sa) + (sb ? round16(cols * sb) : 0);
      if (smem > budget) continue;
      const bool few = N * C < 2 * int64_t(sm) && cols >= 2 * kMinCols;  // worth splitting further
      if (C < cmax && (smem > kSoftSmem || few)) continue;
      if (few && cmax == 1) break;  // no clusters: few long rows go to the phased split
      p.C = C;
      p.cluster = C > 1;
      p.resident = true;
      p.threads = threads_for(N * C, cols, sm, false, max_threads);
      p.smem = smem;
      return p;
    }
  }
  int S = split_count(h, N, V);
  if (force == Force::Stream) S = 1;
  if (force == Force::Split && S < 4) S = 4;
  p.C = S;
  p.phased = S > 1 || force == Force::Split;
  p.threads = threads_for(N * S, slice_cols(V, S), sm, true, max_threads);
  return p;
}

// Launches N rows of plan `p` (N * C blocks, or fewer that loop over the rows).
template <class Args>
void launch_rows(void (*kernel)(Args), const RowPlan& p, int64_t N, const Args& a, cudaStream_t s,
                 const char* what) {
  constexpr int64_t kMaxGrid = int64_t(1) << 30;
  int64_t grid = N * p.C;
  if (grid > kMaxGrid) grid = kMaxGrid / p.C * p.C;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(unsigned(grid));
  cfg.blockDim = dim3(unsigned(p.threads));
  cfg.dynamicSmemBytes = p.smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  if (p.cluster) {
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = unsigned(p.C);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
  }
  if (p.smem > 0)  // static shared memory counts toward the 48 KiB default too: always raise the limit
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(p.smem)),
          "cudaFuncSetAttribute");
  if (p.resident)  // the slices live in shared memory and nothing is re-read through L1: all of it shared
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared)),
          "cudaFuncSetAttribute");
  check(cudaLaunchKernelEx(&cfg, kernel, a), what);
}

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
  bool cluster;
  MaxArg* ws0;  // phased partials [N*C]
  SumF* ws1;
};

template <class T, bool kResident, class F>
__device__ __forceinline__ void sm_visit(const T* x, const T* sm, int64_t n, F&& f) {
  if constexpr (kResident) smem_visit<T>(sm, int(n), f);
  else row_visit<T>(x, 0, n, f);
}

template <class T, bool kResident>
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
    if constexpr (kResident) {
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
  const float inv_t = 1.f / temp;  // T = +inf: 0, the uniform distribution over the finite logits
  // (x - M)/T with the max of the raw logits taken first; -inf logits stay -inf (probability 0).
  auto scaled = [&](float xv) { return xv == -INFINITY ? -INFINITY : (xv - M) * inv_t; };

  // Phase 1: D = sum exp((x - M)/T).
  SumF sum;
  if (a.p0 <= 1) {
    if (!bad && !greedy) {
      sm_visit<T, kResident>(x, sm, n, [&](const float(&v)[K], int64_t, int cnt) {
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
  sm_visit<T, kResident>(x, sm, n, [&](const float(&v)[K], int64_t e0, int cnt) {
    float d[K], o[K];
#pragma unroll
    for (int k = 0; k < K; ++k) d[k] = k < cnt ? scaled(v[k]) : 0.f;
    if (pf || pt) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (bad) o[k] = NAN;
        else if (greedy) o[k] = begin + e0 + k == am ? 1.f : 0.f;  // one-hot at the first maximum
        else o[k] = fexp(d[k]) * inv_d;
      }
      if (pf) store_vals<float, K>(pf + e0, o, cnt);
      else store_vals<T, K>(pt + e0, o, cnt);
    }
    if (lf || lt) {
#pragma unroll
      for (int k = 0; k < K; ++k) {
        if (bad) o[k] = NAN;
        else if (greedy) o[k] = begin + e0 + k == am ? 0.f : -INFINITY;
        else o[k] = d[k] - log_d;
      }
      if (lf) store_vals<float, K>(lf + e0, o, cnt);
      else store_vals<T, K>(lt + e0, o, cnt);
    }
  });
}

template <class T, bool kResident>
__global__ void __launch_bounds__(512, 2) softmax_kernel(const SmArgs a) {
  const int rank = int(blockIdx.x % unsigned(a.C));
  const int64_t stride = int64_t(gridDim.x / unsigned(a.C));
  for (int64_t row = blockIdx.x / unsigned(a.C); row < a.N; row += stride) {
    softmax_row<T, kResident>(a, row, rank);
    // The next row may reuse the shared memory only once every thread (and every peer of the cluster)
    // is done with it.
    if (a.cluster) cluster_sync_all();
    else __syncthreads();
  }
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

RowPlan softmax_plan(const fce_handle* h, const SoftmaxProblem& p) {
  return plan_rows(h, p.logits.rows, p.logits.cols, int(dtype_size(p.logits.dtype)), 0, 512);
}

}  // namespace

size_t softmax_workspace(fce_handle* h, const SoftmaxProblem& p) {
  DeviceGuard guard(h->device_id);
  return softmax_layout(softmax_plan(h, p), p.logits.rows, nullptr).bytes;
}

void softmax(fce_handle* h, fce_stream_t stream, const SoftmaxProblem& p, Workspace w) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const int64_t N = p.logits.rows;
  const RowPlan pl = softmax_plan(h, p);
  const SmWorkspace ws = softmax_layout(pl, N, w.ptr);

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
  a.C = pl.C;
  a.cluster = pl.cluster;
  a.ws0 = ws.ws0;
  a.ws1 = ws.ws1;
  dispatch_float(p.logits.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (pl.phased) {
      for (int ph = 0; ph <= 2; ++ph) {
        a.p0 = a.p1 = ph;
        launch_rows(softmax_kernel<T, false>, pl, N, a, s, "softmax kernel (split rows)");
      }
    } else {
      a.p0 = 0;
      a.p1 = 2;
      if (pl.resident) launch_rows(softmax_kernel<T, true>, pl, N, a, s, "softmax kernel");
      else launch_rows(softmax_kernel<T, false>, pl, N, a, s, "softmax kernel");
    }
  });
}

}  // namespace fce::cuda
