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

// Gradient of one cross-entropy row w.r.t. z_j (before the transform's derivative), PyTorch semantics
// with label smoothing e, class weights w, z-loss q:
//   dL/dz_j = g*[(1-e)*w_t*(p_j - [j==t]) + (e/V)*(W*p_j - w_j) + 2*q*lse*p_j]
//           = g*(cp*p_j - cw*w_j - [j==t]*ct)
struct CeGrad {
  float cp, cw, ct;
  // The entropy's term (grad_entropy): ge * dH/dz_j = ge * p_j (mu - z_j), mu = sum_k p_k z_k = lse - H.
  float ge = 0.f, mu = 0.f;
  FCE_HD CeGrad(float g, float eps, float w_t, float W, float inv_v, float zq, float lse) {
    const float a = (1.f - eps) * w_t, b = eps * inv_v;
    cp = g * (a + b * W + 2.f * zq * lse);
    cw = g * b;
    ct = g * a;
  }
  FCE_HD CeGrad& entropy(float g_entropy, float lse, float H) {
    ge = g_entropy;
    mu = lse - H;
    return *this;
  }
  FCE_HD float operator()(float p, float w_j, bool is_target) const {
    return cp * p - cw * w_j - (is_target ? ct : 0.f);
  }
  // With the entropy's term; a logit of -inf (p = 0) gets none (its mu - z is +inf).
  FCE_HD float operator()(float p, float w_j, bool is_target, float z) const {
    const float l = (*this)(p, w_j, is_target);
    return p == 0.f ? l : fmaf(ge * p, mu - z, l);
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

// ---- vocabulary-parallel logsumexp: the combine of the shards' records --------------------------------

// The lse of a row from W records (m, d) in rank order (record r at rec + r * stride), in fp64: NaN when a
// record is NaN, +inf when a max is +inf (its d is 1, the others' terms vanish), -inf without a finite max.
FCE_HD float lse_combine_records(const float* rec, int64_t W, int64_t stride) {
  double M = -INFINITY;
  for (int64_t r = 0; r < W; ++r) {
    const float m = rec[r * stride];
    if (m != m) return NAN;
    if (m > M) M = m;
  }
  if (M == INFINITY || M == -INFINITY) return float(M);
  double D = 0;
  for (int64_t r = 0; r < W; ++r) {
    const float* q = rec + r * stride;
    if (q[0] != -INFINITY) D += double(q[1]) * ::exp(double(q[0]) - M);
  }
  return float(M + ::log(D));
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
// or in Q, as fce_kd_loss's log-softmax); the log-probabilities' shifts M and log D of P and Q.
struct KdCombined {
  double kl;
  float mp, logdp, mq, logdq;
};
FCE_HD KdCombined kd_combine_records(const float* rec, int64_t W, int64_t stride) {
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
  const bool none = MP == -INFINITY || MQ == -INFINITY;
  k.kl = none ? NAN : c.x / c.dp - ::log(c.dp) + ::log(c.dq);
  k.mp = float(MP);
  k.mq = float(MQ);
  k.logdp = float(::log(c.dp));
  k.logdq = float(::log(c.dq));
  return k;
}

// ---- vocabulary-parallel cross-entropy: the combine of the shards' records ----------------------------

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

// A row's statistics from the W shards' records (rank order, record r at rec + r * stride; the first K of the
// kCeRecordFields fields: m, sum e^(z-m), z_t if owned, sum w z, then with K >= 5 sum e^(z-m) (z-m), and with
// K = 7 the largest raw logit and its global index as int32 bits). fp64, in rank order: the max first (a NaN
// max wins), then each shard's sums rescaled to it; the argmax takes NaN as the largest value, then the larger
// value, ties to the lower index. The same code on the CPU and in the CUDA combine kernel, so both give the
// same bits. Fields a record does not hold give entropy NaN and argmax kNoRecordIndex.
struct CeCombined {
  float lse, entropy;
  double zt, swz;   // the target's logit (from the shard that owns it), sum of w z
  int32_t argmax;   // kNoRecordIndex when no shard has a column
};
FCE_HD CeCombined ce_combine_records(const float* rec, int64_t W, int64_t stride, int64_t K) {
  bool nan = false;
  float M = -INFINITY;
  for (int64_t r = 0; r < W; ++r) {
    const float m = rec[r * stride];
    if (m != m) nan = true;
    else if (m > M) M = m;
  }
  double D = 0, SE = 0;
  CeCombined c{0.f, 0.f, 0.0, 0.0, kNoRecordIndex};
  float bv = -INFINITY;
  for (int64_t r = 0; r < W; ++r) {
    const float* q = rec + r * stride;
    if (!nan && M != -INFINITY && q[0] != -INFINITY) {
      const double e = ::exp(double(q[0]) - double(M));
      D += double(q[1]) * e;
      if (K > 4) SE += (double(q[4]) + (double(q[0]) - double(M)) * double(q[1])) * e;  // shifted to M
    }
    c.swz += q[3];
    c.zt += q[2];
    if (K < 7) continue;
    const float v = q[5];
    const int32_t ix = float_as_index(q[6]);
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
  } else if (M == -INFINITY) {
    c.lse = -INFINITY;
    c.entropy = NAN;
  } else {
    c.lse = float(double(M) + ::log(D));
    c.entropy = K > 4 ? float(::log(D) - SE / D) : NAN;
  }
  return c;
}

// The row's loss and z-loss from combined statistics, for a target in range: w_t the target's class weight,
// wsum the sum of the class weights (V without weights), eps the label smoothing, zq the z-loss scale.
FCE_HD void ce_combined_loss(const CeCombined& c, double w_t, double eps, double V, double wsum, double zq,
                             float* loss, float* z_loss) {
  const double lse = c.lse;
  double l = (1.0 - eps) * w_t * (lse - double(float(c.zt)));
  if (eps > 0) l += eps / V * (lse * wsum - c.swz);
  const double z = zq * lse * lse;
  *loss = float(l + z);
  *z_loss = float(z);
}

}  // namespace fce
