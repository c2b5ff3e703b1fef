// Building blocks of the CUDA kernels: dtype access, vectorized row traversal, deterministic block
// reductions, and the split-row decision. Every kernel file includes this.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/handle.hpp"
#include "common/math.hpp"
#include "common/ops.hpp"
#include "cuda/cuda_util.hpp"
#include "cuda/plan.hpp"

namespace fce::cuda {

// ---- element types ----------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// Elements per 16-byte vector.
template <class T> constexpr int kVec = 16 / int(sizeof(T));

// Calls body.template operator() with the C++ type of a float dtype.
template <class F>
void dispatch_float(DType t, F&& body) {
  switch (t) {
    case DType::F32: body(float{}); break;
    case DType::BF16: body(__nv_bfloat16{}); break;
    case DType::F16: body(__half{}); break;
    default: raise(FCE_STATUS_INTERNAL_ERROR, "dispatch_float: not a float dtype");
  }
}

__device__ __forceinline__ int64_t load_index(const void* p, bool i64, int64_t i) {
  return i64 ? static_cast<const int64_t*>(p)[i] : int64_t(static_cast<const int32_t*>(p)[i]);
}

template <class T>
__device__ __forceinline__ void unpack(const uint4& raw, float (&v)[kVec<T>]) {
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) v[k] = to_float(e[k]);
}
template <class T>
__device__ __forceinline__ uint4 pack(const float (&v)[kVec<T>]) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int k = 0; k < kVec<T>; ++k) e[k] = from_float<T>(v[k]);
  return raw;
}

// Elements of row[begin, end) before the first 16-byte aligned one; the whole range when the row is not
// even element-aligned. `out`, when given, must share the alignment or everything goes the scalar way.
template <class T>
__device__ __forceinline__ int64_t unaligned_head(const T* row, const void* out, int64_t begin, int64_t end) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(row + begin);
  if (out && ((reinterpret_cast<uintptr_t>(out) ^ a) & 15u)) return end - begin;
  const int64_t head = int64_t((16u - (a & 15u)) & 15u) / int64_t(sizeof(T));
  return head < end - begin ? head : end - begin;
}

// Kernel shapes fixed at compile time (the same on every architecture; the host-side tuning is plan.cpp's
// table), each measured against its neighbours on an H100 (docs/lab-notes.md, "Kernel choices"):
constexpr int kRowUnroll = 4;     // 16-byte loads in flight per thread of a streamed row: enough to hide latency
constexpr int kRowThreads = 256;  // threads of a one-block-per-row kernel: 512 and 1024 were slower

// Visits row[begin, end) with the whole block: f(v, j0, n) gets n (1 or kVec) consecutive values starting
// at column j0, as fp32. 16-byte loads with kUnroll loads in flight per thread.
// With `cache`, the first `cache_vecs` 16-byte vectors are also stored to shared memory, for a later
// row_map over the same range to read instead of global memory (the same thread handles vector i in
// both: i % blockDim.x == threadIdx.x).
// With kFromCache, the first `cache_vecs` vectors are already in `cache` (put there by cp_async16) and are
// read from it instead.
template <class T, int kUnroll = kRowUnroll, bool kFromCache = false, class F>
__device__ __forceinline__ void row_visit(const T* __restrict__ row, int64_t begin, int64_t end, F&& f,
                                          uint4* cache = nullptr, int64_t cache_vecs = 0) {
  constexpr int K = kVec<T>;
  const int64_t head = unaligned_head(row, nullptr, begin, end);
  for (int64_t j = begin + threadIdx.x; j < begin + head; j += blockDim.x) {
    float v[K];
    v[0] = to_float(row[j]);
    f(v, j, 1);
  }
  const int64_t vb = begin + head, nvec = (end - vb) / K;
  const uint4* vp = reinterpret_cast<const uint4*>(row + vb);
  for (int64_t base = threadIdx.x; base < nvec; base += int64_t(kUnroll) * blockDim.x) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i < nvec) {
        if (kFromCache && i < cache_vecs) {
          raw[u] = cache[i];
        } else {
          raw[u] = __ldg(vp + i);
          if (!kFromCache && i < cache_vecs) cache[i] = raw[u];
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i < nvec) {
        float v[K];
        unpack<T>(raw[u], v);
        f(v, vb + i * K, K);
      }
    }
  }
  const int64_t tb = vb + nvec * K;
  if (threadIdx.x < end - tb) {
    float v[K];
    v[0] = to_float(row[tb + threadIdx.x]);
    f(v, tb + threadIdx.x, 1);
  }
}

template <int kBytes> struct VecOf;
struct alignas(32) Vec32 {  // fp32 out of 16-bit in (row_map): two 16-byte stores of 32 contiguous bytes
  uint4 lo, hi;
};
template <> struct VecOf<32> { using type = Vec32; };
template <> struct VecOf<16> { using type = uint4; };
template <> struct VecOf<8> { using type = uint2; };
template <> struct VecOf<4> { using type = unsigned; };

// Unpacks W 32-bit words of packed T's (16-bit types: the low half first), word by word, so that a vector read
// from shared memory stays one wide load (reinterpreting it element by element lets the compiler split it
// into 2-byte loads).
template <class T, int W>
__device__ __forceinline__ void unpack_word_array(const unsigned (&w)[W], float (&v)[W * 4 / int(sizeof(T))]) {
  if constexpr (sizeof(T) == 4) {
#pragma unroll
    for (int i = 0; i < W; ++i) v[i] = __uint_as_float(w[i]);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
#pragma unroll
    for (int i = 0; i < W; ++i) {
      v[2 * i] = __uint_as_float(w[i] << 16);
      v[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  } else {
#pragma unroll
    for (int i = 0; i < W; ++i) {
      v[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
      v[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
    }
  }
}
template <class T>
__device__ __forceinline__ void unpack_words(const uint4& raw, float (&v)[kVec<T>]) {
  const unsigned w[4] = {raw.x, raw.y, raw.z, raw.w};
  unpack_word_array<T, 4>(w, v);
}
template <class T>
__device__ __forceinline__ void unpack_words(const uint2& raw, float (&v)[kVec<T> / 2]) {
  const unsigned w[2] = {raw.x, raw.y};
  unpack_word_array<T, 2>(w, v);
}

// Pairwise max of two packed 16-bit T's (like fmaxf, a NaN loses to a number).
template <class T>
__device__ __forceinline__ unsigned hmax2_bits(unsigned a, unsigned b) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 r =
        __hmax2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    return *reinterpret_cast<const unsigned*>(&r);
  } else {
    const __half2 r = __hmax2(*reinterpret_cast<const __half2*>(&a), *reinterpret_cast<const __half2*>(&b));
    return *reinterpret_cast<const unsigned*>(&r);
  }
}

// Max of a 16-byte vector's values (NaN ignored unless all are NaN, as fmaxf): packed pairs for 16-bit types.
template <class T>
__device__ __forceinline__ float vec_max(const uint4& raw) {
  if constexpr (sizeof(T) == 4) {
    return fmaxf(fmaxf(__uint_as_float(raw.x), __uint_as_float(raw.y)),
                 fmaxf(__uint_as_float(raw.z), __uint_as_float(raw.w)));
  } else {
    const unsigned w = hmax2_bits<T>(hmax2_bits<T>(raw.x, raw.y), hmax2_bits<T>(raw.z, raw.w));
    float v[kVec<T>];
    unpack_words<T>(make_uint4(w, w, w, w), v);
    return fmaxf(v[0], v[1]);
  }
}

// 16-byte store with the evict-first (streaming) cache hint: output read by nobody in this kernel.
__device__ __forceinline__ void store_stream(uint4* p, const uint4& v) {
  __stcs(reinterpret_cast<int4*>(p), make_int4(int(v.x), int(v.y), int(v.z), int(v.w)));
}

// L2 eviction policies (createpolicy) and 16-byte loads under one: evict_last for data read again soon (kept
// over streaming traffic), evict_first for a last use. `ld_hint_nc` takes the read-only path (data the kernel
// never writes).
__device__ __forceinline__ unsigned long long l2_policy_evict_last() {
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ unsigned long long l2_policy_evict_first() {
  unsigned long long pol;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
  return pol;
}
__device__ __forceinline__ uint4 ld_hint_nc(const uint4* p, unsigned long long pol) {
  uint4 v;
  asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol));
  return v;
}
__device__ __forceinline__ uint4 ld_hint(const uint4* p, unsigned long long pol) {
  uint4 v;
  asm volatile("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p), "l"(pol) : "memory");
  return v;
}

// 16-byte asynchronous copy global -> shared (L1 bypassed), and waiting for this thread's copies.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
// The same under an L2 policy (l2_policy_evict_first: data used once, from shared memory).
__device__ __forceinline__ void cp_async16_first(void* smem, const void* gmem, unsigned long long policy) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "l"(policy)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Like row_visit, but f rewrites v in place and the result is stored to out[begin, end) as type O
// (kVec<T> values of O per vector, so fp32 in / bf16 out stores 8 bytes, bf16 in / fp32 out 32). `in` and `out` may be the same
// memory when T == O (in-place). Vector stores need `out` at the same alignment phase as `in`; otherwise
// the whole range goes the scalar way. With `next`, a cached vector's slot is refilled, once used, with
// vector i of `next` (the next row) by cp_async16: the copy overlaps this row's stores.
template <class T, class O, int kUnroll = 2, class F>
__device__ __forceinline__ void row_map(const T* in, O* out, int64_t begin, int64_t end, F&& f,
                                        uint4* cache = nullptr, int64_t cache_vecs = 0,
                                        const uint4* next = nullptr) {
  constexpr int K = kVec<T>;
  constexpr int kOutBytes = K * int(sizeof(O));
  using OV = typename VecOf<kOutBytes>::type;
  int64_t head = unaligned_head(in, nullptr, begin, end);
  const uintptr_t oa = reinterpret_cast<uintptr_t>(out + begin + head);
  if (oa % kOutBytes) head = end - begin;
  for (int64_t j = begin + threadIdx.x; j < begin + head; j += blockDim.x) {
    float v[K];
    v[0] = to_float(in[j]);
    f(v, j, 1);
    out[j] = from_float<O>(v[0]);
  }
  const int64_t vb = begin + head, nvec = (end - vb) / K;
  const uint4* vp = reinterpret_cast<const uint4*>(in + vb);
  OV* op = reinterpret_cast<OV*>(out + vb);
  for (int64_t base = threadIdx.x; base < nvec; base += int64_t(kUnroll) * blockDim.x) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i < nvec) raw[u] = i < cache_vecs ? cache[i] : vp[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + int64_t(u) * blockDim.x;
      if (i < nvec) {
        float v[K];
        unpack<T>(raw[u], v);
        f(v, vb + i * K, K);
        OV o;
        O* e = reinterpret_cast<O*>(&o);
#pragma unroll
        for (int k = 0; k < K; ++k) e[k] = from_float<O>(v[k]);
        op[i] = o;
        if (next && i < cache_vecs) cp_async16(cache + i, next + i);
      }
    }
  }
  const int64_t tb = vb + nvec * K;
  if (threadIdx.x < end - tb) {
    float v[K];
    v[0] = to_float(in[tb + threadIdx.x]);
    f(v, tb + threadIdx.x, 1);
    out[tb + threadIdx.x] = from_float<O>(v[0]);
  }
}

// ---- deterministic reductions -----------------------------------------------------------------------
// S provides `S shfl_down(unsigned) const` and `void merge(const S&)`; the tree shape is fixed, so the
// result is bitwise repeatable.
template <class S>
__device__ __forceinline__ S warp_reduce(S v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v.merge(v.shfl_down(off));
  return v;
}

// Result valid in thread 0 (and broadcast to all threads when `broadcast`). smem: 32 S's.
template <class S>
__device__ __forceinline__ S block_reduce(S v, S* smem, bool broadcast = true) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = warp_reduce(v);
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  if (warp == 0) {
    S w = lane < nwarps ? smem[lane] : S();
    w = warp_reduce(w);
    if (lane == 0) smem[0] = w;
  }
  __syncthreads();
  S r = smem[0];
  if (broadcast) __syncthreads();  // smem may be reused right after
  return r;
}

// Shared scratch for block_reduce of S (raw storage: S's constructor must not run as a static initializer).
template <class S>
__device__ __forceinline__ S* reduce_scratch() {
  __shared__ alignas(alignof(S)) unsigned char buf[32 * sizeof(S)];
  return reinterpret_cast<S*>(buf);
}

template <class S>
__device__ __forceinline__ S block_reduce(S v, bool broadcast = true) {
  return block_reduce(v, reduce_scratch<S>(), broadcast);
}

struct SumF {
  float s = 0.f;
  __device__ SumF() {}
  __device__ explicit SumF(float x) : s(x) {}
  __device__ SumF shfl_down(unsigned off) const { return SumF(__shfl_down_sync(0xffffffffu, s, off)); }
  __device__ void merge(const SumF& o) { s += o.s; }
};

// An fp64 sum for the fixed-order reductions over rows (the finalize kernels, mean denominators).
struct SumD {
  double s = 0;
  __device__ SumD() {}
  __device__ explicit SumD(double x) : s(x) {}
  __device__ SumD shfl_down(unsigned off) const { return SumD(__shfl_down_sync(0xffffffffu, s, off)); }
  __device__ void merge(const SumD& o) { s += o.s; }
};

// The fixed-order fp64 sum of x[0..n) shared by the finalize kernels of sum/mean reductions: each thread's
// strided sum, then the block's tree (block_reduce); every thread of the block gets it.
__device__ inline double block_sum_rows(const float* x, int64_t n) {
  double s = 0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  return block_reduce(SumD(s)).s;
}

// The fixed-order finalize of a SUM or MEAN over row losses, for one block (every op's finalize kernel):
// the sums in fp64 (block_sum_rows), MEAN divided by `den()`, the op's denominator computed by the whole
// block (0 gives 0). zl_rows/zloss: an optional second column (CE's z-loss).
template <class Den>
__device__ void finalize_rows(const float* loss_rows, const float* zl_rows, int64_t N, bool mean, Den&& den,
                              float* loss, float* zloss) {
  double s = block_sum_rows(loss_rows, N);
  double z = block_sum_rows(zloss ? zl_rows : nullptr, zloss ? N : 0);
  const double d = mean ? den() : 1.0;
  if (threadIdx.x == 0) {
    if (mean) {
      s = d > 0 ? s / d : 0.0;
      z = d > 0 ? z / d : 0.0;
    }
    *loss = float(s);
    if (zloss) *zloss = float(z);
  }
}

struct MaxF {
  float m = -INFINITY;
  __device__ MaxF() {}
  __device__ explicit MaxF(float x) : m(x) {}
  __device__ MaxF shfl_down(unsigned off) const { return MaxF(__shfl_down_sync(0xffffffffu, m, off)); }
  __device__ void merge(const MaxF& o) { m = fmaxf(m, o.m); }
};

// ---- launch decisions -------------------------------------------------------------------------------
inline void check_launch(const char* what) { check(cudaGetLastError(), what); }

// cudaLaunchKernelEx with the launch attributes the library uses: clusters of `cluster` blocks along x
// (none when 0), and `dependent`, a programmatic dependent launch (the kernel calls wait_prior_grid before
// it reads what the kernel before it wrote).
template <class... P, class... A>
void launch_ex(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t s, int cluster,
               bool dependent, const char* what, A&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = s;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (cluster > 0) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = unsigned(cluster);
    attr[n].val.clusterDim.y = 1;
    attr[n].val.clusterDim.z = 1;
    ++n;
  }
  if (dependent) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  check(cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...), what);
}

// Programmatic dependent launch (sm_90 and later; nothing before): a kernel launched with the
// programmatic-serialization attribute waits here until the previous kernel of its stream has finished
// and its writes are visible; that kernel may let it launch early.
__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

inline cudaStream_t stream_of(fce_stream_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Workspace carving: 256-byte aligned sub-buffers.
struct Carver {
  char* base;
  size_t used = 0;
  explicit Carver(void* p) : base(static_cast<char*>(p)) {}
  template <class T>
  T* take(size_t count) {
    T* r = reinterpret_cast<T*>(base ? base + used : nullptr);
    used += (count * sizeof(T) + 255) / 256 * 256;
    return r;
  }
};

}  // namespace fce::cuda
