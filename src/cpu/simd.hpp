// Vectorized row primitives of the CPU backend (Highway, the widest instruction set the CPU has, chosen at
// run time). Every sum is over one row in a fixed order, so results do not depend on the thread count; they
// may differ in the last bits between CPUs of different vector widths.
// Nothing past a row's n elements is read or written. Exponentials are Highway's Exp (at most 1 ulp in fp32), with NaN kept as NaN and
// arguments above log(FLT_MAX) giving +inf, as std::exp does.
#pragma once
#include <cstdint>
#include <vector>

#include "common/math.hpp"
#include "common/tensor.hpp"

namespace fce::cpu::simd {

// A per-thread fp32 row buffer, indexed by int64_t.
struct Row {
  std::vector<float> v;
  explicit Row(int64_t n = 0) : v(size_t(n), 0.f) {}
  float* data() { return v.data(); }
  const float* data() const { return v.data(); }
  float& operator[](int64_t j) { return v[size_t(j)]; }
  float operator[](int64_t j) const { return v[size_t(j)]; }
};

// Converts n contiguous elements of dtype t (F32, BF16, F16) to fp32, and back with round-to-nearest-even.
void to_f32(const char* src, DType t, int64_t n, float* dst);
void from_f32(const float* src, int64_t n, DType t, char* dst);

// Largest non-NaN element (-inf when none) and whether a NaN was seen.
struct MaxNan {
  float max;
  bool nan;
};
MaxNan max_nan(const float* x, int64_t n);
// First j with x[j] == v (v not NaN), or with x[j] NaN when v is NaN; -1 when none.
int64_t find_first(const float* x, int64_t n, float v);

// z = tf(x) elementwise (may be in place); tf1 is the same arithmetic on one value, bit for bit.
void transform(const LogitTransform& tf, const float* x, int64_t n, float* z);
float transform1(const LogitTransform& tf, float x);

// Cross-entropy row sums over transformed logits z with shift m: s = sum e_j, e_j = exp(z_j - m);
// sz = sum e_j (z_j - m) over e_j > 0 (entropy); swz = sum w_j z_j (label smoothing; w null = ones), in float64.
struct CeSums {
  double s, sz, swz;
};
CeSums ce_sums(const float* z, int64_t n, float m, const float* w, bool want_swz);
// dx_j = g(p_j, w_j, j == target, log p_j) * tf'(z_j), log p_j = (z_j - lse.hi) - lse.lo (CeGrad, with its
// entropy term); w null = ones.
void ce_grad(const float* z, int64_t n, LsePair lse, const CeGrad& g, const float* w, int64_t target,
             const LogitTransform& tf, float* dx);

// sum_j exp((x_j - m) * scale) in float64.
double exp_sum(const float* x, int64_t n, float m, float scale);

// Temperature softmax: d_j = shift(x_j) (SoftmaxShift), e_j = exp(d_j); returns sum e_j in float64.
double softmax_exp(const SoftmaxShift& shift, const float* x, int64_t n, float* d, float* e);
// prob_j = e_j * inv_s, logp_j = d_j - log_s (in place over e and d).
void softmax_finish(float* e, float* d, int64_t n, float inv_s, float log_s);

// out_j = (x_j - m) * inv_t - log sum_k exp((x_k - m) * inv_t), m = max; false (out untouched) when the row
// has a NaN or no value above -inf.
bool log_softmax(const float* x, int64_t n, float inv_t, float* out);

// Knowledge-distillation terms over a row: a_j and sum of the loss terms and of a_j (KdTerm), float64.
struct KdSums {
  double loss, asum;
};
KdSums kd_terms(const KdTerm& term, const float* logp, const float* logq, int64_t n, float* a);
// grad_j = kd_grad(a_j, exp(logq_j), A, 1) * scale, where scale = 0 maps an infinite value to 0;
// a null gives a_j = 0.
void kd_grad_row(const float* a, const float* logq, int64_t n, float A, float scale, float* grad);

}  // namespace fce::cpu::simd
