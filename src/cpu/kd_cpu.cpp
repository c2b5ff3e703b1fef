#include <algorithm>
#include <cmath>
#include <vector>

#include "common/math.hpp"
#include "common/ops.hpp"
#include "cpu/cpu_util.hpp"

namespace fce::cpu {

size_t kd_workspace(const KdProblem&) { return 0; }

void kd(const KdProblem& p, Workspace) {
  const int64_t N = p.student.rows, V = p.student.cols;
  const int64_t K = p.topk() ? p.topk_ids.cols : 0;
  const double inv_t = 1.0 / double(p.o.temperature);
  const float t2 = p.o.scale_by_t2 ? p.o.temperature * p.o.temperature : 1.f;
  const KdTerm term(p.o.divergence, p.o.beta);
  const bool renorm = p.topk() && p.o.topk_norm == FCE_KD_TOPK_RENORMALIZE;
  std::vector<double> row_loss(static_cast<size_t>(N));
  // Masked rows (ignored target, or a top-K row with no used slot) are known before any gradient is
  // formed, so batchmean's count scales the gradient in the same pass.
  auto masked_row = [&](int64_t i) {
    if (p.targets && load_index(p.targets.data, p.targets.dtype, i) == p.o.ignore_index) return true;
    if (!p.topk()) return false;
    const char* idrow = row_ptr(p.topk_ids, i);
    for (int64_t k = 0; k < K; ++k)
      if (load_index(idrow, p.topk_ids.dtype, k) >= 0) return false;
    return true;
  };
  int64_t used = 0;
  for (int64_t i = 0; i < N; ++i) used += !masked_row(i);

#pragma omp parallel
  {
    const int64_t nt = p.topk() ? K : V;
    simd::Row xsbuf(V), lq(V), gbuf(V), xt(nt), lpt(nt), a(nt), sel(nt), lsel(nt);
    std::vector<int64_t> ids(static_cast<size_t>(K));
    auto log_softmax = [&](const float* x, int64_t n, float* out) {  // NaN everywhere for a row without one
      if (!simd::log_softmax(x, n, float(inv_t), out)) std::fill(out, out + n, NAN);
    };
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const bool masked = masked_row(i);
      const float* xs = row_in(p.student, i, xsbuf.data());
      log_softmax(xs, V, lq.data());
      double loss = 0;
      float A = 0.f;
      bool bad = false;
      if (!p.topk()) {
        log_softmax(row_in(p.teacher, i, xt.data()), V, lpt.data());
        const simd::KdSums ks = simd::kd_terms(term, lpt.data(), lq.data(), V, a.data());
        loss = ks.loss;
        A = float(ks.asum);
      } else {
        // Teacher over its K ids: softmax_K(logprobs / T); negative ids are unused slots.
        const char* idrow = row_ptr(p.topk_ids, i);
        const char* lprow = row_ptr(p.topk_lp, i);
        for (int64_t k = 0; k < K; ++k) {
          ids[size_t(k)] = load_index(idrow, p.topk_ids.dtype, k);
          if (ids[size_t(k)] >= V) bad = true;
          xt[k] = ids[size_t(k)] >= 0 ? load(lprow + 4 * size_t(k), DType::F32) : -INFINITY;
          sel[k] = ids[size_t(k)] >= 0 && !bad ? xs[ids[size_t(k)]] : -INFINITY;
        }
        if (!masked && !bad) {
          log_softmax(xt.data(), K, lpt.data());
          if (renorm) log_softmax(sel.data(), K, lsel.data());
          double asum = 0;
          for (int64_t k = 0; k < K; ++k) {
            a[k] = 0.f;
            if (ids[size_t(k)] < 0) continue;
            const float lqk = renorm ? lsel[k] : lq[ids[size_t(k)]];
            float ak;
            loss += term(lpt[k], lqk, &ak);
            a[k] = ak;
            asum += ak;
          }
          A = float(asum);
        }
      }
      if (bad && !masked) loss = NAN;
      row_loss[size_t(i)] = masked ? 0.0 : loss * t2;
      if (p.o.reduction == FCE_REDUCTION_NONE) store_f32(p.loss, i, float(row_loss[size_t(i)]));
      if (!p.dstudent) continue;
      float* grad = row_out(p.dstudent, i, gbuf.data());  // x and lq are read whole: dstudent may be the student
      if (masked) {
        std::fill(grad, grad + V, 0.f);
      } else if (bad) {
        std::fill(grad, grad + V, NAN);
      } else {
        float g = p.grad_loss ? load_f32(p.grad_loss, i) : 1.f;
        if (p.o.reduction == FCE_REDUCTION_MEAN) g = float(double(g) / double(used));
        const float s = g * t2 * float(inv_t);
        auto scaled = [s](float v) { return (s == 0.f && std::isinf(v)) ? 0.f : v * s; };
        if (!p.topk()) {
          simd::kd_grad_row(a.data(), lq.data(), V, A, s, grad);
        } else {
          // -q_j A everywhere (full vocabulary), then a_k - q_k A at the ids.
          if (renorm) std::fill(grad, grad + V, 0.f);
          else simd::kd_grad_row(nullptr, lq.data(), V, A, s, grad);
          for (int64_t k = 0; k < K; ++k) {
            const int64_t id = ids[size_t(k)];
            if (id < 0) continue;
            grad[id] = scaled(kd_grad(a[k], std::exp(renorm ? lsel[k] : lq[id]), A, 1.f));
          }
        }
      }
      row_out_done(p.dstudent, i, grad);
    }
  }
  double sum = 0;
  for (int64_t i = 0; i < N; ++i) sum += row_loss[size_t(i)];
  if (p.o.reduction != FCE_REDUCTION_NONE) {
    if (p.o.reduction == FCE_REDUCTION_MEAN) sum = used > 0 ? sum / double(used) : 0.0;
    store_f32(p.loss, 0, float(sum));
  }
}

}  // namespace fce::cpu
