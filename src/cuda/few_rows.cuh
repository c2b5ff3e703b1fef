// Device primitives of few rows held in registers (logsumexp, CE forward, softmax): register-resident
// slices, their online-softmax partials (shifted form, online_softmax.cuh) and the cluster exchange (one
// push per row).
#pragma once
#include "cuda/rows.cuh"

namespace fce::cuda {
namespace {

// ---- few rows: register-resident slices, one cluster of C blocks per row ------------------------------
// A thread holds R 16-byte slots of its block's slice in registers (slot_col: one vector each, or two half
// vectors for fp32 output). The slice starts 16-byte aligned; a last partial vector is read element by
// element and padded with -inf (which changes no max or sum), as are the slots past the slice.
// Decode-sized calls are latency-bound: these kernels keep to one __syncthreads and one exchange (the
// partials are pushed, not pulled; few_merge), 32-bit slice arithmetic and the partial vector read out of
// line (docs/lab-notes.md, "Kernel choices").
template <class T>
__device__ __forceinline__ T neg_inf_of() {
  if constexpr (std::is_same_v<T, float>) return -INFINITY;
  else if constexpr (std::is_same_v<T, __half>) return __ushort_as_half(0xfc00u);
  else return __ushort_as_bfloat16(0xff80u);
}

struct FewCtx {
  int rank, n;     // block rank in the row's cluster, columns in its slice
  int64_t row, begin;
};

// The block's rank in its cluster and the cluster's index along x: special registers, where blockIdx.x % C
// and blockIdx.x / C put two integer divisions at the head of every warp, before its first load (latency
// the few-row kernels pay in full; see few_ctx). A launch without clusters is rank 0 of row blockIdx.x.
__device__ __forceinline__ int cluster_rank_of(int C) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (C > 1) {
    unsigned r;
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return int(r);
  }
#endif
  return 0;
}
__device__ __forceinline__ unsigned cluster_index_x(int C) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (C > 1) {
    unsigned r;
    asm("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    return r;
  }
#endif
  return blockIdx.x;
}

// C blocks per row (1..kMaxFewCluster); slices as split_range (multiples of 64 columns, so 16-byte aligned
// starts), `chunk` = slice_cols(V, C) from the host; the slices of a register-resident row fit 32-bit indices
// (plan_regs). No division here: the kernels' loads wait on this.
__device__ __forceinline__ FewCtx few_ctx(int64_t V, int C, int chunk) {
  FewCtx f;
  f.rank = cluster_rank_of(C);
  f.row = int64_t(cluster_index_x(C));
  const int v = int(V);
  const int b = min(chunk * f.rank, v);
  f.begin = b;
  f.n = min(b + chunk, v) - b;
  return f;
}

// The last, partial vector of a slice (cnt < kVec values), padded with -inf. Out of line: one thread of a
// row at most runs it.
template <class T>
__device__ __noinline__ uint4 load_partial_vec(const T* __restrict__ src, int cnt) {
  alignas(16) T el[kVec<T>];
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) el[k] = k < cnt ? src[k] : neg_inf_of<T>();
  return *reinterpret_cast<const uint4*>(el);
}

// Register slot layout of the lean kernels. kHalf = false: slot r is the 16-byte vector threadIdx.x + r *
// blockDim.x of the slice. kHalf = true: slot r holds two 8-byte half vectors, numbers threadIdx.x + (2r + h) *
// blockDim.x (h = 0, 1) in 8-byte units, so that writing a half's values as fp32 is one 16-byte store and a
// warp's store covers 512 contiguous bytes (two 16-byte stores 32 bytes apart per thread leave each store
// instruction half of every sector it touches, measurably slower).
// Values per store when T is written as O: a 16-byte vector of the narrower type (half a vector of T for
// fp32 out of 16-bit in, which the kernels then read 8 bytes at a time; see above).
template <class T, class O>
constexpr int kStoreGroup = kVec<T> < kVec<O> ? kVec<T> : kVec<O>;

// First column of half h of slot r (h = 0 only without kHalf).
template <class T, bool kHalf>
__device__ __forceinline__ int slot_col(int r, int h) {
  if constexpr (kHalf) return int(threadIdx.x + (2 * r + h) * blockDim.x) * (kVec<T> / 2);
  else return int(threadIdx.x + r * blockDim.x) * kVec<T>;
}

// reg_load for the lean kernels: slots (halves) past the slice hold -inf.
template <class T, int R, bool kHalf = false>
__device__ __forceinline__ void reg_load_lean(const T* __restrict__ src, int n, uint4 (&raw)[R]) {
  constexpr int K = kVec<T>;
  // Every slot inside the slice (all threads but the last few of a slice): the loads back to back, with no
  // per-slot test between them.
  if (slot_col<T, kHalf>(R - 1, kHalf ? 1 : 0) + (kHalf ? K / 2 : K) <= n) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if constexpr (kHalf) {
        const uint2 a = __ldg(reinterpret_cast<const uint2*>(src + slot_col<T, true>(r, 0)));
        const uint2 b = __ldg(reinterpret_cast<const uint2*>(src + slot_col<T, true>(r, 1)));
        raw[r] = make_uint4(a.x, a.y, b.x, b.y);
      } else {
        raw[r] = __ldg(reinterpret_cast<const uint4*>(src + slot_col<T, false>(r, 0)));
      }
    }
    return;
  }
  unsigned w;  // -inf in every element of a 32-bit word
  if constexpr (sizeof(T) == 4) {
    w = __float_as_uint(-INFINITY);
  } else {
    const T ninf = neg_inf_of<T>();
    const unsigned short nb = *reinterpret_cast<const unsigned short*>(&ninf);
    w = unsigned(nb) << 16 | nb;
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if constexpr (kHalf) {
      uint2 h[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const int e0 = slot_col<T, true>(r, i);
        if (e0 + K / 2 <= n) {
          h[i] = __ldg(reinterpret_cast<const uint2*>(src + e0));
        } else if (e0 < n) {
          const uint4 p = load_partial_vec<T>(src + e0, n - e0);
          h[i] = make_uint2(p.x, p.y);
        } else {
          h[i] = make_uint2(w, w);
        }
      }
      raw[r] = make_uint4(h[0].x, h[0].y, h[1].x, h[1].y);
    } else {
      const int e0 = slot_col<T, false>(r, 0);
      if (e0 + K <= n) raw[r] = __ldg(reinterpret_cast<const uint4*>(src + e0));
      else if (e0 < n) raw[r] = load_partial_vec<T>(src + e0, n - e0);
      else raw[r] = make_uint4(w, w, w, w);
    }
  }
}

// Any NaN among a thread's register slots (its rare path: none of its values is finite).
template <class T, int R>
__device__ __forceinline__ bool regs_have_nan(const uint4 (&raw)[R]) {
  bool nan = false;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float v[kVec<T>];
    unpack_words<T>(raw[r], v);
#pragma unroll
    for (int k = 0; k < kVec<T>; ++k) nan |= isnan(v[k]);
  }
  return nan;
}

// Row statistics from the blocks' partials: raw max m and d = sum 2^((x - m) c) of each slice.
struct FewStats {
  float m, d;  // row max (raw) and sum 2^((x - m) c) over the row
  bool nan;    // a NaN logit somewhere in the row
};

// The cluster exchange of the few-row kernels. Each block's partials go straight into the shared memory of
// the blocks that need them (every block of the row, or only rank 0 where one block writes the result) by
// st.async, whose arrival counts on the receiver's mbarrier (complete_tx): a receiver waits on its own
// mbarrier for the bytes of all C blocks, and nobody waits on a cluster-wide barrier after the push (the
// barrier was slower: docs/lab-notes.md, "Kernel choices").
// A receiver leaves only once everything sent to it has arrived, so no block writes into one that has left.
// Senders must not write before the receivers have initialized their mbarriers: every thread arrives on the
// cluster barrier first thing (few_arrive, after the initialization) and waits just before the push
// (few_merge), by when the peers have long arrived, so the wait costs nothing.
__device__ __forceinline__ unsigned long long* few_mbar() {
  __shared__ alignas(8) unsigned long long bar;
  return &bar;
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Waits until this block's exchange mbarrier (few_mbar) completes its first phase: every byte the peers
// send with st.async has arrived and is visible (sm_90).
__device__ __forceinline__ void few_wait_arrivals(unsigned bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n\t.reg .pred p;\n"
      "FEW_WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], 0;\n\t"
      "@!p bra FEW_WAIT_%=;\n\t}" ::"r"(bar)
      : "memory");
#endif
}

// kAll: every block receives the partials; otherwise rank 0 only. A receiver's mbarrier is initialized and
// armed with its one arrival and the C partials' bytes before the block arrives on the cluster barrier, so
// before any peer can send.
template <bool kAll>
__device__ __forceinline__ void few_arrive(int C, unsigned bytes_per_block = 8) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (C > 1) {
    if (threadIdx.x < 32 && (kAll || cluster_rank_of(C) == 0)) {
      const unsigned bar = smem_addr(few_mbar());
      if (threadIdx.x == 0) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar) : "memory");
      // The compiler may issue the init once for the warp (uniform datapath), which compute-sanitizer's
      // racecheck then takes for another lane's write: order it before lane 0's arrive for the tool.
      __syncwarp();
      if (threadIdx.x == 0) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(unsigned(C) * bytes_per_block)
                     : "memory");
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      }
    }
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
  }
#endif
}

// The row statistics from the cluster's partials: the block's partial (the same in every thread) goes from
// threads 0..C-1 into slot `rank` of each receiver; then lane i of every warp of a receiver takes slot i and
// the warp merges them, the same fixed order in every block (bitwise the same statistics everywhere). A slice
// whose max is not finite reports d = NaN if it holds a NaN, else 0. Call from every thread, after
// few_arrive<kAll>; without kAll, blocks other than rank 0 get no statistics (the result is meaningless
// there) and must not use them.
template <bool kAll>
__device__ __forceinline__ FewStats few_merge(OnlineSoftmax part, float c, int C, int rank) {
  static_assert(kMaxFewCluster <= 32, "one slot per lane");
  __shared__ float2 slot[kMaxFewCluster];
  const int lane = int(threadIdx.x & 31u);
  const float2 v = make_float2(part.m, part.d);
  if (C > 1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    const bool receiver = kAll || rank == 0;
    const unsigned bar = smem_addr(few_mbar());
    // Every receiver is armed (few_arrive). Each thread that goes on waits here (threads that leave need
    // not): one that arrived on a cluster-barrier phase waits on it before arriving again, as in
    // softmax_row_general's cluster sync. A build with only warp 0 waiting, at the kernel's head, hung under
    // racecheck, most likely for that reason.
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
    if (int(threadIdx.x) < (kAll ? C : 1)) {  // thread i sends to block i
      unsigned rs, rb;
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rs) : "r"(smem_addr(slot + rank)), "r"(threadIdx.x));
      asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rb) : "r"(bar), "r"(threadIdx.x));
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];" ::"r"(rs),
                   "f"(v.x), "f"(v.y), "r"(rb)
                   : "memory");
    }
    if (!receiver) return FewStats{};
    few_wait_arrivals(bar);
#else
    __trap();
#endif
  } else {
    if (threadIdx.x == 0) slot[0] = v;
    __syncthreads();
  }
  const int g = merge_group(C), i = lane & (g - 1);
  const float2 w = i < C ? slot[i] : make_float2(-INFINITY, 0.f);
  const OnlineSoftmax s = warp_merge_all({w.x, w.y}, c, g);
  FewStats t;
  t.m = s.m;
  t.d = s.d;
  t.nan = isnan(s.d);  // a NaN partial survives the merges; +inf and -inf parts give none
  return t;
}

// The cluster exchange for a payload P of whole 16-byte words (the split rows' CeAcc), gathered at rank 0:
// after few_arrive<false>(C, sizeof(P)), thread 0 of every block sends its P into slot `rank` of rank 0,
// whose warp 0 waits for all C and gets the slots (in rank order, for a fixed merge order); nullptr
// elsewhere. Call from warp 0 (the other warps may have left).
template <class P>
__device__ __forceinline__ const P* few_gather_rank0(const P& v, int C, int rank) {
  static_assert(sizeof(P) % 16 == 0 && alignof(P) <= 16, "16-byte words");
  __shared__ alignas(16) unsigned char slot[kMaxGatherCluster * sizeof(P)];
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const unsigned bar = smem_addr(few_mbar());
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");  // rank 0's mbarrier is armed (few_arrive)
  if (threadIdx.x == 0) {
    unsigned rs, rb;
    asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(rs) : "r"(smem_addr(slot + rank * sizeof(P))));
    asm volatile("mapa.shared::cluster.u32 %0, %1, 0;" : "=r"(rb) : "r"(bar));
    const uint4* w = reinterpret_cast<const uint4*>(&v);
#pragma unroll
    for (int i = 0; i < int(sizeof(P) / 16); ++i)
      asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                       rs + 16 * i),
                   "r"(w[i].x), "r"(w[i].y), "r"(w[i].z), "r"(w[i].w), "r"(rb)
                   : "memory");
  }
  if (rank != 0) return nullptr;
  few_wait_arrivals(bar);
  return reinterpret_cast<const P*>(slot);
#else
  (void)v; (void)C; (void)rank;
  __trap();
  return nullptr;
#endif
}

// A thread's partial over its register slots (the slice's n values): the whole slice is in registers, so
// the max over its own values comes first and the shifted terms are summed at it, with no rescale (and no
// block-wide max to wait for).
template <class T, int R, bool kHalf = false>
__device__ __forceinline__ OnlineSoftmax thread_partial(const uint4 (&raw)[R], int n, float c) {
  constexpr int K = kVec<T>;
  float mx = -INFINITY;
#pragma unroll
  for (int r = 0; r < R; ++r) mx = fmaxf(mx, vec_max<T>(raw[r]));  // -inf padding changes nothing
  float d = 0.f;
  if (mx > -INFINITY && mx < INFINITY) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if (slot_col<T, kHalf>(r, 0) >= n) break;  // slots past the slice: no exponentials
      float v[K];
      unpack_words<T>(raw[r], v);
#pragma unroll
      for (int k = 0; k < K; ++k) d += ex2((v[k] - mx) * c);  // -inf padding adds 0
    }
  } else if (regs_have_nan<T, R>(raw)) {
    d = NAN;
  }
  return {mx, d};
}

// This block's partial over its register slots: the threads' partials merged by the block.
template <class T, int R, bool kHalf = false, bool kWarp0Only = false>
__device__ __forceinline__ OnlineSoftmax few_partial(const uint4 (&raw)[R], int n, float c) {
  return block_merge_all<kWarp0Only>(thread_partial<T, R, kHalf>(raw, n, c), c);
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

}  // namespace
}  // namespace fce::cuda
