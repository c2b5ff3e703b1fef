// Vocabulary-parallel knowledge distillation on the CPU: a shard's records (the cross statistics of
// KL(P || Q) over its real columns, sums in fp64), their combine into whole rows (math.hpp's
// kd_combine_records, the CUDA combine's code), and a shard's dstudent from the rows' statistics (KdTerm and
// kd_grad, the element terms of fce_kd_loss).
#include <cmath>
#include <vector>

#include "common/math.hpp"
#include "common/ops.hpp"
#include "cpu/cpu_util.hpp"

namespace fce::cpu {

namespace {

bool reverse(const KdOpts& o) { return o.divergence == FCE_KD_REVERSE_KL; }

bool masked(const Vec& targets, const KdOpts& o, int64_t i) {
  return targets && load_index(targets.data, targets.dtype, i) == o.ignore_index;
}

// Rows the mean divides by.
int64_t unmasked_rows(const Vec& targets, const KdOpts& o, int64_t N) {
  int64_t used = 0;
  for (int64_t i = 0; i < N; ++i) used += !masked(targets, o, i);
  return used;
}

}  // namespace

void kd_partial(const KdPartialProblem& p) {
  const int64_t N = p.student.rows, V = p.student.cols, n = p.o.real_cols(V);
  const float inv_t = 1.f / p.o.temperature;
  const bool rev = reverse(p.o);
#pragma omp parallel
  {
    simd::Row sbuf(V), tbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* xs = row_in(p.student, i, sbuf.data());
      const float* xt = row_in(p.teacher, i, tbuf.data());
      const float* xp = rev ? xs : xt;  // P weights the divergence: the teacher for forward KL
      const float* xq = rev ? xt : xs;
      float rp = -INFINITY, rq = -INFINITY;  // raw maxima (NaN ignored, as fmaxf)
      for (int64_t j = 0; j < n; ++j) {
        rp = std::fmax(rp, xp[j]);
        rq = std::fmax(rq, xq[j]);
      }
      const float mp = rp * inv_t, mq = rq * inv_t;  // the max of z, as the GPU forms it
      double dp = 0, dq = 0, x = 0;
      for (int64_t j = 0; j < n; ++j) {
        const float zp = mp == -INFINITY ? -INFINITY : std::fma(xp[j], inv_t, -mp);
        const float zq = mq == -INFINITY ? -INFINITY : std::fma(xq[j], inv_t, -mq);
        const double ep = std::exp(double(zp)), eq = std::exp(double(zq));
        dp += ep;
        dq += eq;
        if (ep > 0) x += ep * (double(zp) - double(zq));
      }
      float* r = reinterpret_cast<float*>(row_ptr_mut(p.records, i));
      r[0] = mp;
      r[1] = float(dp);
      r[2] = mq;
      r[3] = float(dq);
      r[4] = float(x);
    }
  }
}

void kd_combine(const KdCombineProblem& p) {
  const int64_t N = p.N, W = p.W;
  const bool rev = reverse(p.o);
  const float t2 = p.o.scale_by_t2 ? p.o.temperature * p.o.temperature : 1.f;
  const int64_t stride = int64_t(p.records.ld) * N;
  std::vector<double> row_loss(size_t(N), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* rec = reinterpret_cast<const float*>(p.records.data) + size_t(i) * size_t(p.records.ld);
    float* s = p.row_stats ? reinterpret_cast<float*>(row_ptr_mut(p.row_stats, i)) : nullptr;
    double kl = 0, asum = 0;
    if (p.terms) {  // the terms' records: the loss and A summed in rank order
      for (int64_t r = 0; r < W; ++r) {
        kl += double(rec[r * stride]);
        asum += double(rec[r * stride + 1]);
      }
      // KL's A as the one-exchange combine forms it (sum q = 1 exactly: identical rows keep a 0 gradient).
      s[4] = p.o.mixture() ? float(asum) : rev ? float(kl + 1.0) : -1.f;
    } else {
      const KdCombined k = kd_combine_records(rec, W, stride);
      kl = k.kl;
      if (s) {
        s[0] = rev ? k.mp : k.mq;  // the student's shift
        s[1] = rev ? k.logdp : k.logdq;
        s[2] = rev ? k.mq : k.mp;  // the teacher's
        s[3] = rev ? k.logdq : k.logdp;
        // A = sum_j a_j (KdTerm): KL + sum q, or -sum p; JSD's comes from the terms' combine.
        s[4] = p.o.mixture() ? NAN : rev ? float(k.kl + 1.0) : -1.f;
      }
    }
    if (!p.loss) continue;  // JSD's first combine
    const float loss = masked(p.targets, p.o, i) ? 0.f : float(kl) * t2;
    row_loss[size_t(i)] = loss;
    if (p.o.reduction == FCE_REDUCTION_NONE) store_f32(p.loss, i, loss);
  }
  if (p.loss && p.o.reduction != FCE_REDUCTION_NONE) {
    double sum = 0;
    for (int64_t i = 0; i < N; ++i) sum += row_loss[size_t(i)];
    if (p.o.reduction == FCE_REDUCTION_MEAN) {
      const int64_t used = unmasked_rows(p.targets, p.o, N);
      sum = used > 0 ? sum / double(used) : 0.0;
    }
    store_f32(p.loss, 0, float(sum));
  }
}

void kd_terms_partial(const KdTermsPartialProblem& p) {
  const int64_t N = p.student.rows, V = p.student.cols, n = p.o.real_cols(V);
  const float inv_t = 1.f / p.o.temperature;
  const KdTerm term(p.o.divergence, p.o.beta);
#pragma omp parallel
  {
    simd::Row sbuf(V), tbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* xs = row_in(p.student, i, sbuf.data());
      const float* xt = row_in(p.teacher, i, tbuf.data());
      const float* st = reinterpret_cast<const float*>(row_ptr(p.row_stats, i));
      double loss = 0, asum = 0;
      for (int64_t j = 0; j < n; ++j) {
        const float logq = std::fma(xs[j], inv_t, -st[0]) - st[1];
        const float logp = std::fma(xt[j], inv_t, -st[2]) - st[3];
        float a = 0.f;
        loss += double(term(logp, logq, &a));
        asum += double(a);
      }
      float* r = reinterpret_cast<float*>(row_ptr_mut(p.records, i));
      r[0] = float(loss);
      r[1] = float(asum);
    }
  }
}

void kd_bwd(const KdBwdProblem& p) {
  const int64_t N = p.student.rows, V = p.student.cols, n = p.o.real_cols(V);
  const float inv_t = 1.f / p.o.temperature;
  const float t2 = p.o.scale_by_t2 ? p.o.temperature * p.o.temperature : 1.f;
  const KdTerm term(p.o.divergence, p.o.beta);
  const int64_t used = p.o.reduction == FCE_REDUCTION_MEAN ? unmasked_rows(p.targets, p.o, N) : 0;
#pragma omp parallel
  {
    simd::Row sbuf(V), tbuf(V), gbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* xs = row_in(p.student, i, sbuf.data());  // read whole: dstudent may be the student
      const float* xt = row_in(p.teacher, i, tbuf.data());
      float* grad = row_out(p.dstudent, i, gbuf.data());
      std::fill(grad + n, grad + V, 0.f);  // padding
      if (masked(p.targets, p.o, i)) {
        std::fill(grad, grad + n, 0.f);
      } else {
        const float* st = reinterpret_cast<const float*>(row_ptr(p.row_stats, i));
        float g = p.grad_loss ? load_f32(p.grad_loss, i) : 1.f;
        if (p.o.reduction == FCE_REDUCTION_MEAN) g = float(double(g) / double(used));
        const float scale = g * t2 * inv_t;
        for (int64_t j = 0; j < n; ++j) {
          const float logq = std::fma(xs[j], inv_t, -st[0]) - st[1];
          const float logp = std::fma(xt[j], inv_t, -st[2]) - st[3];
          float a = 0.f;
          term(logp, logq, &a);
          grad[j] = kd_grad(a, fast_exp(logq), st[4], scale);
        }
      }
      row_out_done(p.dstudent, i, grad);
    }
  }
}

}  // namespace fce::cpu
