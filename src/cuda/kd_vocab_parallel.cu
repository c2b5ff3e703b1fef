// CUDA vocabulary-parallel knowledge distillation: a shard's records (one block per row: student and
// teacher streamed together once, each thread keeping the cross statistics of KL(P || Q) online, merged by
// the block's fixed tree), their combine (one thread per row, math.hpp's kd_combine_records in fp64 in rank
// order, the CPU's code; SUM/MEAN through kd_finalize_kernel), JSD's second exchange (a shard's sums of the
// element terms, their combine by the same kernel), and a shard's dstudent from the rows' statistics
// (KdTerm and kd_grad per element, as fce_kd_loss).
#include "cuda/kd_common.cuh"
#include "cuda/online_softmax.cuh"

namespace fce::cuda {
namespace {

// KdCross<float> for block_reduce.
struct CrossAcc : KdCross<float> {
  __device__ CrossAcc() : KdCross<float>{-INFINITY, 0.f, -INFINITY, 0.f, 0.f} {}
  __device__ explicit CrossAcc(const KdCross<float>& c) : KdCross<float>(c) {}
  __device__ void merge(const CrossAcc& o) { *this = CrossAcc(kd_cross_merge<float>(*this, o)); }
  __device__ CrossAcc shfl_down(unsigned off) const {
    CrossAcc r;
    r.mp = __shfl_down_sync(0xffffffffu, mp, off);
    r.dp = __shfl_down_sync(0xffffffffu, dp, off);
    r.mq = __shfl_down_sync(0xffffffffu, mq, off);
    r.dq = __shfl_down_sync(0xffffffffu, dq, off);
    r.x = __shfl_down_sync(0xffffffffu, x, off);
    return r;
  }
};

// e^(z - m) for z - m = zd (0 where m is -inf: nothing seen yet has probability).
__device__ __forceinline__ float shifted_exp(float zd, float m) { return m == -INFINITY ? 0.f : ex2(zd * kLog2e); }

// kRev: P is the student (reverse KL), else the teacher (forward KL). n real columns.
template <class Ts, class Tt, bool kRev>
__global__ void __launch_bounds__(kKdThreads) kd_vp_partial_kernel(const KdArgs a, int64_t start, int64_t n,
                                                                    float* rec, int64_t ldr) {
  constexpr int G = kGroup<Ts, Tt>;
  const int64_t row = blockIdx.x;
  const Ts* s = static_cast<const Ts*>(a.s) + row * a.lds;
  const Tt* t = static_cast<const Tt*>(a.t) + row * a.ldt;
  const float inv_t = a.inv_t;
  CrossAcc acc;
  visit2<Ts, Tt, false>(s, t, nullptr, nullptr, n, [&](float (&vs)[G], float (&vt)[G], int64_t, int cnt) {
    const float* vp = kRev ? vs : vt;
    const float* vq = kRev ? vt : vs;
    float gp = -INFINITY, gq = -INFINITY;
    for (int k = 0; k < cnt; ++k) {
      gp = fmaxf(gp, vp[k]);
      gq = fmaxf(gq, vq[k]);
    }
    gp *= inv_t;
    gq *= inv_t;
    if (gp > acc.mp || gq > acc.mq) {  // a new maximum: the sums shifted to it
      KdCross<float> r{fmaxf(acc.mp, gp), 0.f, fmaxf(acc.mq, gq), 0.f, 0.f};
      kd_cross_add(r, static_cast<const KdCross<float>&>(acc), r.mp, r.mq);
      acc = CrossAcc(r);
    }
    for (int k = 0; k < cnt; ++k) {
      const float zp = zdiff(vp[k], inv_t, acc.mp), zq = acc.mq == -INFINITY ? -INFINITY : zdiff(vq[k], inv_t, acc.mq);
      const float ep = shifted_exp(zp, acc.mp);
      acc.dp += ep;
      acc.dq += shifted_exp(zq, acc.mq);
      if (ep > 0.f) acc.x = __fmaf_rn(ep, zp - zq, acc.x);  // zero P-probability adds 0 (no 0 * inf)
    }
  });
  acc = block_reduce(acc, false);
  if (threadIdx.x != 0) return;
  float* r = rec + row * ldr;
  r[0] = acc.mp;
  r[1] = acc.dp;
  r[2] = acc.mq;
  r[3] = acc.dq;
  r[4] = acc.x;
  put_range(r, kKdRange, start, start + n);
}

struct CombineArgs {
  const float* rec;  // [W * N, kKdRecordFields], or kKdTermsRecordFields with `terms`
  int64_t W, N;
  int64_t vocab_total;  // the records' column ranges must tile [0, vocab_total)
  bool terms;    // the terms' records: the loss and A summed in rank order
  bool mixture;  // JSD's first combine: the statistics only, A NaN
  bool has_loss;
  const void* targets;
  bool tgt64;
  int64_t ignore_index;
  bool rev, reduced;
  float t2;
  float* row_loss;  // NONE: the loss output; else the workspace
  int* row_used;    // SUM/MEAN
  float* stats;     // [N, kKdRowStatsFields] with row stride ld_stats, or null
  int64_t ld_stats;
};

__global__ void kd_vp_combine_kernel(const CombineArgs a) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= a.N) return;
  float* s = a.stats ? a.stats + i * a.ld_stats : nullptr;
  double kl = 0;
  bool no_slot = false, bad = false;
  if (a.terms) {
    double asum = 0, slots = 0;
    bad = !ranges_tile(a.rec + i * kKdTermsRecordFields, a.W, a.N * kKdTermsRecordFields, kKdTermsRange,
                       a.vocab_total);
    for (int64_t r = 0; r < a.W; ++r) {
      const float* q = a.rec + (r * a.N + i) * kKdTermsRecordFields;
      kl += double(q[0]);
      asum += double(q[1]);
      slots += double(q[2]);
    }
    const bool dense = a.rec[i * kKdTermsRecordFields + 2] < 0.f;  // full teacher logits
    no_slot = !dense && slots == 0;  // a top-K row without a used slot: masked
    // A dense KL's A as the one-exchange combine forms it (sum q = 1 exactly: identical rows keep a 0
    // gradient); a top-K teacher's sums its slots' a_k, as fce_kd_loss does.
    s[4] = bad ? NAN : a.mixture || !dense ? float(asum) : a.rev ? float(kl + 1.0) : -1.f;
  } else {
    const KdCombined k = kd_combine_records(a.rec + i * kKdRecordFields, a.W, a.N * kKdRecordFields, a.vocab_total);
    kl = k.kl;
    bad = k.bad;
    if (s) {
      s[0] = a.rev ? k.mp : k.mq;  // the student's shift
      s[1] = a.rev ? k.logdp : k.logdq;
      s[2] = a.rev ? k.mq : k.mp;  // the teacher's
      s[3] = a.rev ? k.logdq : k.logdp;
      // A = sum_j a_j (KdTerm): KL + sum q, or -sum p; JSD's comes from the terms' combine.
      s[4] = a.mixture || k.bad ? NAN : a.rev ? float(k.kl + 1.0) : -1.f;
    }
  }
  if (!a.has_loss) return;
  // Shards that do not tile the vocabulary: NaN, masked or not.
  const bool masked = !bad && ((a.targets && load_index(a.targets, a.tgt64, i) == a.ignore_index) || no_slot);
  a.row_loss[i] = bad ? NAN : masked ? 0.f : float(kl) * a.t2;
  if (a.reduced) a.row_used[i] = !masked;
}

// The terms' sums of a block's threads, merged by its fixed tree.
struct TermsAcc {
  float l = 0.f, a = 0.f;
  __device__ TermsAcc() {}
  __device__ void merge(const TermsAcc& o) {
    l += o.l;
    a += o.a;
  }
  __device__ TermsAcc shfl_down(unsigned off) const {
    TermsAcc r;
    r.l = __shfl_down_sync(0xffffffffu, l, off);
    r.a = __shfl_down_sync(0xffffffffu, a, off);
    return r;
  }
};

// One block per row: the shard's sums of the element terms L_j and a_j (KdTerm) over its n real columns,
// from the rows' statistics.
template <class Ts, class Tt>
__global__ void __launch_bounds__(kKdThreads) kd_vp_terms_kernel(const KdArgs a, int64_t start, int64_t n,
                                                                  const float* stats, int64_t ld_stats, float* rec,
                                                                  int64_t ldr) {
  constexpr int G = kGroup<Ts, Tt>;
  const int64_t row = blockIdx.x;
  const Ts* s = static_cast<const Ts*>(a.s) + row * a.lds;
  const Tt* t = static_cast<const Tt*>(a.t) + row * a.ldt;
  const float* st = stats + row * ld_stats;
  const LogProb lq{a.inv_t, st[0], st[1]}, lp{a.inv_t, st[2], st[3]};  // student, teacher
  const KdTerm term(a.div, a.beta);
  TermsAcc acc;
  visit2<Ts, Tt, false>(s, t, nullptr, nullptr, n, [&](float (&vs)[G], float (&vt)[G], int64_t, int cnt) {
    for (int k = 0; k < cnt; ++k) {
      float ak;
      acc.l += term(lp(vt[k]), lq(vs[k]), &ak);
      acc.a += ak;
    }
  });
  acc = block_reduce(acc, false);
  if (threadIdx.x != 0) return;
  rec[row * ldr] = acc.l;
  rec[row * ldr + 1] = acc.a;
  rec[row * ldr + 2] = -1.f;  // dense
  put_range(rec + row * ldr, kKdTermsRange, start, start + n);
}

// One block per row: dstudent_j = kd_grad(a_j, q_j, A, scale) over the n real columns, 0 on the padding and
// on masked rows; a_j as KdTerm forms it (forward KL -p_j, reverse KL q_j (log q_j - log p_j + 1), 0 where
// q_j = 0) without its loss term. Each thread reads its group before it writes it (in place allowed); a
// group is stored as 16-byte vectors where dstudent's row is aligned.
template <class Ts, class Tt, int kDiv>
__global__ void __launch_bounds__(kKdThreads) kd_vp_bwd_kernel(const KdArgs a, int64_t n, const float* stats,
                                                                int64_t ld_stats) {
  constexpr int G = kGroup<Ts, Tt>, K = kVec<Ts>;
  const int64_t row = blockIdx.x;
  const Ts* s = static_cast<const Ts*>(a.s) + row * a.lds;
  const Tt* t = static_cast<const Tt*>(a.t) + row * a.ldt;
  Ts* ds = static_cast<Ts*>(a.ds) + row * a.ldd;
  if (a.V > n) fill_slice<Ts>(ds + n, a.V - n, 0.f);
  if (target_masked(a, row)) {
    fill_slice<Ts>(ds, n, 0.f);
    return;
  }
  const float* st = stats + row * ld_stats;
  const float A = st[4], scale = kd_grad_scale(a, row), inv_t = a.inv_t;
  const LogProb lq{inv_t, st[0], st[1]}, lp{inv_t, st[2], st[3]};  // student, teacher
  const bool vec = (reinterpret_cast<uintptr_t>(ds) & 15u) == 0;
  const KdTerm term(a.div, a.beta);
  auto grad = [&](float xs, float xt) {
    const float logq = lq(xs), q = fast_exp(logq), logp = lp(xt);
    float ak;
    if constexpr (kDiv == FCE_KD_REVERSE_KL) ak = q == 0.f ? 0.f : q * (logq - logp + 1.f);
    else if constexpr (kDiv == FCE_KD_FORWARD_KL) ak = -fast_exp(logp);
    else term(logp, logq, &ak);  // JSD: (1 - beta) q (log q - log M)
    return kd_grad(ak, q, A, scale);
  };
  visit2<Ts, Tt, false>(s, t, nullptr, nullptr, n, [&](float (&vs)[G], float (&vt)[G], int64_t e, int cnt) {
    if (cnt == G && vec) {
#pragma unroll
      for (int c = 0; c < G / K; ++c) {
        float v[K];
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] = grad(vs[c * K + k], vt[c * K + k]);
        reinterpret_cast<uint4*>(ds + e)[c] = pack<Ts>(v);
      }
      return;
    }
    for (int k = 0; k < cnt; ++k) ds[e + k] = from_float<Ts>(grad(vs[k], vt[k]));
  });
}


// ---- a top-K teacher over shards -------------------------------------------------------------------------

// Max (of z = x/T, from the raw max as the dense kernels form it) and sum e^(z - max) of a thread's values,
// merged by the block's fixed tree.
struct MaxSum {
  float m = -INFINITY, d = 0.f;
  __device__ MaxSum() {}
  __device__ MaxSum(float m_, float d_) : m(m_), d(d_) {}
  __device__ void add(float raw_max, const float* v, int cnt, float inv_t) {  // a group of raw values
    const float g = raw_max * inv_t;
    if (g > m) {
      d = m == -INFINITY ? 0.f : d * ex2((m - g) * kLog2e);
      m = g;
    }
    if (m == -INFINITY) return;
    for (int k = 0; k < cnt; ++k) d += ex2(zdiff(v[k], inv_t, m) * kLog2e);
  }
  __device__ void merge(const MaxSum& o) {
    const float M = fmaxf(m, o.m);
    if (M == -INFINITY || M == INFINITY) {
      d = (m == M ? d : 0.f) + (o.m == M ? o.d : 0.f);
    } else {
      d = (m == -INFINITY ? 0.f : d * ex2((m - M) * kLog2e)) + (o.m == -INFINITY ? 0.f : o.d * ex2((o.m - M) * kLog2e));
    }
    m = M;
  }
  __device__ MaxSum shfl_down(unsigned off) const {
    return MaxSum(__shfl_down_sync(0xffffffffu, m, off), __shfl_down_sync(0xffffffffu, d, off));
  }
};

struct MaxF {
  float m = -INFINITY;
  __device__ MaxF() {}
  __device__ explicit MaxF(float x) : m(x) {}
  __device__ void merge(const MaxF& o) { m = fmaxf(m, o.m); }
  __device__ MaxF shfl_down(unsigned off) const { return MaxF(__shfl_down_sync(0xffffffffu, m, off)); }
};

// Slot k of a row's top-K teacher: its column in the shard (-1 outside it or unused).
__device__ __forceinline__ int64_t slot_column(const KdArgs& a, int64_t row, int64_t k, int64_t start, int64_t n) {
  const int64_t id = load_index(a.ids, a.ids64, row * a.ldi + k);
  const int64_t c = id - start;
  return id >= 0 && c >= 0 && c < n ? c : -1;
}

// The teacher's log-probabilities softmax_K(logprobs / T) over the row's used slots: its shift m and log d
// (a block's reductions; every thread gets them), and whether the row has a used slot and an id out of the
// vocabulary.
struct TopkTeacherRow {
  float m, logd;
  bool any, bad;
  __device__ float logp(const KdArgs& a, int64_t row, int64_t k) const {
    return __fsub_rn(zdiff(a.lp[row * a.ldlp + k], a.inv_t, m), logd);
  }
};
__device__ TopkTeacherRow topk_teacher_row(const KdArgs& a, int64_t row, int64_t vocab_total) {
  float rmax = -INFINITY;
  int any = 0, bad = 0;
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
    const int64_t id = load_index(a.ids, a.ids64, row * a.ldi + k);
    if (id < 0) continue;
    any = 1;
    bad |= id >= vocab_total;
    rmax = fmaxf(rmax, a.lp[row * a.ldlp + k]);
  }
  TopkTeacherRow t;
  t.any = __syncthreads_or(any) != 0;
  t.bad = __syncthreads_or(bad) != 0;
  t.m = block_reduce(MaxF(rmax)).m * a.inv_t;
  float d = 0.f;
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x)
    if (load_index(a.ids, a.ids64, row * a.ldi + k) >= 0) d += ex2(zdiff(a.lp[row * a.ldlp + k], a.inv_t, t.m) * kLog2e);
  t.logd = logf(block_reduce(SumF(d)).s);
  return t;
}

// One block per row: the student's max and sum over the shard's n real columns, and over its columns at the
// teacher's ids (P and Q as the divergence orders them, kRev: the student is P); the cross sum NaN.
template <class Ts, bool kRev>
__global__ void __launch_bounds__(kKdThreads) kd_vp_topk_partial_kernel(const KdArgs a, int64_t start, int64_t n,
                                                                         float* rec, int64_t ldr) {
  const int64_t row = blockIdx.x;
  const Ts* s = static_cast<const Ts*>(a.s) + row * a.lds;
  MaxSum all, sel;
  row_visit<Ts>(s, 0, n, [&](const float* v, int64_t, int cnt) {
    float r = -INFINITY;
    for (int k = 0; k < cnt; ++k) r = fmaxf(r, v[k]);
    all.add(r, v, cnt, a.inv_t);
  });
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
    const int64_t c = slot_column(a, row, k, start, n);
    if (c < 0) continue;
    const float v = to_float(s[c]);
    sel.add(v, &v, 1, a.inv_t);
  }
  all = block_reduce(all, true);
  sel = block_reduce(sel, false);
  if (threadIdx.x != 0) return;
  float* r = rec + row * ldr;
  r[0] = kRev ? all.m : sel.m;
  r[1] = kRev ? all.d : sel.d;
  r[2] = kRev ? sel.m : all.m;
  r[3] = kRev ? sel.d : all.d;
  r[4] = NAN;
  put_range(r, kKdRange, start, start + n);
}

// One block per row: the terms at the teacher's ids in the shard (KdTerm), their slots counted; NaN for a row
// with an id out of the vocabulary.
template <class Ts>
__global__ void __launch_bounds__(kKdThreads) kd_vp_topk_terms_kernel(const KdArgs a, int64_t start, int64_t n,
                                                                       int64_t vocab_total, bool renorm,
                                                                       const float* stats, int64_t ld_stats,
                                                                       float* rec, int64_t ldr) {
  const int64_t row = blockIdx.x;
  const Ts* s = static_cast<const Ts*>(a.s) + row * a.lds;
  const float* st = stats + row * ld_stats;
  const LogProb lq{a.inv_t, renorm ? st[2] : st[0], renorm ? st[3] : st[1]};
  const KdTerm term(a.div, a.beta);
  const TopkTeacherRow t = topk_teacher_row(a, row, vocab_total);
  TermsAcc acc;
  int slots = 0;
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
    const int64_t c = slot_column(a, row, k, start, n);
    if (c < 0) continue;
    ++slots;
    float ak;
    acc.l += term(t.logp(a, row, k), lq(to_float(s[c])), &ak);
    acc.a += ak;
  }
  acc = block_reduce(acc, true);
  const float count = float(block_reduce(SumL(slots)).s);
  if (threadIdx.x != 0) return;
  rec[row * ldr] = t.bad ? NAN : acc.l;
  rec[row * ldr + 1] = t.bad ? NAN : acc.a;
  rec[row * ldr + 2] = count;
  put_range(rec + row * ldr, kKdTermsRange, start, start + n);
}

// One block per row: dstudent of a top-K teacher, as fce_kd_loss forms it: a_k - q_k A at the ids in the
// shard (formed first, into shared memory: dstudent may be the student), -q_j A elsewhere (0 with
// renormalization); 0 on masked rows and the padding, NaN on a row with an id out of the vocabulary.
template <class Ts>
__global__ void __launch_bounds__(kKdThreads) kd_vp_topk_bwd_kernel(const KdArgs a, int64_t start, int64_t n,
                                                                     int64_t vocab_total, bool renorm,
                                                                     const float* stats, int64_t ld_stats) {
  extern __shared__ float slot_val[];  // [K]
  constexpr int K = kVec<Ts>, G = kGroup<Ts, Ts>;
  const int64_t row = blockIdx.x;
  const Ts* s = static_cast<const Ts*>(a.s) + row * a.lds;
  Ts* ds = static_cast<Ts*>(a.ds) + row * a.ldd;
  if (a.V > n) fill_slice<Ts>(ds + n, a.V - n, 0.f);
  const TopkTeacherRow t = topk_teacher_row(a, row, vocab_total);
  if (target_masked(a, row) || !t.any) {
    fill_slice<Ts>(ds, n, 0.f);
    return;
  }
  if (t.bad) {
    fill_slice<Ts>(ds, n, NAN);
    return;
  }
  const float* st = stats + row * ld_stats;
  const float A = st[4], scale = kd_grad_scale(a, row);
  const LogProb lq{a.inv_t, st[0], st[1]}, lsel{a.inv_t, st[2], st[3]};
  const KdTerm term(a.div, a.beta);
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
    const int64_t c = slot_column(a, row, k, start, n);
    if (c < 0) continue;
    const float logq = (renorm ? lsel : lq)(to_float(s[c]));
    float ak;
    term(t.logp(a, row, k), logq, &ak);
    const float v = kd_grad(ak, fast_exp(logq), A, 1.f);
    slot_val[k] = scale == 0.f && isinf(v) ? 0.f : v * scale;
  }
  __syncthreads();
  const bool vec = (reinterpret_cast<uintptr_t>(ds) & 15u) == 0;
  auto dense = [&](float x) { return renorm ? 0.f : kd_grad(0.f, fast_exp(lq(x)), A, scale); };
  visit2<Ts, Ts, false>(s, s, nullptr, nullptr, n, [&](float (&vs)[G], float (&)[G], int64_t e, int cnt) {
    if (cnt == G && vec) {
#pragma unroll
      for (int c = 0; c < G / K; ++c) {
        float v[K];
#pragma unroll
        for (int k = 0; k < K; ++k) v[k] = dense(vs[c * K + k]);
        reinterpret_cast<uint4*>(ds + e)[c] = pack<Ts>(v);
      }
      return;
    }
    for (int k = 0; k < cnt; ++k) ds[e + k] = from_float<Ts>(dense(vs[k]));
  });
  __syncthreads();
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
    const int64_t c = slot_column(a, row, k, start, n);
    if (c >= 0) ds[c] = from_float<Ts>(slot_val[k]);
  }
}

KdArgs args_of(const Mat& student, const KdShardTeacher& teacher, const KdOpts& o) {
  KdArgs a{};
  a.s = student.data;
  a.lds = student.ld;
  a.t = teacher.logits.data;
  a.ldt = teacher.logits.ld;
  if (teacher.topk()) {
    a.ids = teacher.topk_ids.data;
    a.ldi = teacher.topk_ids.ld;
    a.ids64 = teacher.topk_ids.dtype == DType::I64;
    a.K = teacher.topk_ids.cols;
    a.lp = reinterpret_cast<const float*>(teacher.topk_lp.data);
    a.ldlp = teacher.topk_lp.ld;
  }
  a.ignore_index = o.ignore_index;
  a.reduction = o.reduction;
  a.div = o.divergence;
  a.beta = o.beta;
  a.inv_t = 1.f / o.temperature;
  a.temperature = o.temperature;
  a.t2 = o.scale_by_t2 ? o.temperature * o.temperature : 1.f;
  a.N = student.rows;
  a.V = student.cols;
  return a;
}

struct CombineWorkspace {
  float* row_loss = nullptr;
  int* row_used = nullptr;
  size_t bytes = 0;
  CombineWorkspace(const KdCombineProblem& p, void* base) {
    Carver c(base);
    if (p.loss && p.o.reduction != FCE_REDUCTION_NONE) {
      row_loss = c.take<float>(size_t(p.N));
      row_used = c.take<int>(size_t(p.N));
    }
    bytes = c.used;
  }
};

}  // namespace

void kd_partial(fce_handle* h, fce_stream_t stream, const KdPartialProblem& p) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const KdArgs a = args_of(p.student, p.teacher, p.o);
  const int64_t n = p.o.real_cols(p.student.cols);
  float* rec = reinterpret_cast<float*>(p.records.data);
  const bool rev = p.o.divergence == FCE_KD_REVERSE_KL;
  if (p.teacher.topk()) {
    dispatch_float(p.student.dtype, [&](auto stag) {
      using Ts = decltype(stag);
      if (rev) kd_vp_topk_partial_kernel<Ts, true><<<unsigned(a.N), kKdThreads, 0, s>>>(a, p.o.vocab_start, n, rec, p.records.ld);
      else kd_vp_topk_partial_kernel<Ts, false><<<unsigned(a.N), kKdThreads, 0, s>>>(a, p.o.vocab_start, n, rec, p.records.ld);
    });
    check_launch("vocabulary-parallel KD top-K partial kernel");
    return;
  }
  dispatch_float(p.student.dtype, [&](auto stag) {
    dispatch_float(p.teacher.logits.dtype, [&](auto ttag) {
      using Ts = decltype(stag);
      using Tt = decltype(ttag);
      const int64_t vs = p.o.vocab_start;
      if (rev) kd_vp_partial_kernel<Ts, Tt, true><<<unsigned(a.N), kKdThreads, 0, s>>>(a, vs, n, rec, p.records.ld);
      else kd_vp_partial_kernel<Ts, Tt, false><<<unsigned(a.N), kKdThreads, 0, s>>>(a, vs, n, rec, p.records.ld);
    });
  });
  check_launch("vocabulary-parallel KD partial kernel");
}

void kd_terms_partial(fce_handle* h, fce_stream_t stream, const KdTermsPartialProblem& p) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const KdArgs a = args_of(p.student, p.teacher, p.o);
  const int64_t n = p.o.real_cols(p.student.cols);
  const float* stats = reinterpret_cast<const float*>(p.row_stats.data);
  float* rec = reinterpret_cast<float*>(p.records.data);
  if (p.teacher.topk()) {
    const bool renorm = p.o.topk_norm == FCE_KD_TOPK_RENORMALIZE;
    dispatch_float(p.student.dtype, [&](auto stag) {
      using Ts = decltype(stag);
      kd_vp_topk_terms_kernel<Ts><<<unsigned(a.N), kKdThreads, 0, s>>>(a, p.o.vocab_start, n, p.o.vocab_total, renorm,
                                                                        stats, p.row_stats.ld, rec, p.records.ld);
    });
    check_launch("vocabulary-parallel KD top-K terms kernel");
    return;
  }
  dispatch_float(p.student.dtype, [&](auto stag) {
    dispatch_float(p.teacher.logits.dtype, [&](auto ttag) {
      using Ts = decltype(stag);
      using Tt = decltype(ttag);
      kd_vp_terms_kernel<Ts, Tt><<<unsigned(a.N), kKdThreads, 0, s>>>(a, p.o.vocab_start, n, stats, p.row_stats.ld, rec,
                                                                      p.records.ld);
    });
  });
  check_launch("vocabulary-parallel KD terms kernel");
}

size_t kd_combine_workspace(fce_handle*, const KdCombineProblem& p) { return CombineWorkspace(p, nullptr).bytes; }

void kd_combine(fce_handle* h, fce_stream_t stream, const KdCombineProblem& p, Workspace w) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  const CombineWorkspace ws(p, w.ptr);
  CombineArgs a{};
  a.rec = reinterpret_cast<const float*>(p.records.data);
  a.W = p.W;
  a.N = p.N;
  a.vocab_total = p.o.vocab_total;
  a.targets = p.targets ? p.targets.data : nullptr;
  a.tgt64 = p.targets && p.targets.dtype == DType::I64;
  a.ignore_index = p.o.ignore_index;
  a.rev = p.o.divergence == FCE_KD_REVERSE_KL;
  a.terms = p.terms;
  a.mixture = p.o.mixture();
  a.has_loss = static_cast<bool>(p.loss);
  a.reduced = a.has_loss && p.o.reduction != FCE_REDUCTION_NONE;
  a.t2 = p.o.scale_by_t2 ? p.o.temperature * p.o.temperature : 1.f;
  a.row_loss = a.reduced ? ws.row_loss : a.has_loss ? reinterpret_cast<float*>(p.loss.data) : nullptr;
  a.row_used = ws.row_used;
  a.stats = p.row_stats ? reinterpret_cast<float*>(p.row_stats.data) : nullptr;
  a.ld_stats = p.row_stats ? p.row_stats.ld : 0;
  kd_vp_combine_kernel<<<unsigned((p.N + 127) / 128), 128, 0, s>>>(a);
  check_launch("vocabulary-parallel KD combine kernel");
  if (a.reduced) {
    kd_finalize_kernel<<<1, 1024, 0, s>>>(ws.row_loss, ws.row_used, p.N, p.o.reduction == FCE_REDUCTION_MEAN,
                                          reinterpret_cast<float*>(p.loss.data));
    check_launch("KD finalize kernel");
  }
}

size_t kd_bwd_workspace(fce_handle*, const KdBwdProblem& p) {
  return p.o.reduction == FCE_REDUCTION_MEAN ? 256 : 0;  // MEAN's row count
}

void kd_bwd(fce_handle* h, fce_stream_t stream, const KdBwdProblem& p, Workspace w) {
  DeviceGuard guard(h->device_id);
  const cudaStream_t s = stream_of(stream);
  KdArgs a = args_of(p.student, p.teacher, p.o);
  a.targets = p.targets ? p.targets.data : nullptr;
  a.tgt64 = p.targets && p.targets.dtype == DType::I64;
  a.ds = p.dstudent.data;
  a.ldd = p.dstudent.ld;
  a.grad = p.grad_loss ? reinterpret_cast<const float*>(p.grad_loss.data) : nullptr;
  a.grad_scalar = p.grad_loss && p.grad_loss.scalar;
  if (p.o.reduction == FCE_REDUCTION_MEAN) {
    int* count = static_cast<int*>(w.ptr);
    check(cudaMemsetAsync(count, 0, sizeof(int), s), "cudaMemsetAsync (KD row count)");
    kd_count_kernel<<<unsigned((a.N + 7) / 8), 256, 0, s>>>(a, count);
    check_launch("KD row-count kernel");
    a.count = count;
  }
  const int64_t n = p.o.real_cols(p.student.cols);
  const float* stats = reinterpret_cast<const float*>(p.row_stats.data);
  if (p.teacher.topk()) {
    const bool renorm = p.o.topk_norm == FCE_KD_TOPK_RENORMALIZE;
    const size_t smem = size_t(a.K) * sizeof(float);  // at most kKdShardTopkMax (the API's check)
    dispatch_float(p.student.dtype, [&](auto stag) {
      using Ts = decltype(stag);
      kd_vp_topk_bwd_kernel<Ts><<<unsigned(a.N), kKdThreads, smem, s>>>(a, p.o.vocab_start, n, p.o.vocab_total, renorm,
                                                                        stats, p.row_stats.ld);
    });
    check_launch("vocabulary-parallel KD top-K backward kernel");
    return;
  }
  dispatch_float(p.student.dtype, [&](auto stag) {
    dispatch_float(p.teacher.logits.dtype, [&](auto ttag) {
      using Ts = decltype(stag);
      using Tt = decltype(ttag);
      if (p.o.divergence == FCE_KD_REVERSE_KL)
        kd_vp_bwd_kernel<Ts, Tt, FCE_KD_REVERSE_KL><<<unsigned(a.N), kKdThreads, 0, s>>>(a, n, stats, p.row_stats.ld);
      else if (p.o.divergence == FCE_KD_FORWARD_KL)
        kd_vp_bwd_kernel<Ts, Tt, FCE_KD_FORWARD_KL><<<unsigned(a.N), kKdThreads, 0, s>>>(a, n, stats, p.row_stats.ld);
      else
        kd_vp_bwd_kernel<Ts, Tt, FCE_KD_JSD><<<unsigned(a.N), kKdThreads, 0, s>>>(a, n, stats, p.row_stats.ld);
    });
  });
  check_launch("vocabulary-parallel KD backward kernel");
}

}  // namespace fce::cuda
