#include <cmath>
#include <vector>

#include "common/math.hpp"
#include "common/ops.hpp"
#include "cpu/cpu_util.hpp"

namespace fce::cpu {

size_t kd_workspace(const KdProblem&) { return 0; }

namespace {

// log-sum-exp of v[0..n) (fp32 values, double sum); -inf when all are -inf.
float row_lse(const float* v, int64_t n) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::fmax(m, v[j]);
  if (m == -INFINITY || std::isnan(m)) return m;
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += std::exp(double(v[j] - m));
  return float(double(m) + std::log(s));
}

}  // namespace

void kd(const KdProblem& p, Workspace) {
  const int64_t N = p.student.rows, V = p.student.cols;
  const int64_t K = p.topk() ? p.topk_ids.cols : 0;
  const float inv_t = 1.f / p.o.temperature;
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
    std::vector<float> zs(static_cast<size_t>(V)), zt(size_t(p.topk() ? K : V)), grad(static_cast<size_t>(V)), a(size_t(p.topk() ? K : V));
    std::vector<int64_t> ids(static_cast<size_t>(K));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const bool masked = masked_row(i);
      load_row(p.student, i, zs.data());
      for (float& v : zs) v *= inv_t;
      double loss = 0, asum = 0;
      bool bad = false;
      if (!p.topk()) {
        load_row(p.teacher, i, zt.data());
        for (float& v : zt) v *= inv_t;
        const float lse_s = row_lse(zs.data(), V), lse_t = row_lse(zt.data(), V);
        for (int64_t j = 0; j < V; ++j) {
          float aj;
          loss += term(zt[size_t(j)] - lse_t, zs[size_t(j)] - lse_s, &aj);
          a[size_t(j)] = aj;
          asum += aj;
        }
        for (int64_t j = 0; j < V; ++j) {
          const float q = std::exp(zs[size_t(j)] - lse_s);
          grad[size_t(j)] = q == 0.f ? a[size_t(j)] : a[size_t(j)] - q * float(asum);  // -inf logit: no 0*inf
        }
      } else {
        // Teacher over its K ids: softmax_K(logprobs / T); negative ids are unused slots.
        const char* idrow = row_ptr(p.topk_ids, i);
        const char* lprow = row_ptr(p.topk_lp, i);
        for (int64_t k = 0; k < K; ++k) {
          ids[size_t(k)] = load_index(idrow, p.topk_ids.dtype, k);
          if (ids[size_t(k)] >= V) bad = true;
          zt[size_t(k)] = ids[size_t(k)] >= 0 ? load(lprow + 4 * size_t(k), DType::F32) * inv_t : -INFINITY;
        }
        if (!masked && !bad) {
          const float lse_t = row_lse(zt.data(), K);
          float lse_s;
          if (renorm) {
            std::vector<float> sel(size_t(K), -INFINITY);
            for (int64_t k = 0; k < K; ++k)
              if (ids[size_t(k)] >= 0) sel[size_t(k)] = zs[size_t(ids[size_t(k)])];
            lse_s = row_lse(sel.data(), K);
          } else {
            lse_s = row_lse(zs.data(), V);
          }
          for (int64_t k = 0; k < K; ++k) {
            a[size_t(k)] = 0.f;
            if (ids[size_t(k)] < 0) continue;
            float ak;
            loss += term(zt[size_t(k)] - lse_t, zs[size_t(ids[size_t(k)])] - lse_s, &ak);
            a[size_t(k)] = ak;
            asum += ak;
          }
          for (int64_t j = 0; j < V; ++j) grad[size_t(j)] = renorm ? 0.f : -std::exp(zs[size_t(j)] - lse_s) * float(asum);
          for (int64_t k = 0; k < K; ++k) {
            const int64_t id = ids[size_t(k)];
            if (id < 0) continue;
            const float q = std::exp(zs[size_t(id)] - lse_s);
            grad[size_t(id)] += a[size_t(k)] - (renorm ? q * float(asum) : 0.f);
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
          const float s = g * t2 * inv_t;
          for (float& v : grad) v *= s;
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
