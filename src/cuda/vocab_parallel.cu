// CUDA vocabulary-parallel cross-entropy (and logsumexp's records and combine, a shard's temperature softmax
// from the whole rows' lse): a shard's records (one block per row, the CE row statistics of
// ce_kernels.cuh over the shard's real columns, with the entropy and smoothing sums only when the record
// holds or needs them), their combine (one thread per row, the records merged in
// rank order in fp64 by math.hpp's ce_combine_records, the CPU's code, then the fixed-order finalize of a
// reduction). A shard's gradient runs through cross_entropy.cu's backward kernels (CeParams col0, vt).
#include "cuda/ce_internal.hpp"
#include "cuda/ce_kernels.cuh"

namespace fce::cuda {
namespace {

// The shard's columns inside the vocabulary (the rest is padding).
int64_t real_cols(const CeOpts& o, int64_t V) {
  const int64_t left = o.vocab_total - o.vocab_start;
  return left < V ? left : V;
}

struct VpArgs {
  const void* x;
  int64_t ld, N, n, V;  // n real columns of V
  int64_t vs, vt;       // vocab_start, vocab_total
  const void* targets;
  bool t64;
  int64_t ignore_index;
  float scale, softcap, eps, zq;
  const float* weights;  // [vocab_total] or null
  float* rec;            // partial: [N, K] with row stride ldr; combine: [W * N, K] (read)
  int64_t ldr, W, K;     // K: the record's width (a prefix of kCeRecordFields)
  const double* prep;    // [0] mean denominator, [1] sum of class weights
  // combine outputs; lse [N] or [N, 2] of LsePair (lse_pair); pair: a second [N, 2] output within the library
  float *loss_rows, *zl_rows, *lse, *entropy, *pair;
  bool lse_pair;
  void* argmax;
  bool a64;
};

// kEntropy: the entropy sum (a record of 5 fields or more); kSmooth: the sum of w z (label smoothing; 0
// otherwise, which the combine then does not read).
template <class T, bool kSoftcap, bool kEntropy, bool kSmooth>
__global__ void __launch_bounds__(kRowThreads) vp_partial_kernel(VpArgs a) {
  const int64_t row = blockIdx.x;
  const T* x = static_cast<const T*>(a.x) + row * a.ld;
  CeParams p{};
  p.x = a.x;
  p.ld = a.ld;
  p.V = a.n;
  p.scale = a.scale;
  p.softcap = a.softcap;
  p.full = true;
  p.eps = a.eps;
  p.weights = a.weights ? a.weights + a.vs : nullptr;
  CeAcc s;
  if (a.n > 0) s = block_stats<T, kSoftcap, kEntropy, kSmooth, false>(p, x, 0, a.n, nullptr, 0);
  if (threadIdx.x != 0) return;
  const int64_t t = load_index(a.targets, a.t64, row);
  float zt = 0.f;
  if (t >= a.vs && t < a.vs + a.n) zt = LogitTransform(a.scale, a.softcap)(to_float(x[t - a.vs]));
  const bool nan = isnan(s.av);
  const CeRecordLayout L(a.K);
  float* r = a.rec + row * a.ldr;
  r[0] = nan ? NAN : s.m;
  r[1] = s.m == -INFINITY ? 0.f : s.d;
  r[2] = zt;
  r[3] = s.swz;
  put_range(r, L.range, a.vs, a.vs + a.n);
  if (kEntropy) r[L.s1] = s.m == -INFINITY ? 0.f : s.s1;
  if (L.arg < 0) return;
  r[L.arg] = s.av;
  r[L.arg + 1] = index_as_float(s.ai == INT64_MAX ? kNoRecordIndex : int32_t(a.vs + s.ai));
}

template <class T, bool kSoftcap>
void launch_partial(const VpArgs& a, cudaStream_t s) {
  const unsigned n = unsigned(a.N);
  const bool ent = a.K > kCeRecordLoss, smooth = a.eps > 0.f;
  if (ent && smooth) vp_partial_kernel<T, kSoftcap, true, true><<<n, kRowThreads, 0, s>>>(a);
  else if (ent) vp_partial_kernel<T, kSoftcap, true, false><<<n, kRowThreads, 0, s>>>(a);
  else if (smooth) vp_partial_kernel<T, kSoftcap, false, true><<<n, kRowThreads, 0, s>>>(a);
  else vp_partial_kernel<T, kSoftcap, false, false><<<n, kRowThreads, 0, s>>>(a);
}

// A row's outputs from its combined statistics.
__device__ void combine_finish(const VpArgs& a, int64_t i, const CeCombined& m) {
  const float lse = m.lse, ent = m.entropy;
  const int64_t t = load_index(a.targets, a.t64, i);
  float loss = 0.f, zl = 0.f;
  if (t != a.ignore_index) {
    if (t < 0 || t >= a.vt || (a.weights && !class_weight_ok(a.weights[t]))) loss = zl = NAN;
    else  // the class weights' sum enters with label smoothing only (prep holds it then)
      ce_combined_loss(m, a.weights ? a.weights[t] : 1.0, a.eps, double(a.vt),
                       a.weights && a.eps > 0.f ? a.prep[1] : double(a.vt), a.zq, &loss, &zl);
  }
  if (m.bad) loss = zl = NAN;  // shards that do not tile the vocabulary: NaN even for an ignored row
  a.loss_rows[i] = loss;
  if (a.zl_rows) a.zl_rows[i] = zl;
  if (a.lse) {
    if (a.lse_pair) reinterpret_cast<float2*>(a.lse)[i] = make_float2(m.pair.hi, m.pair.lo);
    else a.lse[i] = lse;
  }
  if (a.pair) reinterpret_cast<float2*>(a.pair)[i] = make_float2(m.pair.hi, m.pair.lo);
  if (a.entropy) a.entropy[i] = ent;
  if (a.argmax) {
    const int64_t ai = m.bad ? -1 : m.argmax == kNoRecordIndex ? 0 : m.argmax;
    if (a.a64) static_cast<int64_t*>(a.argmax)[i] = ai;
    else static_cast<int32_t*>(a.argmax)[i] = int32_t(ai);
  }
}

// One thread per row: the records of the W shards merged in rank order (fp64), the row's outputs.
__global__ void vp_combine_kernel(VpArgs a) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= a.N) return;
  combine_finish(a, i, ce_combine_records(a.rec + i * a.K, a.W, a.N * a.K, a.K, a.vt));
}

// A warp per row, for many shards of the library's own loss records (K = 4, no column range; linear CE's
// fused forward has one per 256-column tile): lane l merges shards l, l + 32, ... in order
// (ce_combine_records), then lane 0 merges the lanes' maxima, sums, target logits and sums of w z in lane
// order (fp64). A fixed order: the same bits run to run.
__global__ void vp_combine_warp_kernel(VpArgs a) {
  const int64_t i = (blockIdx.x * int64_t(blockDim.x) + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (i >= a.N) return;
  const int64_t w = a.W > lane ? (a.W - lane + 31) / 32 : 0;
  const CeCombined c = w ? ce_combine_records(a.rec + (int64_t(lane) * a.N + i) * a.K, w, 32 * a.N * a.K, a.K, 0)
                         : CeCombined{-INFINITY, NAN, 0.0, 0.0, kNoRecordIndex, {-INFINITY, 0.f}, false, 0.0};
  // Each lane's (max, log of its sum) as a record of its own: (m, e^logd), merged by lane 0 in lane order.
  float hi[32];
  double lo[32], zt = 0, swz = 0;
  for (int l = 0; l < 32; ++l) {
    hi[l] = __shfl_sync(0xffffffffu, c.pair.hi, l);
    lo[l] = __shfl_sync(0xffffffffu, c.pair.hi == c.pair.hi ? c.logd : double(NAN), l);
    zt += __shfl_sync(0xffffffffu, c.zt, l);
    swz += __shfl_sync(0xffffffffu, c.swz, l);
  }
  if (lane != 0) return;
  bool nan = false;
  float M = -INFINITY;
  for (int l = 0; l < 32; ++l) {
    if (hi[l] != hi[l] || lo[l] != lo[l]) nan = true;
    else if (hi[l] > M) M = hi[l];
  }
  double D = 0;
  for (int l = 0; l < 32; ++l)
    if (!nan && M != -INFINITY && hi[l] != -INFINITY) D += ::exp(double(hi[l]) - double(M) + lo[l]);
  CeCombined m{0.f, NAN, zt, swz, kNoRecordIndex, {NAN, NAN}, false, 0.0};
  if (nan) {
    m.lse = NAN;
  } else if (M == -INFINITY) {
    m.lse = -INFINITY;
    m.pair = {-INFINITY, 0.f};
  } else {
    m.logd = ::log(D);
    m.lse = float(double(M) + m.logd);
    m.pair = {M, float(m.logd)};
  }
  combine_finish(a, i, m);
}

// Logsumexp's record of a shard's row (math.hpp: kLseRecordFields): over the n real columns, the raw max m
// and d = sum 2^((x - m) c), c = s log2(e), merged by the block in a fixed order (block_merge_all); NaN in m
// and d when the row holds a NaN; +inf rows give m = +inf, d = 1. In raw units, so that s x never overflows.
template <class T>
__global__ void __launch_bounds__(kRowThreads) lse_partial_kernel(const T* x0, int64_t ld, int64_t n, float s,
                                                                   float* rec, int64_t ldr, int64_t vs, int64_t vt) {
  const int64_t row = blockIdx.x;
  const T* x = x0 + row * ld;
  const float c = s * kLog2e;
  OnlineSoftmax st;
  bool nan = false;
  if (n > 0)
    row_visit<T>(x, 0, n, [&](float (&v)[kVec<T>], int64_t, int cnt) {
      float g = -INFINITY;
#pragma unroll
      for (int k = 0; k < kVec<T>; ++k)
        if (k < cnt) {
          g = fmaxf(g, v[k]);
          nan |= isnan(v[k]);
        }
      st.add_shifted<kVec<T>>(v, cnt, g, c);
    });
  nan = __syncthreads_or(nan);
  st = block_merge_all(st, c);
  if (threadIdx.x != 0) return;
  float* r = rec + row * ldr;
  r[0] = nan ? NAN : st.m;
  r[1] = nan ? NAN : st.m == -INFINITY ? 0.f : st.m == INFINITY ? 1.f : st.d;
  put_range(r, kLseRange, vs, vs + n);
  r[kLseScale] = s;
  r[kLseTotal] = index_as_float(int32_t(vt));
}

__global__ void lse_combine_kernel(const float* rec, int64_t W, int64_t N, float* lse, bool lse_pair, float* pair) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= N) return;
  const LseCombined c = lse_combine_records(rec + i * kLseRecordFields, W, N * kLseRecordFields);
  if (lse) {
    if (lse_pair) reinterpret_cast<float2*>(lse)[i] = make_float2(c.pair.hi, c.pair.lo);
    else lse[i] = c.lse;
  }
  if (pair) reinterpret_cast<float2*>(pair)[i] = make_float2(c.pair.hi, c.pair.lo);
}

// A shard's probabilities (kLog: log-probabilities) from the rows' lse (ShardLogProb: from the pair, or from
// a plain lse) over the n real columns, 0 (-inf) on the padding.
template <class T, class O, bool kLog>
__global__ void __launch_bounds__(kRowThreads) softmax_shard_kernel(const T* x, int64_t ldx, O* out, int64_t ldo,
                                                                     int64_t n, int64_t V, float inv_t,
                                                                     const float* lse, bool lse_pair) {
  const int64_t row = blockIdx.x;
  const LsePair l = lse_pair ? LsePair{lse[2 * row], lse[2 * row + 1]} : LsePair{lse[row], 0.f};
  const ShardLogProb lp(l, lse_pair, inv_t);
  auto z = [&](float v, int64_t j) {
    const float y = j < n ? lp(v) : -INFINITY;
    return kLog ? y : ex2(y * kLog2e);
  };
  const T* xr = x + row * ldx;
  O* o = out + row * ldo;
  if constexpr (sizeof(T) == 2 && std::is_same_v<O, float>) {
    // fp32 out of 16-bit in: 8-byte loads, so that each thread stores 16 contiguous bytes and a warp 512 (two
    // 16-byte stores 32 bytes apart were slower: docs/lab-notes.md)
    if ((reinterpret_cast<uintptr_t>(xr) & 7) == 0 && (reinterpret_cast<uintptr_t>(o) & 15) == 0) {
      constexpr int kU = 4;  // loads in flight per thread
      const int64_t nv = V / 4;
      const uint2* xv = reinterpret_cast<const uint2*>(xr);
      float4* ov = reinterpret_cast<float4*>(o);
      for (int64_t b = threadIdx.x; b < nv; b += int64_t(kU) * blockDim.x) {
        uint2 raw[kU];
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int64_t i = b + int64_t(u) * blockDim.x;
          if (i < nv) raw[u] = __ldg(xv + i);
        }
#pragma unroll
        for (int u = 0; u < kU; ++u) {
          const int64_t i = b + int64_t(u) * blockDim.x;
          if (i < nv) {
            float v[4];
            unpack_words<T>(raw[u], v);
            ov[i] = make_float4(z(v[0], 4 * i), z(v[1], 4 * i + 1), z(v[2], 4 * i + 2), z(v[3], 4 * i + 3));
          }
        }
      }
      for (int64_t j = nv * 4 + threadIdx.x; j < V; j += blockDim.x) o[j] = z(to_float(xr[j]), j);
      return;
    }
  }
  row_map<T, O>(xr, o, 0, V, [&](float (&v)[kVec<T>], int64_t j0, int cnt) {
#pragma unroll
    for (int k = 0; k < kVec<T>; ++k)
      if (k < cnt) v[k] = z(v[k], j0 + k);
  });
}

VpArgs args_of(const CeOpts& o, const Vec& targets) {
  VpArgs a{};
  a.targets = targets.data;
  a.t64 = targets.dtype == DType::I64;
  a.ignore_index = o.ignore_index;
  a.scale = o.logit_scale;
  a.softcap = o.softcap;
  a.eps = o.label_smoothing;
  a.zq = o.z_loss_scale;
  a.weights = o.class_weights ? reinterpret_cast<const float*>(o.class_weights.data) : nullptr;
  a.vs = o.vocab_start;
  a.vt = o.vocab_total;
  return a;
}

// Combine's workspace: prep, then the row losses of a reduction.
struct CombineWorkspace {
  double* prep;
  float *loss_rows, *zl_rows;
  size_t bytes;
  CombineWorkspace(const CeCombineProblem& p, void* base) {
    Carver c(base);
    const int64_t N = p.targets.n;
    const bool reduced = p.o.reduction != FCE_REDUCTION_NONE;
    prep = ce_needs_prep(p.o) ? c.take<double>(2) : nullptr;
    loss_rows = reduced ? c.take<float>(size_t(N)) : nullptr;
    zl_rows = reduced ? c.take<float>(size_t(N)) : nullptr;
    bytes = c.used;
  }
};

}  // namespace

void ce_partial(fce_handle* h, fce_stream_t stream, const CePartialProblem& p) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  VpArgs a = args_of(p.o, p.targets);
  a.x = p.logits.data;
  a.ld = p.logits.ld;
  a.N = p.logits.rows;
  a.V = p.logits.cols;
  a.n = real_cols(p.o, a.V);
  a.rec = reinterpret_cast<float*>(p.records.data);
  a.ldr = p.records.ld;
  a.K = p.records.cols;
  dispatch_float(p.logits.dtype, [&](auto tag) {
    using T = decltype(tag);
    if (a.softcap > 0.f) launch_partial<T, true>(a, s);
    else launch_partial<T, false>(a, s);
  });
  check_launch("vocabulary-parallel partial kernel");
}

size_t ce_combine_workspace(fce_handle*, const CeCombineProblem& p) { return CombineWorkspace(p, nullptr).bytes; }

void ce_combine_rows(cudaStream_t s, const CeCombineProblem& p, const double* prep, float* loss_rows,
                     float* zl_rows, bool many_shards) {
  const int64_t N = p.targets.n;
  VpArgs a = args_of(p.o, p.targets);
  a.N = N;
  a.W = p.W;
  a.K = p.records.cols;
  a.rec = reinterpret_cast<float*>(const_cast<char*>(p.records.data));
  a.prep = prep;
  a.loss_rows = loss_rows;
  a.zl_rows = zl_rows;
  a.lse = p.lse ? reinterpret_cast<float*>(p.lse.data) : nullptr;
  a.lse_pair = p.lse.pair;
  a.pair = p.pair ? reinterpret_cast<float*>(p.pair.data) : nullptr;
  a.entropy = p.entropy ? reinterpret_cast<float*>(p.entropy.data) : nullptr;
  a.argmax = p.argmax ? p.argmax.data : nullptr;
  a.a64 = p.argmax && p.argmax.dtype == DType::I64;
  if (many_shards && a.K == kCeRecordCore && !a.entropy && !a.argmax)
    vp_combine_warp_kernel<<<unsigned((N + 3) / 4), 128, 0, s>>>(a);
  else
    vp_combine_kernel<<<unsigned((N + 127) / 128), 128, 0, s>>>(a);
  check_launch("vocabulary-parallel combine kernel");
}

void ce_combine(fce_handle* h, fce_stream_t stream, const CeCombineProblem& p, Workspace w) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const CombineWorkspace ws(p, w.ptr);
  const int64_t N = p.targets.n;
  const bool t64 = p.targets.dtype == DType::I64;
  if (ws.prep) ce_prep(s, p.o, p.targets.data, t64, N, p.o.vocab_total, ws.prep);
  const bool none = p.o.reduction == FCE_REDUCTION_NONE;
  ce_combine_rows(s, p, ws.prep, none ? reinterpret_cast<float*>(p.loss.data) : ws.loss_rows,
                  none ? (p.z_loss ? reinterpret_cast<float*>(p.z_loss.data) : nullptr) : ws.zl_rows);
  if (!none)
    ce_finalize(s, ws.loss_rows, ws.zl_rows, N, p.o.reduction, ws.prep, reinterpret_cast<float*>(p.loss.data),
                p.z_loss ? reinterpret_cast<float*>(p.z_loss.data) : nullptr);
}

void lse_partial(fce_handle* h, fce_stream_t stream, const LsePartialProblem& p) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const int64_t n = p.vocab_total - p.vocab_start < p.x.cols ? p.vocab_total - p.vocab_start : p.x.cols;
  float* rec = reinterpret_cast<float*>(p.records.data);
  dispatch_float(p.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    lse_partial_kernel<T><<<unsigned(p.x.rows), kRowThreads, 0, s>>>(reinterpret_cast<const T*>(p.x.data), p.x.ld, n,
                                                                      p.scale, rec, p.records.ld, p.vocab_start,
                                                                      p.vocab_total);
  });
  check_launch("vocabulary-parallel logsumexp partial kernel");
}

void lse_combine(fce_handle* h, fce_stream_t stream, const LseCombineProblem& p) {
  DeviceGuard guard(h->device_id);
  lse_combine_kernel<<<unsigned((p.N + 127) / 128), 128, 0, stream_of(stream)>>>(
      reinterpret_cast<const float*>(p.records.data), p.W, p.N,
      p.lse ? reinterpret_cast<float*>(p.lse.data) : nullptr, p.lse.pair,
      p.pair ? reinterpret_cast<float*>(p.pair.data) : nullptr);
  check_launch("vocabulary-parallel logsumexp combine kernel");
}

void softmax_shard(fce_handle* h, fce_stream_t stream, const SoftmaxProblem& p) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const int64_t N = p.logits.rows, V = p.logits.cols;
  const int64_t n = p.vocab_total - p.vocab_start < V ? p.vocab_total - p.vocab_start : V;
  const float inv_t = 1.f / p.temperature;
  const float* lse = reinterpret_cast<const float*>(p.lse.data);
  dispatch_float(p.logits.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* x = reinterpret_cast<const T*>(p.logits.data);
    // logprobs first: when it is the logits' memory, probs is NULL (the header's rule)
    for (const Mat* m : {&p.logprobs, &p.probs}) {
      if (!*m) continue;
      const bool log = m == &p.logprobs;
      auto launch = [&](auto otag) {
        using O = decltype(otag);
        O* out = reinterpret_cast<O*>(m->data);
        const bool pr = p.lse.pair;
        if (log) softmax_shard_kernel<T, O, true><<<unsigned(N), kRowThreads, 0, s>>>(x, p.logits.ld, out, m->ld, n, V, inv_t, lse, pr);
        else softmax_shard_kernel<T, O, false><<<unsigned(N), kRowThreads, 0, s>>>(x, p.logits.ld, out, m->ld, n, V, inv_t, lse, pr);
      };
      if (m->dtype == DType::F32) launch(float{});
      else launch(T{});
    }
  });
  check_launch("vocabulary-parallel softmax kernel");
}

}  // namespace fce::cuda
