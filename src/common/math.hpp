// Scalar math shared by the CPU and CUDA backends, so each formula exists once.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FCE_HD __host__ __device__ __forceinline__
#else
#define FCE_HD inline
#endif

namespace fce {

// Cross-entropy's transform of a raw logit: z = c*tanh(s*x/c) (soft-cap, Gemma 2) or s*x.
// For a subnormal c, 1/c overflows fp32 (and 0 * inf would be NaN at x = 0): s*x/c is then formed as
// (s*2^64*x) * (1/(c*2^64)), and z/c as (z*2^64) * (1/(c*2^64)); for any other c, arg_scale = s and
// pre = 1, so the arithmetic is the plain one bit for bit.
struct LogitTransform {
  float scale;
  float softcap;    // 0 = off
  float inv_cap;    // 1/(c*pre)
  float arg_scale;  // s*pre (FLT_MAX if that overflows: tanh saturates alike)
  float pre;        // 1, or 2^64 when c is subnormal
  FCE_HD LogitTransform(float s, float c)
      : scale(s), softcap(c), inv_cap(0.f), arg_scale(s), pre(1.f) {
    if (c > 0.f) {
      if (c < 0x1p-126f) {  // subnormal
        pre = 0x1p64f;
        arg_scale = fminf(s * pre, 3.40282347e38f);
      }
      inv_cap = 1.f / (c * pre);
    }
  }
  FCE_HD float operator()(float x) const {
    return softcap > 0.f ? softcap * tanhf(arg_scale * x * inv_cap) : scale * x;
  }
  // dz/dx given z: s*(1 - tanh^2) = s*(1 - (z/c)^2), or s.
  FCE_HD float derivative(float z) const {
    if (softcap > 0.f) {
      const float t = z * pre * inv_cap;
      return scale * (1.f - t * t);
    }
    return scale;
  }
};

// A row's log-sum-exp as the pair lse = hi + lo: hi the largest of the values the softmax is taken over (the
// transformed logits z for cross-entropy), lo = log sum_j e^(z_j - hi). Probabilities are formed from the
// max-shifted values, log p_j = (z_j - hi) - lo: z_j - hi is exact near the maximum, so no rounding of the
// size of the logits enters p_j (e^(z_j - lse) against a rounded fp32 lse is off by |lse| 2^-24 relative,
// the whole distribution at once). A plain lse is the pair (lse, 0). A row without a finite maximum: hi is
// the NaN or the infinity, lo 0 (or NaN with a NaN).
struct LsePair {
  float hi, lo;
  FCE_HD float value() const { return hi + lo; }
  FCE_HD float logp(float z) const { return (z - hi) - lo; }  // log p_j, in nats
};

// A class weight inside its domain, finite and >= 0. A row whose target's weight is outside it (NaN, negative,
// infinite) is treated as a row with a target out of range: loss, z-loss and gradient row NaN, counted 1 in
// the mean's denominator; with label smoothing every weight enters every row, so one such weight makes every
// non-ignored row NaN (the weights' sum is NaN). Read on the device, so no status: a NaN that cannot vanish.
FCE_HD bool class_weight_ok(float w) { return w >= 0.f && w < INFINITY; }

// Gradient of one cross-entropy row w.r.t. z_j (before the transform's derivative), PyTorch semantics
// with label smoothing e, class weights w, z-loss q:
//   dL/dz_j = g*[(1-e)*w_t*(p_j - [j==t]) + (e/V)*(W*p_j - w_j) + 2*q*lse*p_j]
//           = g*(cp*p_j - cw*w_j - [j==t]*ct)
struct CeGrad {
  float cp, cw, ct;
  // The entropy's term (grad_entropy): ge * dH/dz_j = ge * p_j (mu - z_j), mu = sum_k p_k z_k = lse - H, so
  // mu - z_j = -log p_j - H: formed from log p_j, it keeps p_j's precision at any offset of the logits.
  float ge = 0.f, H = 0.f;
  FCE_HD CeGrad(float g, float eps, float w_t, float W, float inv_v, float zq, float lse) {
    const float a = (1.f - eps) * w_t, b = eps * inv_v;
    cp = g * (a + b * W + 2.f * zq * lse);
    cw = g * b;
    ct = g * a;
  }
  FCE_HD CeGrad& entropy(float g_entropy, float entropy) {
    ge = g_entropy;
    H = entropy;
    return *this;
  }
  FCE_HD float operator()(float p, float w_j, bool is_target) const {
    return cp * p - cw * w_j - (is_target ? ct : 0.f);
  }
  // With the entropy's term, lp = log p_j; a logit of -inf (p = 0) gets none (its -log p is +inf).
  FCE_HD float operator()(float p, float w_j, bool is_target, float lp) const {
    const float l = (*this)(p, w_j, is_target);
    return p == 0.f ? l : fmaf(ge * p, -lp - H, l);
  }
};

// exp for the per-element terms: the hardware ex2 path on the GPU (a few ulp, -inf gives 0, NaN stays
// NaN), the accurate one on the CPU.
FCE_HD float fast_exp(float x) {
#if defined(__CUDA_ARCH__)
  return __expf(x);
#else
  return std::exp(x);
#endif
}

// x*log(x/y)-style term that is 0 when the weight p is 0, whatever the logs hold (-inf logits give no NaN);
// a NaN weight stays NaN.
FCE_HD float xlogratio(float p, float logp, float logq) { return p == 0.f ? 0.f : p * (logp - logq); }

// log(exp(a) + exp(b)) without overflow; -inf when both are -inf.
FCE_HD float logaddexp(float a, float b) {
  const float m = fmaxf(a, b);
  if (m == -INFINITY) return -INFINITY;
  return m + log1pf(fast_exp(-fabsf(a - b)));
}

// Knowledge distillation per-element terms, given the teacher's and the student's log-probabilities.
// Returns the loss term and, in *a, the gradient contribution a_j = q_j * dL/dq_j, from which
// dL/dz_j = a_j - q_j * sum_k a_k (z = student logits / T).
struct KdTerm {
  int divergence;  // fce_kd_divergence_t
  float beta, log_beta, log_1mbeta;
  FCE_HD KdTerm(int div, float b) : divergence(div), beta(b), log_beta(logf(b)), log_1mbeta(logf(1.f - b)) {
    // GKD convention: b = 0 is forward KL, b = 1 reverse KL, exactly.
    if (divergence == 2 && b == 0.f) divergence = 0;
    if (divergence == 2 && b == 1.f) divergence = 1;
  }
  FCE_HD float operator()(float logp, float logq, float* a) const {
    const float p = fast_exp(logp), q = fast_exp(logq);
    if (divergence == 0) {  // forward KL(P_t || P_s)
      *a = -p;
      return xlogratio(p, logp, logq);
    }
    if (divergence == 1) {  // reverse KL(P_s || P_t)
      *a = q == 0.f ? 0.f : q * (logq - logp + 1.f);
      return xlogratio(q, logq, logp);
    }
    // generalized JSD: b*KL(P||M) + (1-b)*KL(Q||M), M = b*P + (1-b)*Q; dL/dq = (1-b)*log(q/M)
    // M = P exactly when P = Q: identical distributions give exactly 0.
    const float logm = logp == logq ? logp : logaddexp(log_beta + logp, log_1mbeta + logq);
    *a = q == 0.f ? 0.f : q * (1.f - beta) * (logq - logm);
    return beta * xlogratio(p, logp, logm) + (1.f - beta) * xlogratio(q, logq, logm);
  }
};

// (x - m)/T for temperature softmax, m the row's max of raw logits, inv_t = 1/T: -inf logits stay -inf
// (probability 0), the max itself gives exactly 0 (a subnormal T makes inv_t = +inf, and 0 * inf would be
// NaN; +inf logits keep inf - inf = NaN). x - m must not overflow fp32 (|x| and |m| near FLT_MAX), or a
// huge T would lose the true difference: the GPU forms it halved, fma(x, 1/2, -m/2) * (2/T), exact for
// normal numbers and as cheap as (x - m) * (1/T) (where 2/T overflows, at a subnormal T, x - m overflowing
// gives -inf rightly); the CPU's vector kernel (simd::softmax_exp) forms the same. T = +inf gives 0 for every
// finite logit. operator() is the scalar form.
struct SoftmaxShift {
  float m;     // the max, or NaN when it is +inf (then no logit compares equal to it)
  float inv_t;
  float a, b, c;  // (x - m)/T = fma(x, a, b) * c
  FCE_HD SoftmaxShift(float max, float inv_t_) : m(max < INFINITY ? max : NAN), inv_t(inv_t_) {
    const bool big = inv_t_ > 0x1p127f;
    a = big ? 1.f : 0.5f;
    b = -a * max;
    c = big ? inv_t_ : 2.f * inv_t_;
  }
  FCE_HD float operator()(float x) const {
    if (x == -INFINITY) return -INFINITY;
    if (x == m) return 0.f;
    return fmaf(x, a, b) * c;
  }
};
// A vocabulary shard's log-probability x/T - lse from the whole rows' lse (fce_temp_softmax of a shard).
// From the pair (M, log D) of fce_logsumexp_combine, (x - M)/T - log D as the unsharded softmax forms it
// (SoftmaxShift): no overflow of x/T at any T, and no rounding of the size of x/T. From a plain fp32 lse,
// ((x - u_hi) - u_lo) / T with u = lse T split in two floats: finite wherever lse is (x/T itself may
// overflow), but the lse's own rounding, |lse| 2^-24, enters every value. A row of the pair without a
// finite max (NaN, or every logit -inf) is NaN.
struct ShardLogProb {
  SoftmaxShift shift;
  float lo, inv_t, u_hi, u_lo;
  bool pair, none;
  FCE_HD ShardLogProb(LsePair l, bool is_pair, float inv_t_)
      : shift(is_pair ? l.hi : 0.f, inv_t_), lo(l.lo), inv_t(inv_t_), u_hi(0.f), u_lo(0.f), pair(is_pair),
        none(is_pair && !(l.hi > -INFINITY)) {
    if (!is_pair) {
      const double u = double(l.hi) / double(inv_t_);
      u_hi = float(u);
      u_lo = u_hi == u_hi && u_hi - u_hi == 0.f ? float(u - double(u_hi)) : 0.f;  // 0 beside an infinity
    }
  }
  FCE_HD float operator()(float x) const {
    if (none) return NAN;
    if (pair) return shift(x) - lo;
    return ((x - u_hi) - u_lo) * inv_t;
  }
};

// Largest temperature at which the softmax's lean kernels may form (x - max)/T directly: an overflowing
// x - max there would drop a probability that is 0 in fp32 anyway (exp(-2^128/2^100) underflows).
constexpr float kPlainMaxTemperature = 0x1p100f;

// One element of the KD gradient: scale * dL/dz_j = scale * (a_j - q_j A), with A = sum_k a_k (KdTerm).
// q_j = 0 gives a_j alone (no 0 * inf). A = +inf happens for reverse KL where the teacher has probability 0
// and the student does not (the loss is +inf): the gradient is then its limit as those teacher logits go to
// -inf, +inf at such columns (a_j = +inf) and -inf at the other columns with q_j > 0, times the sign of
// `scale` (0 where scale is 0). NaN stays NaN.
FCE_HD float kd_grad(float a, float q, float A, float scale) {
  if (A == INFINITY && q != 0.f) return scale == 0.f ? 0.f : (a == INFINITY ? INFINITY : -INFINITY) * scale;
  return (q == 0.f ? a : a - q * A) * scale;
}

// ---- vocabulary-parallel records: their column ranges -----------------------------------------------

constexpr int32_t kNoRecordIndex = INT32_MAX;  // a shard without real columns has no argmax

FCE_HD float index_as_float(int32_t i) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(i);
#else
  float f;
  std::memcpy(&f, &i, 4);
  return f;
#endif
}
FCE_HD int32_t float_as_index(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_int(f);
#else
  int32_t i;
  std::memcpy(&i, &f, 4);
  return i;
#endif
}

// Every record of a shard carries its column range: the shard's first global column and one past its last
// real column (padding excluded), as int32 bits in fields `at` and `at` + 1. The combine takes the records
// in rank order and checks that the ranges tile [0, total): the first begins at 0, each begins where the one
// before ends, the last ends at total. Overlapping shards, a gap, shards out of vocabulary order or of
// another vocabulary fail it: the row's outputs are NaN, never a plausible wrong number.
FCE_HD void put_range(float* rec, int at, int64_t begin, int64_t end) {
  rec[at] = index_as_float(int32_t(begin));
  rec[at + 1] = index_as_float(int32_t(end));
}
FCE_HD bool ranges_tile(const float* rec, int64_t W, int64_t stride, int at, int64_t total) {
  int64_t next = 0;
  for (int64_t r = 0; r < W; ++r) {
    const int64_t b = float_as_index(rec[r * stride + at]), e = float_as_index(rec[r * stride + at + 1]);
    if (b != next || e < b) return false;
    next = e;
  }
  return next == total;
}

// ---- vocabulary-parallel logsumexp: the combine of the shards' records --------------------------------

// A logsumexp record (fce_logsumexp_partial): 0 m, the largest raw x of the shard's real columns (NaN when
// the shard holds a NaN, -inf without a column above -inf), 1 d = sum exp((x - m) s) (1 when m is +inf, 0
// when -inf; NaN with m), 2-3 the column range, 4 the scale s, 5 vocab_total (int32 bits). In raw units, so
// that x s never overflows: a shard's softmax at a small T stays finite.
constexpr int kLseRange = 2, kLseScale = 4, kLseTotal = 5;

// The lse of a row from W records in rank order (record r at rec + r * stride), in fp64: NaN when a record
// is NaN, when the records' scales or vocabularies differ or their ranges do not tile [0, vocab_total);
// +inf when a max is +inf (its d is 1, the others' terms vanish); -inf without a finite max. pair: (M, log D)
// with lse = s M + log D (M the rows' largest raw x), from which a shard's softmax forms (x - M) / T - log D.
struct LseCombined {
  float lse;
  LsePair pair;
};
FCE_HD LseCombined lse_combine_records(const float* rec, int64_t W, int64_t stride) {
  const float s = rec[kLseScale], total = rec[kLseTotal];
  bool nan = !ranges_tile(rec, W, stride, kLseRange, float_as_index(total));
  double M = -INFINITY;
  for (int64_t r = 0; r < W; ++r) {
    const float* q = rec + r * stride;
    const float m = q[0];
    if (m != m || q[kLseScale] != s || float_as_index(q[kLseTotal]) != float_as_index(total)) nan = true;
    else if (m > M) M = m;
  }
  if (nan) return {NAN, {NAN, NAN}};
  if (M == INFINITY || M == -INFINITY) return {float(M), {float(M), 0.f}};
  double D = 0;
  for (int64_t r = 0; r < W; ++r) {
    const float* q = rec + r * stride;
    if (q[0] != -INFINITY) D += double(q[1]) * ::exp((double(q[0]) - M) * double(s));
  }
  return {float(double(s) * M + ::log(D)), {float(M), float(::log(D))}};
}

// ---- vocabulary-parallel knowledge distillation: the cross statistics of KL(P || Q) -------------------

// Statistics of KL(P || Q) over a slice of a row, z = logits / T: the max and the sum of exp(z - max) of P and
// of Q, and x = sum exp(z_P - m_P) ((z_P - m_P) - (z_Q - m_Q)), terms of zero P-probability adding 0. The
// header's KD record (fields 0-4). R: float on the device's threads, double in the combine.
template <class R>
struct KdCross {
  R mp, dp, mq, dq, x;
};

FCE_HD float kd_exp(float v) { return expf(v); }
FCE_HD double kd_exp(double v) { return ::exp(v); }

// Adds slice b, shifted to the maxima (MP, MQ) >= its own, into acc's sums. A slice without P mass adds
// nothing to D_P or x; one whose Q is all -inf where P has mass makes x +inf (KL is then +inf).
template <class R>
FCE_HD void kd_cross_add(KdCross<R>& acc, const KdCross<R>& b, R MP, R MQ) {
  if (b.mq != -INFINITY) acc.dq += b.dq * kd_exp(b.mq - MQ);
  if (b.mp == -INFINITY) return;
  const R f = kd_exp(b.mp - MP);
  acc.dp += b.dp * f;
  const R sq = b.mq == -INFINITY ? R(-INFINITY) : b.mq - MQ;
  acc.x += f * (b.dp == R(0) ? b.x : b.x + b.dp * ((b.mp - MP) - sq));
}

// Two slices merged (the running maxima first): a's sums, then b's.
template <class R>
FCE_HD KdCross<R> kd_cross_merge(const KdCross<R>& a, const KdCross<R>& b) {
  KdCross<R> r{a.mp > b.mp ? a.mp : b.mp, R(0), a.mq > b.mq ? a.mq : b.mq, R(0), R(0)};
  kd_cross_add(r, a, r.mp, r.mq);
  kd_cross_add(r, b, r.mp, r.mq);
  return r;
}

// A row of the vocabulary-parallel KD from the W shards' records (rank order, record r at rec + r * stride):
// the maxima first, then each record's sums in fp64. kl = KL(P || Q) (NaN for a row without a finite z in P
// or in Q, as fce_kd_loss's log-softmax); the log-probabilities' shifts M and log D of P and Q. Records whose
// column ranges (fields kKdRange, kKdRange + 1) do not tile [0, total) give NaN in all of them.
constexpr int kKdRange = 5;       // a KD record: m_P, d_P, m_Q, d_Q, X, then the column range
constexpr int kKdTermsRange = 3;  // a terms record: sum L, sum a, the top-K slots, then the column range
struct KdCombined {
  double kl;
  float mp, logdp, mq, logdq;
  bool bad;  // the shards do not tile the vocabulary
};
FCE_HD KdCombined kd_combine_records(const float* rec, int64_t W, int64_t stride, int64_t total) {
  if (!ranges_tile(rec, W, stride, kKdRange, total)) return {double(NAN), NAN, NAN, NAN, NAN, true};
  double MP = -INFINITY, MQ = -INFINITY;
  for (int64_t r = 0; r < W; ++r) {
    const float* q = rec + r * stride;
    if (q[0] > MP) MP = q[0];
    if (q[2] > MQ) MQ = q[2];
  }
  KdCross<double> c{MP, 0.0, MQ, 0.0, 0.0};
  for (int64_t r = 0; r < W; ++r) {
    const float* q = rec + r * stride;
    kd_cross_add(c, KdCross<double>{q[0], q[1], q[2], q[3], q[4]}, MP, MQ);
  }
  KdCombined k;
  k.bad = false;
  const bool none = MP == -INFINITY || MQ == -INFINITY;
  k.kl = none ? NAN : c.x / c.dp - ::log(c.dp) + ::log(c.dq);
  k.mp = float(MP);
  k.mq = float(MQ);
  k.logdp = float(::log(c.dp));
  k.logdq = float(::log(c.dq));
  return k;
}

// ---- vocabulary-parallel cross-entropy: the combine of the shards' records ----------------------------

// Where a cross-entropy record keeps its fields: 0 m, the max of the transformed logits z of the shard's
// real columns, 1 sum e^(z-m), 2 z at the target if the shard holds it (else 0), 3 sum w z; then, for the
// records of the header (widths kCeRecordLoss 6, kCeRecordEntropy 7, kCeRecordFields 9), 4-5 the column range,
// 6 sum e^(z-m) (z-m) (the entropy), 7 the largest raw logit and 8 its global index (int32 bits). Records
// that never leave the library (linear CE's fused forward, one per 256-column tile) are 4 wide: no range.
struct CeRecordLayout {
  int range = -1, s1 = -1, arg = -1;  // field of each, -1 when the record has none
  FCE_HD explicit CeRecordLayout(int64_t K) {
    if (K >= 6) range = 4;
    if (K >= 7) s1 = 6;
    if (K >= 9) arg = 7;
  }
};

// A row's statistics from the W shards' records (rank order, record r at rec + r * stride; K fields, laid
// out as CeRecordLayout says). fp64, in rank order: the max first (a NaN max wins), then each shard's sums
// rescaled to it; the argmax takes NaN as the largest value, then the larger value, ties to the lower index.
// The same code on the CPU and in the CUDA combine kernel, so both give the same bits. Fields a record does
// not hold give entropy NaN and argmax kNoRecordIndex. Ranges that do not tile [0, total): `bad`, and
// lse, pair, entropy and zt NaN.
struct CeCombined {
  float lse, entropy;
  double zt, swz;   // the target's logit (from the shard that owns it), sum of w z
  int32_t argmax;   // kNoRecordIndex when no shard has a column
  LsePair pair;     // (M, log D): lse = M + log D, M the rows' max z
  bool bad;         // the shards do not tile the vocabulary
  double logd;      // log D in fp64, for the loss's lse - z_t = (M - z_t) + log D
};
FCE_HD CeCombined ce_combine_records(const float* rec, int64_t W, int64_t stride, int64_t K, int64_t total) {
  const CeRecordLayout L(K);
  CeCombined c{0.f, 0.f, 0.0, 0.0, kNoRecordIndex, {0.f, 0.f}, false, 0.0};
  if (L.range >= 0 && !ranges_tile(rec, W, stride, L.range, total)) {
    c.lse = c.entropy = NAN;
    c.zt = c.swz = double(NAN);
    c.pair = {NAN, NAN};
    c.bad = true;
    return c;
  }
  bool nan = false;
  float M = -INFINITY;
  for (int64_t r = 0; r < W; ++r) {
    const float m = rec[r * stride];
    if (m != m) nan = true;
    else if (m > M) M = m;
  }
  double D = 0, SE = 0;
  float bv = -INFINITY;
  for (int64_t r = 0; r < W; ++r) {
    const float* q = rec + r * stride;
    if (!nan && M != -INFINITY && q[0] != -INFINITY) {
      const double e = ::exp(double(q[0]) - double(M));
      D += double(q[1]) * e;
      if (L.s1 >= 0) SE += (double(q[L.s1]) + (double(q[0]) - double(M)) * double(q[1])) * e;  // shifted to M
    }
    c.swz += q[3];
    c.zt += q[2];
    if (L.arg < 0) continue;
    const float v = q[L.arg];
    const int32_t ix = float_as_index(q[L.arg + 1]);
    if (ix == kNoRecordIndex) continue;
    const bool vn = v != v, bn = bv != bv;
    const bool better = c.argmax == kNoRecordIndex ? true
                        : vn && bn                  ? ix < c.argmax
                        : vn || bn                  ? vn
                        : v != bv                   ? v > bv
                                                    : ix < c.argmax;
    if (better) {
      bv = v;
      c.argmax = ix;
    }
  }
  if (nan) {
    c.lse = c.entropy = NAN;
    c.pair = {NAN, NAN};
  } else if (M == -INFINITY) {
    c.lse = -INFINITY;
    c.entropy = NAN;
    c.pair = {-INFINITY, 0.f};
  } else {
    c.logd = ::log(D);
    c.lse = float(double(M) + c.logd);
    c.entropy = L.s1 >= 0 ? float(c.logd - SE / D) : NAN;
    c.pair = {M, float(c.logd)};
  }
  return c;
}

// The row's loss and z-loss from combined statistics, for a target in range: w_t the target's class weight,
// wsum the sum of the class weights (V without weights), eps the label smoothing, zq the z-loss scale.
FCE_HD void ce_combined_loss(const CeCombined& c, double w_t, double eps, double V, double wsum, double zq,
                             float* loss, float* z_loss) {
  const double lse = double(c.pair.hi) + c.logd;
  // lse - z_t as (M - z_t) + log D: no rounding of lse's size enters the loss at a large offset.
  double l = (1.0 - eps) * w_t * ((double(c.pair.hi) - double(float(c.zt))) + c.logd);
  if (eps > 0) l += eps / V * (lse * wsum - c.swz);
  const double z = zq * lse * lse;
  *loss = float(l + z);
  *z_loss = float(z);
}

}  // namespace fce
