// Highway kernels behind cpu/simd.hpp, compiled once per x86/Arm target and dispatched at run time.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/simd.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep

#include "hwy/contrib/math/math-inl.h"
#include "hwy/highway.h"

#include <cmath>
#include <cstring>

#include "cpu/cpu_util.hpp"
#include "cpu/simd.hpp"

HWY_BEFORE_NAMESPACE();
namespace fce::cpu::simd {
namespace HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using D = hn::ScalableTag<float>;

// Highway converts fp16 exactly only with hardware conversions (x86 F16C from AVX2 on, Arm); its emulation
// truncates and maps inf and NaN to finite values, so other targets convert fp16 one element at a time.
#if HWY_TARGET == HWY_SCALAR || HWY_TARGET == HWY_EMU128 || \
    (HWY_ARCH_X86 && (HWY_TARGET >= HWY_SSE4 || defined(HWY_DISABLE_F16C)))
constexpr bool kVectorF16 = false;
#else
constexpr bool kVectorF16 = true;
#endif
using V = hn::Vec<D>;

// exp as std::exp behaves: NaN stays NaN, overflow gives +inf (Highway's Exp covers x <= 104 only).
HWY_INLINE V ExpFull(D d, V x) {
  V y = hn::Exp(d, x);
  y = hn::IfThenElse(hn::Ge(x, hn::Set(d, 88.72283935546875f)), hn::Set(d, INFINITY), y);
  return hn::IfThenElse(hn::IsNaN(x), x, y);
}

// Adds the lanes of v to a float64 accumulator pair (low and high halves).
struct Acc64 {
#if HWY_TARGET == HWY_SCALAR
  using DD = hn::Rebind<double, D>;
#else
  using DD = hn::Repartition<double, D>;
#endif
  DD dd;
  hn::Vec<DD> lo, hi;
  HWY_ATTR Acc64() : lo(hn::Zero(DD())), hi(hn::Zero(DD())) {}
  HWY_INLINE void add(V v) {
#if HWY_TARGET == HWY_SCALAR
    lo = hn::Add(lo, hn::PromoteTo(dd, v));
#else
    lo = hn::Add(lo, hn::PromoteTo(dd, hn::LowerHalf(hn::Half<D>(), v)));
    hi = hn::Add(hi, hn::PromoteTo(dd, hn::UpperHalf(hn::Half<D>(), v)));
#endif
  }
  HWY_INLINE double sum() const { return hn::GetLane(hn::SumOfLanes(dd, hn::Add(lo, hi))); }
};

// Loads and stores of n - j elements at the row's end go through a local buffer: nothing past a row's end
// is read or written (the rows of linear CE's chunk are adjacent, and other threads work on them).
HWY_INLINE V Ld(D d, const float* p, int64_t r) {
  if (r >= int64_t(hn::Lanes(d))) return hn::LoadU(d, p);
  HWY_ALIGN float buf[HWY_MAX_BYTES / sizeof(float)] = {};
  std::memcpy(buf, p, sizeof(float) * size_t(r));
  return hn::Load(d, buf);
}
HWY_INLINE void St(V v, D d, float* p, int64_t r) {
  if (r >= int64_t(hn::Lanes(d))) return hn::StoreU(v, d, p);
  HWY_ALIGN float buf[HWY_MAX_BYTES / sizeof(float)];
  hn::Store(v, d, buf);
  std::memcpy(p, buf, sizeof(float) * size_t(r));
}

void ToF32Impl(const char* src, DType t, int64_t n, float* dst) {
  if (t == DType::F32) {
    std::memcpy(dst, src, sizeof(float) * size_t(n));
    return;
  }
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  int64_t j = 0;
  if (t == DType::BF16) {
    const hn::Rebind<hwy::bfloat16_t, D> db;
    const auto* p = reinterpret_cast<const hwy::bfloat16_t*>(src);
    for (; j + N <= n; j += N) hn::StoreU(hn::PromoteTo(d, hn::LoadU(db, p + j)), d, dst + j);
  } else if (t == DType::F16 && kVectorF16) {
    const hn::Rebind<hwy::float16_t, D> dh;
    const auto* p = reinterpret_cast<const hwy::float16_t*>(src);
    for (; j + N <= n; j += N) hn::StoreU(hn::PromoteTo(d, hn::LoadU(dh, p + j)), d, dst + j);
  }
  const size_t es = dtype_size(t);
  for (; j < n; ++j) dst[j] = load(src + es * size_t(j), t);
}

void FromF32Impl(const float* src, int64_t n, DType t, char* dst) {
  if (t == DType::F32) {
    std::memcpy(dst, src, sizeof(float) * size_t(n));
    return;
  }
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  int64_t j = 0;
  if (t == DType::BF16) {
    const hn::RebindToUnsigned<D> du;
    const hn::RebindToSigned<D> di;
    const hn::Rebind<uint16_t, D> d16;
    auto* p = reinterpret_cast<uint16_t*>(dst);
    for (; j + N <= n; j += N) {
      const V v = hn::LoadU(d, src + j);
      const auto u = hn::BitCast(du, v);
      // round to nearest even; a NaN keeps its top bits with the quiet bit set
      const auto odd = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u));
      auto r = hn::ShiftRight<16>(hn::Add(hn::Add(u, hn::Set(du, 0x7fffu)), odd));
      r = hn::IfThenElse(hn::RebindMask(du, hn::IsNaN(v)), hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40u)), r);
      hn::StoreU(hn::DemoteTo(d16, hn::BitCast(di, r)), d16, p + j);
    }
  } else if (t == DType::F16 && kVectorF16) {
    const hn::Rebind<hwy::float16_t, D> dh;
    auto* p = reinterpret_cast<hwy::float16_t*>(dst);
    for (; j + N <= n; j += N) hn::StoreU(hn::DemoteTo(dh, hn::LoadU(d, src + j)), dh, p + j);
  }
  const size_t es = dtype_size(t);
  for (; j < n; ++j) store(dst + es * size_t(j), t, src[j]);
}

MaxNan MaxNanImpl(const float* x, int64_t n) {
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  const V ninf = hn::Set(d, -INFINITY);
  V m0 = ninf, m1 = ninf;
  auto nan = hn::FirstN(d, 0);
  int64_t j = 0;
  for (; j + 2 * N <= n; j += 2 * N) {
    const V a = hn::LoadU(d, x + j), b = hn::LoadU(d, x + j + N);
    const auto na = hn::IsNaN(a), nb = hn::IsNaN(b);
    nan = hn::Or(nan, hn::Or(na, nb));
    m0 = hn::Max(m0, hn::IfThenElse(na, ninf, a));
    m1 = hn::Max(m1, hn::IfThenElse(nb, ninf, b));
  }
  for (; j < n; j += N) {
    const auto in = hn::FirstN(d, size_t(n - j));
    const V a = hn::IfThenElse(in, Ld(d, x + j, n - j), ninf);
    const auto na = hn::IsNaN(a);
    nan = hn::Or(nan, na);
    m0 = hn::Max(m0, hn::IfThenElse(na, ninf, a));
  }
  return {hn::GetLane(hn::MaxOfLanes(d, hn::Max(m0, m1))), !hn::AllFalse(d, nan)};
}

int64_t FindFirstImpl(const float* x, int64_t n, float v) {
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  const bool want_nan = std::isnan(v);
  const V vv = hn::Set(d, v);
  for (int64_t j = 0; j < n; j += N) {
    const V a = Ld(d, x + j, n - j);
    const auto hit = hn::And(want_nan ? hn::IsNaN(a) : hn::Eq(a, vv), hn::FirstN(d, size_t(n - j)));
    const intptr_t k = hn::FindFirstTrue(d, hit);
    if (k >= 0) return j + k;
  }
  return -1;
}

HWY_INLINE V Transform(D d, const LogitTransform& tf, V x) {
  if (tf.softcap > 0.f) {
    const V arg = hn::Mul(hn::Mul(hn::Set(d, tf.arg_scale), x), hn::Set(d, tf.inv_cap));
    // Highway's Tanh is for finite arguments: +-inf saturate to +-1 explicitly.
    V t = hn::Tanh(d, arg);
    t = hn::IfThenElse(hn::IsInf(arg), hn::CopySign(hn::Set(d, 1.f), arg), t);
    return hn::Mul(hn::Set(d, tf.softcap), t);
  }
  return hn::Mul(hn::Set(d, tf.scale), x);
}

HWY_INLINE V Derivative(D d, const LogitTransform& tf, V z) {
  if (tf.softcap > 0.f) {
    const V t = hn::Mul(hn::Mul(z, hn::Set(d, tf.pre)), hn::Set(d, tf.inv_cap));
    return hn::Mul(hn::Set(d, tf.scale), hn::Sub(hn::Set(d, 1.f), hn::Mul(t, t)));
  }
  return hn::Set(d, tf.scale);
}

void TransformImpl(const LogitTransform& tf, const float* x, int64_t n, float* z) {
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  for (int64_t j = 0; j < n; j += N) St(Transform(d, tf, Ld(d, x + j, n - j)), d, z + j, n - j);
}

float Transform1Impl(const LogitTransform& tf, float x) {
  const D d;
  return hn::GetLane(Transform(d, tf, hn::Set(d, x)));
}

CeSums CeSumsImpl(const float* z, int64_t n, float m, const float* w, bool want_swz) {
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  const V mv = hn::Set(d, m), one = hn::Set(d, 1.f);
  Acc64 s, sz, swz;
  for (int64_t j = 0; j < n; j += N) {
    const auto in = hn::FirstN(d, size_t(n - j));
    const V zj = Ld(d, z + j, n - j);
    const V e = hn::IfThenElseZero(in, ExpFull(d, hn::Sub(zj, mv)));
    s.add(e);
    // e (z - m): shifted, so that the entropy keeps its precision at any offset of the logits
    sz.add(hn::IfThenElseZero(hn::Gt(e, hn::Zero(d)), hn::Mul(e, hn::Sub(zj, mv))));
    if (want_swz) swz.add(hn::IfThenElseZero(in, hn::Mul(w ? Ld(d, w + j, n - j) : one, zj)));
  }
  return {s.sum(), sz.sum(), want_swz ? swz.sum() : 0.0};
}

void CeGradImpl(const float* z, int64_t n, LsePair lse, const CeGrad& g, const float* w, int64_t target,
                const LogitTransform& tf, float* dx) {
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  const V hi = hn::Set(d, lse.hi), lo = hn::Set(d, lse.lo), cp = hn::Set(d, g.cp), cw = hn::Set(d, g.cw),
          ct = hn::Set(d, g.ct);
  const V gev = hn::Set(d, g.ge), nh = hn::Set(d, -g.H);
  const V one = hn::Set(d, 1.f), iota = hn::Iota(d, 0.f);
  for (int64_t j = 0; j < n; j += N) {
    const V zj = Ld(d, z + j, n - j);
    const V lp = hn::Sub(hn::Sub(zj, hi), lo);  // log p_j from the max-shifted value (LsePair)
    const V p = ExpFull(d, lp);
    V dz = hn::Sub(hn::Mul(cp, p), hn::Mul(cw, w ? Ld(d, w + j, n - j) : one));
    if (target >= j && target < j + N)
      dz = hn::Sub(dz, hn::IfThenElseZero(hn::Eq(iota, hn::Set(d, float(target - j))), ct));
    if (g.ge != 0.f)  // CeGrad's entropy term, ge p_j (-log p_j - H), none where p = 0
      dz = hn::IfThenElse(hn::Gt(p, hn::Zero(d)), hn::MulAdd(hn::Mul(gev, p), hn::Sub(nh, lp), dz), dz);
    St(hn::Mul(dz, Derivative(d, tf, zj)), d, dx + j, n - j);
  }
}

double ExpSumImpl(const float* x, int64_t n, float m, float scale) {
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  const V mv = hn::Set(d, m), sv = hn::Set(d, scale);
  Acc64 s;
  for (int64_t j = 0; j < n; j += N) {
    const V e = ExpFull(d, hn::Mul(hn::Sub(Ld(d, x + j, n - j), mv), sv));
    s.add(hn::IfThenElseZero(hn::FirstN(d, size_t(n - j)), e));
  }
  return s.sum();
}

double SoftmaxExpImpl(const SoftmaxShift& sh, const float* x, int64_t n, float* dout, float* eout) {
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  const V ninf = hn::Set(d, -INFINITY), m = hn::Set(d, sh.m), a = hn::Set(d, sh.a), b = hn::Set(d, sh.b),
          c = hn::Set(d, sh.c);
  Acc64 s;
  for (int64_t j = 0; j < n; j += N) {
    const V xj = Ld(d, x + j, n - j);
    V dj = hn::Mul(hn::MulAdd(xj, a, b), c);
    dj = hn::IfThenZeroElse(hn::Eq(xj, m), dj);
    dj = hn::IfThenElse(hn::Eq(xj, ninf), ninf, dj);
    const V e = ExpFull(d, dj);
    St(dj, d, dout + j, n - j);
    St(e, d, eout + j, n - j);
    s.add(hn::IfThenElseZero(hn::FirstN(d, size_t(n - j)), e));
  }
  return s.sum();
}

void SoftmaxFinishImpl(float* e, float* dv, int64_t n, float inv_s, float log_s) {
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  const V is = hn::Set(d, inv_s), ls = hn::Set(d, log_s);
  for (int64_t j = 0; j < n; j += N) {
    St(hn::Mul(Ld(d, e + j, n - j), is), d, e + j, n - j);
    St(hn::Sub(Ld(d, dv + j, n - j), ls), d, dv + j, n - j);
  }
}

bool LogSoftmaxImpl(const float* x, int64_t n, float inv_t, float* out) {
  const MaxNan mn = MaxNanImpl(x, n);
  if (mn.nan || mn.max == -INFINITY) return false;
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  const V m = hn::Set(d, mn.max), it = hn::Set(d, inv_t);
  Acc64 s;
  for (int64_t j = 0; j < n; j += N) {
    const V u = hn::Mul(hn::Sub(Ld(d, x + j, n - j), m), it);
    St(u, d, out + j, n - j);
    s.add(hn::IfThenElseZero(hn::FirstN(d, size_t(n - j)), ExpFull(d, u)));
  }
  const V ls = hn::Set(d, float(std::log(s.sum())));
  for (int64_t j = 0; j < n; j += N) St(hn::Sub(Ld(d, out + j, n - j), ls), d, out + j, n - j);
  return true;
}

// p * (logp - logq), 0 where p is 0 (xlogratio).
HWY_INLINE V XLogRatio(D d, V p, V lp, V lq) { return hn::IfThenZeroElse(hn::Eq(p, hn::Zero(d)), hn::Mul(p, hn::Sub(lp, lq))); }

KdSums KdTermsImpl(const KdTerm& term, const float* logp, const float* logq, int64_t n, float* aout) {
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  const V zero = hn::Zero(d), one = hn::Set(d, 1.f), ninf = hn::Set(d, -INFINITY);
  const V beta = hn::Set(d, term.beta), omb = hn::Set(d, 1.f - term.beta), lb = hn::Set(d, term.log_beta),
          l1mb = hn::Set(d, term.log_1mbeta);
  Acc64 loss, asum;
  for (int64_t j = 0; j < n; j += N) {
    const auto in = hn::FirstN(d, size_t(n - j));
    const V lp = Ld(d, logp + j, n - j), lq = Ld(d, logq + j, n - j);
    const V p = ExpFull(d, lp), q = ExpFull(d, lq);
    const auto q0 = hn::Eq(q, zero);
    V a, l;
    if (term.divergence == 0) {
      a = hn::Neg(p);
      l = XLogRatio(d, p, lp, lq);
    } else if (term.divergence == 1) {
      a = hn::IfThenZeroElse(q0, hn::Mul(q, hn::Add(hn::Sub(lq, lp), one)));
      l = XLogRatio(d, q, lq, lp);
    } else {
      const V x = hn::Add(lb, lp), y = hn::Add(l1mb, lq);
      const V mx = hn::Max(x, y);
      V lae = hn::Add(mx, hn::Log1p(d, ExpFull(d, hn::Neg(hn::Abs(hn::Sub(x, y))))));
      lae = hn::IfThenElse(hn::Eq(mx, ninf), ninf, lae);
      const V logm = hn::IfThenElse(hn::Eq(lp, lq), lp, lae);
      a = hn::IfThenZeroElse(q0, hn::Mul(hn::Mul(q, omb), hn::Sub(lq, logm)));
      l = hn::Add(hn::Mul(beta, XLogRatio(d, p, lp, logm)), hn::Mul(omb, XLogRatio(d, q, lq, logm)));
    }
    St(a, d, aout + j, n - j);
    loss.add(hn::IfThenElseZero(in, l));
    asum.add(hn::IfThenElseZero(in, a));
  }
  return {loss.sum(), asum.sum()};
}

void KdGradRowImpl(const float* a, const float* logq, int64_t n, float A, float scale, float* grad) {
  if (A == INFINITY) {  // the limit kd_grad defines; rare (reverse KL with a teacher probability of 0)
    for (int64_t j = 0; j < n; ++j) {
      const float v = kd_grad(a ? a[j] : 0.f, std::exp(logq[j]), A, 1.f);
      grad[j] = (scale == 0.f && std::isinf(v)) ? 0.f : v * scale;
    }
    return;
  }
  const D d;
  const int64_t N = int64_t(hn::Lanes(d));
  const V Av = hn::Set(d, A), sv = hn::Set(d, scale), zero = hn::Zero(d);
  for (int64_t j = 0; j < n; j += N) {
    const V q = ExpFull(d, Ld(d, logq + j, n - j));
    const V aj = a ? Ld(d, a + j, n - j) : zero;
    const V v = hn::IfThenElse(hn::Eq(q, zero), aj, hn::Sub(aj, hn::Mul(q, Av)));
    V r = hn::Mul(v, sv);
    if (scale == 0.f) r = hn::IfThenElse(hn::IsInf(v), zero, r);
    St(r, d, grad + j, n - j);
  }
}

}  // namespace HWY_NAMESPACE
}  // namespace fce::cpu::simd
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace fce::cpu::simd {
HWY_EXPORT(ToF32Impl);
HWY_EXPORT(FromF32Impl);
HWY_EXPORT(MaxNanImpl);
HWY_EXPORT(FindFirstImpl);
HWY_EXPORT(TransformImpl);
HWY_EXPORT(Transform1Impl);
HWY_EXPORT(CeSumsImpl);
HWY_EXPORT(CeGradImpl);
HWY_EXPORT(ExpSumImpl);
HWY_EXPORT(SoftmaxExpImpl);
HWY_EXPORT(SoftmaxFinishImpl);
HWY_EXPORT(LogSoftmaxImpl);
HWY_EXPORT(KdTermsImpl);
HWY_EXPORT(KdGradRowImpl);

void to_f32(const char* src, DType t, int64_t n, float* dst) { HWY_DYNAMIC_DISPATCH(ToF32Impl)(src, t, n, dst); }
void from_f32(const float* src, int64_t n, DType t, char* dst) { HWY_DYNAMIC_DISPATCH(FromF32Impl)(src, n, t, dst); }
MaxNan max_nan(const float* x, int64_t n) { return HWY_DYNAMIC_DISPATCH(MaxNanImpl)(x, n); }
int64_t find_first(const float* x, int64_t n, float v) { return HWY_DYNAMIC_DISPATCH(FindFirstImpl)(x, n, v); }
void transform(const LogitTransform& tf, const float* x, int64_t n, float* z) {
  HWY_DYNAMIC_DISPATCH(TransformImpl)(tf, x, n, z);
}
float transform1(const LogitTransform& tf, float x) { return HWY_DYNAMIC_DISPATCH(Transform1Impl)(tf, x); }
CeSums ce_sums(const float* z, int64_t n, float m, const float* w, bool want_swz) {
  return HWY_DYNAMIC_DISPATCH(CeSumsImpl)(z, n, m, w, want_swz);
}
void ce_grad(const float* z, int64_t n, LsePair lse, const CeGrad& g, const float* w, int64_t target,
             const LogitTransform& tf, float* dx) {
  HWY_DYNAMIC_DISPATCH(CeGradImpl)(z, n, lse, g, w, target, tf, dx);
}
double exp_sum(const float* x, int64_t n, float m, float scale) { return HWY_DYNAMIC_DISPATCH(ExpSumImpl)(x, n, m, scale); }
double softmax_exp(const SoftmaxShift& shift, const float* x, int64_t n, float* d, float* e) {
  return HWY_DYNAMIC_DISPATCH(SoftmaxExpImpl)(shift, x, n, d, e);
}
void softmax_finish(float* e, float* d, int64_t n, float inv_s, float log_s) {
  HWY_DYNAMIC_DISPATCH(SoftmaxFinishImpl)(e, d, n, inv_s, log_s);
}
bool log_softmax(const float* x, int64_t n, float inv_t, float* out) {
  return HWY_DYNAMIC_DISPATCH(LogSoftmaxImpl)(x, n, inv_t, out);
}
KdSums kd_terms(const KdTerm& term, const float* logp, const float* logq, int64_t n, float* a) {
  return HWY_DYNAMIC_DISPATCH(KdTermsImpl)(term, logp, logq, n, a);
}
void kd_grad_row(const float* a, const float* logq, int64_t n, float A, float scale, float* grad) {
  HWY_DYNAMIC_DISPATCH(KdGradRowImpl)(a, logq, n, A, scale, grad);
}
}  // namespace fce::cpu::simd
#endif
