#include <cmath>
#include <vector>

#include "common/math.hpp"
#include "common/ops.hpp"
#include "cpu/cpu_util.hpp"

namespace fce::cpu {

size_t kd_workspace(const KdProblem&) { return 0; }

namespace {

// Log-softmax of x[0..n) / T from max-shifted values: u_j = (x_j - max) / T in double (the difference is
// exact), log q_j = u_j - log sum_k e^(u_k), rounded once to fp32, so no error grows with a common offset
// of the logits. -inf stays -inf; NaN, or a row without a finite value, gives NaN everywhere.
void log_softmax(const float* x, int64_t n, double inv_t, float* out) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::fmax(m, x[j]);
  if (m == -INFINITY) {
    for (int64_t j = 0; j < n; ++j) out[j] = NAN;
    return;
  }
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += std::exp((double(x[j]) - double(m)) * inv_t);
  const double log_s = std::log(s);
  for (int64_t j = 0; j < n; ++j) out[j] = float((double(x[j]) - double(m)) * inv_t - log_s);
}

}  // namespace

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
    const size_t nt = size_t(p.topk() ? K : V);
    std::vector<float> xs(static_cast<size_t>(V)), lq(static_cast<size_t>(V)), xt(nt), lpt(nt), a(nt),
        grad(static_cast<size_t>(V)), sel(nt), lsel(nt);
    std::vector<int64_t> ids(static_cast<size_t>(K));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const bool masked = masked_row(i);
      load_row(p.student, i, xs.data());
      log_softmax(xs.data(), V, inv_t, lq.data());
      double loss = 0, asum = 0;
      bool bad = false;
      if (!p.topk()) {
        load_row(p.teacher, i, xt.data());
        log_softmax(xt.data(), V, inv_t, lpt.data());
        for (int64_t j = 0; j < V; ++j) {
          float aj;
          loss += term(lpt[size_t(j)], lq[size_t(j)], &aj);
          a[size_t(j)] = aj;
          asum += aj;
        }
        for (int64_t j = 0; j < V; ++j) grad[size_t(j)] = kd_grad(a[size_t(j)], std::exp(lq[size_t(j)]), float(asum), 1.f);
      } else {
        // Teacher over its K ids: softmax_K(logprobs / T); negative ids are unused slots.
        const char* idrow = row_ptr(p.topk_ids, i);
        const char* lprow = row_ptr(p.topk_lp, i);
        for (int64_t k = 0; k < K; ++k) {
          ids[size_t(k)] = load_index(idrow, p.topk_ids.dtype, k);
          if (ids[size_t(k)] >= V) bad = true;
          xt[size_t(k)] = ids[size_t(k)] >= 0 ? load(lprow + 4 * size_t(k), DType::F32) : -INFINITY;
          sel[size_t(k)] = ids[size_t(k)] >= 0 && !bad ? xs[size_t(ids[size_t(k)])] : -INFINITY;
        }
        if (!masked && !bad) {
          log_softmax(xt.data(), K, inv_t, lpt.data());
          if (renorm) log_softmax(sel.data(), K, inv_t, lsel.data());
          float A = 0.f;
          for (int64_t k = 0; k < K; ++k) {
            a[size_t(k)] = 0.f;
            if (ids[size_t(k)] < 0) continue;
            const float lqk = renorm ? lsel[size_t(k)] : lq[size_t(ids[size_t(k)])];
            float ak;
            loss += term(lpt[size_t(k)], lqk, &ak);
            a[size_t(k)] = ak;
            asum += ak;
          }
          A = float(asum);
          // -q_j A everywhere (full vocabulary), then a_k - q_k A at the ids.
          for (int64_t j = 0; j < V; ++j) grad[size_t(j)] = renorm ? 0.f : kd_grad(0.f, std::exp(lq[size_t(j)]), A, 1.f);
          for (int64_t k = 0; k < K; ++k) {
            const int64_t id = ids[size_t(k)];
            if (id < 0) continue;
            grad[size_t(id)] = kd_grad(a[size_t(k)], std::exp(renorm ? lsel[size_t(k)] : lq[size_t(id)]), A, 1.f);
          }
        }
      }
      if (bad && !masked) {
        loss = NAN;
        for (float& g : grad) g = NAN;
      }
      row_loss[size_t(i)] = masked ? 0.0 : loss * t2;
      if (p.o.reduction == FCE_REDUCTION_NONE) store_f32(p.loss, i, float(row_loss[size_t(i)]));
      if (p.dstudent) {
        if (masked) {
          for (float& g : grad) g = 0.f;
        } else {
          float g = p.grad_loss ? load_f32(p.grad_loss, i) : 1.f;
          if (p.o.reduction == FCE_REDUCTION_MEAN) g = float(double(g) / double(used));
          const float s = g * t2 * float(inv_t);
          for (float& v : grad) v = (s == 0.f && std::isinf(v)) ? 0.f : v * s;
        }
        store_row(p.dstudent, i, grad.data());
      }
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
