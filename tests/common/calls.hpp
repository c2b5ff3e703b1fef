// Calls of the library's ops with every output poisoned first, and small tensor builders, shared by the
// numerics tests (tests/unit/test_numerics.cpp, test_contract.cpp).
#pragma once
#include <algorithm>
#include <cstring>

#include "testing.hpp"

namespace fct {

inline Tensor matrix(DT dt, const std::vector<std::vector<double>>& rows) {
  Tensor t(dt, {int64_t(rows.size()), int64_t(rows[0].size())});
  for (size_t r = 0; r < rows.size(); ++r)
    for (size_t c = 0; c < rows[r].size(); ++c) t.set(int64_t(r), int64_t(c), rows[r][c]);
  t.upload();
  return t;
}

inline Tensor ints(DT dt, const std::vector<int64_t>& v) {
  Tensor t(dt, {int64_t(v.size())});
  for (size_t i = 0; i < v.size(); ++i) t.set_int(int64_t(i), v[i]);
  t.upload();
  return t;
}

inline Tensor floats(const std::vector<double>& v) {
  Tensor t(DT::F32, {int64_t(v.size())});
  for (size_t i = 0; i < v.size(); ++i) t.set(int64_t(i), v[i]);
  t.upload();
  return t;
}

inline Tensor poisoned(DT dt, std::vector<int64_t> shape) {
  Tensor t(dt, std::move(shape));
  t.poison();
  t.upload();
  return t;
}

inline double lse_of(const std::vector<double>& z) {
  double m = -INFINITY;
  for (double v : z) m = std::max(m, v);
  double s = 0;
  for (double v : z) s += std::exp(v - m);
  return m + std::log(s);
}

// Cross-entropy forward with every output (reduction NONE unless the options say otherwise).
struct Ce {
  Tensor loss, zl, lse, ent, amax, dl;
  fce_status_t status;
};
inline Ce ce_fwd(Tensor& logits, Tensor& targets, fce_ce_options_t o, const DLTensor* grad_loss = nullptr) {
  const int64_t N = logits.rows(), V = logits.cols();
  const bool none = o.reduction == FCE_REDUCTION_NONE;
  Ce r{none ? poisoned(DT::F32, {N}) : poisoned(DT::F32, {}), none ? poisoned(DT::F32, {N}) : poisoned(DT::F32, {}),
       poisoned(DT::F32, {N}), poisoned(DT::F32, {N}), poisoned(DT::I64, {N}), poisoned(logits.dtype(), {N, V}),
       FCE_STATUS_SUCCESS};
  Handle h;
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = r.loss.dl(); out.z_loss = r.zl.dl(); out.lse = r.lse.dl(); out.entropy = r.ent.dl();
  out.argmax = r.amax.dl(); out.dlogits = r.dl.dl(); out.grad_loss = grad_loss;
  r.status = fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0);
  for (Tensor* t : {&r.loss, &r.zl, &r.lse, &r.ent, &r.amax, &r.dl}) t->download();
  return r;
}

inline fce_ce_options_t ce_none() {
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = FCE_REDUCTION_NONE;
  return o;
}

struct Sm {
  Tensor p, lp;
  fce_status_t status;
};
inline Sm softmax(Tensor& x, fce_softmax_options_t o) {
  Sm r{poisoned(DT::F32, {x.rows(), x.cols()}), poisoned(DT::F32, {x.rows(), x.cols()}), FCE_STATUS_SUCCESS};
  Handle h;
  r.status = fce_temp_softmax(h, test_stream(), x.dl(), &o, r.p.dl(), r.lp.dl(), nullptr, 0);
  r.p.download();
  r.lp.download();
  return r;
}
inline fce_softmax_options_t temp(float T) {
  fce_softmax_options_t o = FCE_SOFTMAX_OPTIONS_INIT;
  o.temperature = T;
  return o;
}

struct Kd {
  Tensor loss, ds;
  fce_status_t status;
};
inline Kd kd(Tensor& s, const fce_kd_teacher_t& teacher, fce_kd_options_t o, const Tensor* targets = nullptr) {
  const bool none = o.reduction == FCE_REDUCTION_NONE;
  Kd r{none ? poisoned(DT::F32, {s.rows()}) : poisoned(DT::F32, {}), poisoned(s.dtype(), {s.rows(), s.cols()}),
       FCE_STATUS_SUCCESS};
  fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
  out.loss = r.loss.dl();
  out.dstudent = r.ds.dl();
  Handle h;
  r.status = fce_kd_loss(h, test_stream(), s.dl(), &teacher, targets ? const_cast<Tensor*>(targets)->dl() : nullptr,
                         &o, &out, nullptr, 0);
  r.loss.download();
  r.ds.download();
  return r;
}
inline fce_kd_teacher_t full(Tensor& t) {
  fce_kd_teacher_t r = FCE_KD_TEACHER_INIT;
  r.logits = t.dl();
  return r;
}
inline fce_kd_teacher_t topk(Tensor& ids, Tensor& lp) {
  fce_kd_teacher_t r = FCE_KD_TEACHER_INIT;
  r.topk_ids = ids.dl();
  r.topk_logprobs = lp.dl();
  return r;
}
inline fce_kd_options_t kd_opts(int div, int red = FCE_REDUCTION_NONE) {
  fce_kd_options_t o = FCE_KD_OPTIONS_INIT;
  o.divergence = div;
  o.reduction = red;
  return o;
}
inline bool bits_equal(const Tensor& a, const Tensor& b) {
  return a.bytes().size() == b.bytes().size() && std::memcmp(a.bytes().data(), b.bytes().data(), a.bytes().size()) == 0;
}

}  // namespace fct
