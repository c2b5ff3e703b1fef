// Device primitives of a row split across C blocks (softmax, KD): cluster barriers
// and peers, the per-phase exchange of partials (distributed shared memory in a cluster, or the workspace
// between phased launches), and the slice loaders and visitors of resident rows.
#pragma once
#include <cooperative_groups.h>

#include <climits>
#include <type_traits>

#include "cuda/common.cuh"
#include "cuda/online_softmax.cuh"
#include "cuda/plan.hpp"

namespace fce::cuda {
namespace {

// ==== row machinery =================================================================================

constexpr int kLoadUnroll = 8;                    // 16-byte loads in flight per thread loading a slice

extern __shared__ uint4 g_smem[];  // resident row slices

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
  // Thread 0 reads the C partials (C remote loads, not C per thread) and hands the merge to its block.
  P* slot = exchange_slot<P, kTag>();
  P* merged = exchange_slot<P, kTag + 64>();
  if (threadIdx.x == 0) *slot = v;
  cluster_sync_all();
  if (threadIdx.x == 0) {
    P t = cluster_peer(slot, 0);
    for (int r = 1; r < c.C; ++r) t.merge(cluster_peer(slot, r));
    *merged = t;
  }
  __syncthreads();
  v = *merged;
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

// Visits a resident slice sm[0, n): f(v, e, cnt) with cnt = G (G consecutive values, one shared load of
// G * sizeof(T) bytes: 16, or 8 where the caller stores G fp32 values of 16-bit T as one 16-byte vector)
// or 1 (tail).
template <class T, int G = kVec<T>, class F>
__device__ __forceinline__ void smem_visit(const T* sm, int n, F&& f) {
  using V = typename VecOf<G * int(sizeof(T))>::type;
  const int ng = n / G;
  const V* sv = reinterpret_cast<const V*>(sm);
  for (int g = threadIdx.x; g < ng; g += blockDim.x) {
    float v[G];
    unpack_words<T>(sv[g], v);
    f(v, g * G, G);
  }
  for (int e = ng * G + threadIdx.x; e < n; e += blockDim.x) {
    float v[G];
    v[0] = to_float(sm[e]);
    f(v, e, 1);
  }
}

}  // namespace
}  // namespace fce::cuda
