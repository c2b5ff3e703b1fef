// Cross-entropy on one fp32 row, shared by the cross-entropy and linear cross-entropy CPU backends.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common/math.hpp"
#include "common/ops.hpp"
#include "cpu/cpu_util.hpp"
#include "cpu/simd.hpp"

namespace fce::cpu {

// What the rows of one call share: options, class weights and their sum, the mean's denominator.
struct CeContext {
  const CeOpts& o;
  int64_t V;
  LogitTransform tf;
  std::vector<float> w;  // class weights, empty = all ones
  double W;              // sum of class weights (V without)
  CeContext(const CeOpts& opts, int64_t vocab)
      : o(opts), V(vocab), tf(opts.logit_scale, opts.softcap), W(double(vocab)) {
    if (o.class_weights) {
      w.resize(size_t(V));
      W = 0;
      for (int64_t j = 0; j < V; ++j) {
        w[size_t(j)] = load_f32(o.class_weights, j);
        W += class_weight_ok(w[size_t(j)]) ? double(w[size_t(j)]) : double(NAN);  // math.hpp: class_weight_ok
      }
    }
  }
  float weight(int64_t j) const { return w.empty() ? 1.f : w[size_t(j)]; }
  const float* weights() const { return w.empty() ? nullptr : w.data(); }
  bool identity() const { return tf.softcap == 0.f && tf.scale == 1.f; }
  // The transformed logits of raw row x: x itself for the identity transform, else zbuf (may be x).
  const float* transformed(const float* x, float* zbuf) const {
    if (identity()) return x;
    simd::transform(tf, x, V, zbuf);
    return zbuf;
  }
  bool ignored(int64_t t) const { return t == o.ignore_index; }
  bool in_range(int64_t t) const { return t >= 0 && t < V; }
  // A target whose row has a loss: in range, and its class weight in the domain (class_weight_ok).
  bool valid(int64_t t) const { return in_range(t) && class_weight_ok(weight(t)); }

  // Denominator of the mean: sum of w[t] over non-ignored rows; an out-of-range target counts 1.
  double mean_denominator(const Vec& targets) const {
    double d = 0;
    for (int64_t i = 0; i < targets.n; ++i) {
      const int64_t t = load_index(targets.data, targets.dtype, i);
      if (!ignored(t)) d += valid(t) ? weight(t) : 1.0;
    }
    return d;
  }

  // Scale of row i's gradient: upstream gradient, divided by the mean's denominator for MEAN.
  float grad_scale(const Vec& grad_loss, int64_t i, double denom) const {
    const float g = grad_loss ? load_f32(grad_loss, i) : 1.f;
    if (o.reduction == FCE_REDUCTION_MEAN) return denom > 0 ? float(double(g) / denom) : 0.f;
    return g;
  }
};

struct CeRow {
  float lse = 0, loss = 0, z_loss = 0, entropy = 0;
  LsePair pair{0.f, 0.f};  // the lse as (max z, log sum e^(z - max)), from which the gradient's p_j come
  int64_t argmax = 0;
  const float* z = nullptr;  // the transformed logits (CeContext::transformed)
};

// x: raw logits (fp32, V); zbuf: scratch for the transformed logits (may be x).
inline CeRow ce_row_forward(const CeContext& c, const float* x, float* zbuf, int64_t target, bool want_argmax) {
  const int64_t V = c.V;
  CeRow r;
  // Max and argmax of the raw row first (NaN counts as the largest, lowest index wins).
  const simd::MaxNan mx = simd::max_nan(x, V);
  if (want_argmax) r.argmax = simd::find_first(x, V, mx.nan ? NAN : mx.max);
  const float* z = r.z = c.transformed(x, zbuf);
  const bool smooth = c.o.label_smoothing > 0.f;
  double swz = 0, logs = 0;  // log of the shifted sum, in float64
  const float m = simd::transform1(c.tf, mx.max);
  if (mx.nan) {
    r.lse = r.entropy = NAN;
    r.pair = {NAN, NAN};
    logs = NAN;
  } else if (m == -INFINITY) {  // every logit -inf: no distribution
    r.lse = -INFINITY;
    r.entropy = NAN;
    r.pair = {-INFINITY, 0.f};
  }
  if (!mx.nan) {
    const simd::CeSums s = simd::ce_sums(z, V, m, c.weights(), smooth);
    swz = s.swz;
    if (m != -INFINITY) {
      logs = std::log(s.s);
      r.lse = float(double(m) + logs);
      r.pair = {m, float(logs)};
      // log s - sum p (z - m) in float64 from the shifted sums: lse - sum p z would keep the rounding of
      // values of the logits' size (7.7e-4 nats at an offset of 1e5)
      r.entropy = float(logs - s.sz / s.s);
    }
  }
  if (c.ignored(target)) return r;
  if (!c.valid(target)) {
    r.loss = r.z_loss = NAN;
    return r;
  }
  // lse - z_t as (m - z_t) + log s: no rounding of lse's size enters the loss at a large offset.
  const double lse = double(m) + logs, eps = c.o.label_smoothing;
  double loss = (1.0 - eps) * c.weight(target) * ((double(m) - double(z[target])) + logs);
  if (smooth) loss += eps / double(V) * (lse * c.W - swz);
  const double zl = double(c.o.z_loss_scale) * lse * lse;
  r.loss = float(loss + zl);
  r.z_loss = float(zl);
  return r;
}

// The entropy's upstream gradient of row i with the row's entropy H (ge = 0 without grad_entropy).
struct EntropyGrad {
  float ge = 0.f, H = 0.f;
};
inline EntropyGrad entropy_grad(const Vec& grad_entropy, int64_t i, float H) {
  return grad_entropy ? EntropyGrad{load_f32(grad_entropy, i), H} : EntropyGrad{};
}

// Gradient of the row's loss (times g) and entropy (times eg.ge) w.r.t. the raw logits of columns [0, n),
// from the transformed logits z and the lse (its pair: the probabilities from max-shifted values). A
// vocabulary shard passes its n real columns, its weights `w` and its local target; unsharded n = V,
// w = c.weights(), local_target = target.
inline void ce_row_grad(const CeContext& c, const float* z, int64_t n, const float* w, LsePair lse, int64_t target,
                        int64_t local_target, float g, const EntropyGrad& eg, float* dx) {
  if (!c.ignored(target) && !c.valid(target)) {  // NaN whatever the upstream gradient (the contract)
    std::fill(dx, dx + n, NAN);
    return;
  }
  const bool loss_grad = !c.ignored(target) && g != 0.f;
  if (!loss_grad && eg.ge == 0.f) {
    std::fill(dx, dx + n, 0.f);
    return;
  }
  // The weights' sum enters with label smoothing only (it is NaN when a weight is outside the domain).
  const float W = c.o.label_smoothing > 0.f ? float(c.W) : 0.f;
  CeGrad grad(loss_grad ? g : 0.f, c.o.label_smoothing, loss_grad ? c.weight(target) : 1.f, W,
              1.f / float(c.V), c.o.z_loss_scale, lse.value());
  if (eg.ge != 0.f) grad.entropy(eg.ge, eg.H);
  // The class weights of other columns enter with label smoothing only (a weight outside the domain of a
  // column that is not the target would otherwise put 0 * NaN into every row).
  simd::ce_grad(z, n, lse, grad, c.o.label_smoothing > 0.f ? w : nullptr, local_target, c.tf, dx);
}
inline void ce_row_grad(const CeContext& c, const float* z, LsePair lse, int64_t target, float g,
                        const EntropyGrad& eg, float* dx) {
  ce_row_grad(c, z, c.V, c.weights(), lse, target, target, g, eg, dx);
}

// Writes the SUM or MEAN of per-row losses (fixed order: deterministic whatever the thread count).
inline void reduce_losses(int reduction, const std::vector<double>& row_loss, const std::vector<double>& row_zl,
                          double denom, const Vec& loss, const Vec& z_loss) {
  if (reduction == FCE_REDUCTION_NONE) return;
  double sum = 0, zsum = 0;
  for (size_t i = 0; i < row_loss.size(); ++i) {
    sum += row_loss[i];
    zsum += row_zl[i];
  }
  if (reduction == FCE_REDUCTION_MEAN) {
    sum = denom > 0 ? sum / denom : 0.0;
    zsum = denom > 0 ? zsum / denom : 0.0;
  }
  store_f32(loss, 0, float(sum));
  if (z_loss) store_f32(z_loss, 0, float(zsum));
}

}  // namespace fce::cpu
