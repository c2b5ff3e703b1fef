// Float64 reference of cross-entropy (PyTorch semantics + z-loss, soft-cap, logit scale, entropy),
// written for the tests independently of the library.
#pragma once
#include <algorithm>

#include "testing.hpp"

namespace fct {

struct CeCase {
  int64_t N, V;
  DT dt = DT::F32;
  DT tdt = DT::I64;
  int64_t pad = 0;  // extra elements per row
  int reduction = FCE_REDUCTION_MEAN;
  double eps = 0, zq = 0, cap = 0, scale = 1;
  bool weights = false;
  double ignore_frac = 0.2;
  bool peaked = false;
  double logit_std = 2.0;
  int grad_mode = 1;  // 0 none, 1 default upstream (1), 2 explicit upstream
  bool inplace = false;
  bool lean = false;  // only loss, z-loss, lse and dlogits asked for (no entropy, no argmax)
  int64_t dpad = -1;  // dlogits row stride V + dpad (-1: V + pad + 1, a stride unlike the logits')
};

// The library's options for a case (class weights from `weights` when the case has them).
inline fce_ce_options_t options_of(const CeCase& c, Tensor& weights) {
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = c.reduction;
  o.label_smoothing = float(c.eps);
  o.z_loss_scale = float(c.zq);
  o.softcap = float(c.cap);
  o.logit_scale = float(c.scale);
  o.class_weights = c.weights ? weights.dl() : nullptr;
  return o;
}

// The case's class weights, when it has them: fp32 [V] uniform in [0.1, 2), uploaded, and their values (as
// the reference reads them) appended to w; an empty tensor otherwise.
inline Tensor class_weights(const CeCase& c, int64_t V, std::vector<double>& w) {
  Tensor t;
  if (!c.weights) return t;
  t = Tensor(DT::F32, {V});
  std::uniform_real_distribution<double> u(0.1, 2.0);
  for (int64_t j = 0; j < V; ++j) {
    t.set(j, u(rng()));
    w.push_back(t.get(j));
  }
  t.upload();
  return t;
}

struct Ref {
  std::vector<double> loss, lse, zl, ent, grad;
  std::vector<int64_t> amax;
  double total = 0, ztotal = 0, denom = 0;
};

// Independent float64 reference of PyTorch's cross_entropy (+ z-loss, soft-cap, scale, entropy).
inline Ref reference(const CeCase& c, const std::vector<double>& x, const std::vector<int64_t>& tg, const std::vector<double>& w,
              const std::vector<double>& gup) {
  const int64_t N = c.N, V = c.V;
  Ref r;
  r.loss.assign(N, 0); r.lse.assign(N, 0); r.zl.assign(N, 0); r.ent.assign(N, 0); r.amax.assign(N, 0);
  r.grad.assign(size_t(N * V), 0);
  auto wt = [&](int64_t j) { return w.empty() ? 1.0 : w[size_t(j)]; };
  double W = 0;
  for (int64_t j = 0; j < V; ++j) W += wt(j);
  for (int64_t i = 0; i < N; ++i)
    if (tg[i] != -100) r.denom += (tg[i] >= 0 && tg[i] < V) ? wt(tg[i]) : 1.0;
  std::vector<double> z(V);
  for (int64_t i = 0; i < N; ++i) {
    const double* xi = &x[size_t(i * V)];
    double m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) {
      z[j] = c.cap > 0 ? c.cap * std::tanh(c.scale * xi[j] / c.cap) : c.scale * xi[j];
      m = std::max(m, z[j]);
      if (xi[j] > xi[r.amax[i]]) r.amax[i] = j;
    }
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(z[j] - m);
    const double lse = m + std::log(s), ls = std::log(s);
    r.lse[i] = lse;
    // Every term from max-shifted values (z - m) - log s: even float64 loses log s beside a large m (at
    // |m| = 1e15 its ulp is 0.125; bf16 logits reach 3e38).
    auto logp = [&](int64_t j) { return (z[j] - m) - ls; };
    double ent = 0;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(logp(j));
      if (p > 0) ent -= p * logp(j);
    }
    r.ent[i] = ent;
    const int64_t t = tg[i];
    if (t == -100) continue;
    double smooth = 0;
    for (int64_t j = 0; j < V; ++j) smooth -= wt(j) * logp(j);
    r.zl[i] = c.zq * lse * lse;
    r.loss[i] = -(1 - c.eps) * wt(t) * logp(t) + c.eps / V * smooth + r.zl[i];
    double g = gup.size() == 1 ? gup[0] : gup.empty() ? 1.0 : gup[i];
    if (c.reduction == FCE_REDUCTION_MEAN) g /= r.denom;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(logp(j));
      double dz = (1 - c.eps) * wt(t) * (p - (j == t)) + c.eps / V * (W * p - wt(j)) + 2 * c.zq * lse * p;
      const double th = c.cap > 0 ? std::tanh(c.scale * xi[j] / c.cap) : 0;
      r.grad[size_t(i * V + j)] = g * dz * c.scale * (1 - th * th);
    }
  }
  for (int64_t i = 0; i < N; ++i) { r.total += r.loss[i]; r.ztotal += r.zl[i]; }
  if (c.reduction == FCE_REDUCTION_MEAN) {
    r.total = r.denom > 0 ? r.total / r.denom : 0;
    r.ztotal = r.denom > 0 ? r.ztotal / r.denom : 0;
  }
  return r;
}

// Linear cross-entropy's float64 gradients and their error bounds. The contract rounds the logits to the
// inputs' dtype (as torch's linear does), each moving by at most u*|x| (logit_roundoff), so a row's loss and
// lse by a few u*s*max|x| (linear_row_tol, s the logit scale). The gradients' error is bounded by u times the
// sums of |terms| in LinearCeGrads: dlogits rounded to the inputs' dtype (|err| <= u * sum |dl| |w|), the
// logits' rounding moving each p by up to 2*u*s*max|x|*p and, with a soft-cap, the cap's derivative
// s*sech^2(s*x/c) by up to 2*u*(s/c)*|tanh(s*x/c)*x| of itself (without that term a bf16 case failed ~1 run
// in 15 on an H100 and 2 in 300 in a float64 simulation of the rounding; with it the worst of those 300 is
// 0.67 of the tolerance).
inline double logit_roundoff(DT dt) { return dt == DT::BF16 ? 1.0 / 256 : dt == DT::F16 ? 1.0 / 2048 : 1e-6; }

// Per row, s * max |x| over the [N, V] logits x.
inline std::vector<double> scaled_row_max(const CeCase& c, const std::vector<double>& x, int64_t N, int64_t V) {
  std::vector<double> zabs(size_t(N), 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t v = 0; v < V; ++v) zabs[size_t(i)] = std::max(zabs[size_t(i)], std::fabs(x[size_t(i * V + v)]) * c.scale);
  return zabs;
}

inline double linear_row_tol(const CeCase& c, const Ref& ref, double u, const std::vector<double>& zabs, int64_t i) {
  return 1e-4 + 3 * u * zabs[size_t(i)] * (1 + 2 * c.zq * std::fabs(ref.lse[size_t(i)]));
}

// dhidden [N, H], dweight [n, H] and dbias [n] of the logits' columns [c0, c0 + n), each with the sum of its
// terms' error bounds per unit of u (a[...]).
struct LinearCeGrads {
  std::vector<double> dh, adh, dw, adw, db, adb;
};
inline LinearCeGrads linear_ce_grads(const CeCase& c, const Ref& ref, const std::vector<double>& x,
                                     const std::vector<int64_t>& tg, const std::vector<double>& hv,
                                     const std::vector<double>& wv, const std::vector<double>& zabs, int64_t N,
                                     int64_t V, int64_t H, int64_t c0, int64_t n) {
  LinearCeGrads r{std::vector<double>(size_t(N * H), 0), std::vector<double>(size_t(N * H), 0),
                  std::vector<double>(size_t(n * H), 0), std::vector<double>(size_t(n * H), 0),
                  std::vector<double>(size_t(n), 0), std::vector<double>(size_t(n), 0)};
  const double gs = c.reduction == FCE_REDUCTION_MEAN ? (ref.denom > 0 ? 1.0 / ref.denom : 0.0) : 1.0;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t v = 0; v < n; ++v) {
      const int64_t col = c0 + v;
      const double g = ref.grad[size_t(i * V + col)], xv = x[size_t(i * V + col)];
      const double z = c.cap > 0 ? c.cap * std::tanh(c.scale * xv / c.cap) : c.scale * xv;
      const double pv = tg[size_t(i)] == -100 ? 0.0 : std::exp(z - ref.lse[size_t(i)]);
      const double dcap = c.cap > 0 ? 2 * (c.scale / c.cap) * std::fabs(std::tanh(c.scale * xv / c.cap) * xv) : 0.0;
      const double err = std::fabs(g) * (1 + dcap) + 2 * zabs[size_t(i)] * pv * gs;
      r.db[size_t(v)] += g;
      r.adb[size_t(v)] += err;
      for (int64_t j = 0; j < H; ++j) {
        r.dh[size_t(i * H + j)] += g * wv[size_t(col * H + j)];
        r.adh[size_t(i * H + j)] += err * std::fabs(wv[size_t(col * H + j)]);
        r.dw[size_t(v * H + j)] += g * hv[size_t(i * H + j)];
        r.adw[size_t(v * H + j)] += err * std::fabs(hv[size_t(i * H + j)]);
      }
    }
  return r;
}

}  // namespace fct
