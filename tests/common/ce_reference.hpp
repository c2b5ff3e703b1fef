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
    const double lse = m + std::log(s);
    r.lse[i] = lse;
    double ent = 0;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(z[j] - lse);
      if (p > 0) ent -= p * (z[j] - lse);
    }
    r.ent[i] = ent;
    const int64_t t = tg[i];
    if (t == -100) continue;
    double smooth = 0;
    for (int64_t j = 0; j < V; ++j) smooth += wt(j) * (lse - z[j]);
    r.zl[i] = c.zq * lse * lse;
    r.loss[i] = (1 - c.eps) * wt(t) * (lse - z[t]) + c.eps / V * smooth + r.zl[i];
    double g = gup.size() == 1 ? gup[0] : gup.empty() ? 1.0 : gup[i];
    if (c.reduction == FCE_REDUCTION_MEAN) g /= r.denom;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(z[j] - lse);
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

}  // namespace fct
