// Knowledge-distillation losses against a float64 reference; gradients against float64 finite differences
// of that reference (independent of the library's gradient formula).
#include <algorithm>

#include "../common/testing.hpp"

using namespace fct;

namespace {

struct KdCase {
  int64_t N, V;
  DT dt;
  int div = FCE_KD_FORWARD_KL;
  double beta = 0.5, T = 1.0;
  bool t2 = false;
  int reduction = FCE_REDUCTION_MEAN;
  int64_t K = 0;  // 0 = full teacher
  bool renorm = false;
  bool mask = true;
  bool neg_inf = false;   // some -inf logits in student and teacher
  bool identical = false; // teacher == student
  int64_t grad_checks = -1;  // elements per row to check by finite differences (-1 = all)
  bool fwd_only = false;     // no dstudent (the GPU's one-pass path when rows are many)
  bool same_dtype = false;   // teacher in the student's dtype (else mixed on purpose)
  int64_t pad = 0;           // row stride V + pad for student, teacher and dstudent
};

std::vector<double> log_softmax(const double* z, int64_t n) {
  double m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = std::max(m, z[j]);
  double s = 0;
  for (int64_t j = 0; j < n; ++j) s += std::exp(z[j] - m);
  std::vector<double> r(n);
  for (int64_t j = 0; j < n; ++j) r[j] = z[j] - m - std::log(s);
  return r;
}

double xlog(double p, double lp, double lq) { return p > 0 ? p * (lp - lq) : 0.0; }

// Divergence of one row in float64: student logits s [V]; teacher full logits t [V] or top-K (ids, lp).
double row_loss(const KdCase& c, const double* s, const double* t, const std::vector<int64_t>& ids,
                const std::vector<double>& lp) {
  std::vector<double> zs(c.V), lq, lpt;
  for (int64_t j = 0; j < c.V; ++j) zs[j] = s[j] / c.T;
  std::vector<double> P, Q, logP, logQ;
  if (!c.K) {
    std::vector<double> zt(c.V);
    for (int64_t j = 0; j < c.V; ++j) zt[j] = t[j] / c.T;
    logP = log_softmax(zt.data(), c.V);
    logQ = log_softmax(zs.data(), c.V);
  } else {
    std::vector<double> zt, sel;
    for (int64_t k = 0; k < c.K; ++k)
      if (ids[k] >= 0) { zt.push_back(lp[k] / c.T); sel.push_back(zs[ids[k]]); }
    logP = log_softmax(zt.data(), int64_t(zt.size()));
    if (c.renorm) logQ = log_softmax(sel.data(), int64_t(sel.size()));
    else {
      const std::vector<double> full = log_softmax(zs.data(), c.V);
      int64_t u = 0;
      for (int64_t k = 0; k < c.K; ++k) if (ids[k] >= 0) { logQ.push_back(full[ids[k]]); ++u; }
    }
  }
  double L = 0;
  const int div = (c.div == FCE_KD_JSD && c.beta == 0) ? FCE_KD_FORWARD_KL
                  : (c.div == FCE_KD_JSD && c.beta == 1) ? FCE_KD_REVERSE_KL : c.div;
  for (size_t j = 0; j < logP.size(); ++j) {
    const double p = std::exp(logP[j]), q = std::exp(logQ[j]);
    if (div == FCE_KD_FORWARD_KL) L += xlog(p, logP[j], logQ[j]);
    else if (div == FCE_KD_REVERSE_KL) L += xlog(q, logQ[j], logP[j]);
    else {
      const double m = c.beta * p + (1 - c.beta) * q;
      if (m > 0) L += c.beta * xlog(p, logP[j], std::log(m)) + (1 - c.beta) * xlog(q, logQ[j], std::log(m));
    }
  }
  return c.t2 ? L * c.T * c.T : L;
}

void run_case(const KdCase& c) {
  SCOPED_TRACE(::testing::Message() << "N=" << c.N << " V=" << c.V << " " << dt_name(c.dt) << " div=" << c.div
                                    << " beta=" << c.beta << " T=" << c.T << " t2=" << c.t2 << " red=" << c.reduction
                                    << " K=" << c.K << " renorm=" << c.renorm);
  Handle h;
  const int64_t N = c.N, V = c.V;
  // Mixed student/teacher dtypes on purpose, except where the two must be identical.
  Tensor s(c.dt, {N, V}, V + c.pad),
      t(c.identical || c.same_dtype ? c.dt : c.dt == DT::F32 ? DT::BF16 : DT::F32, {N, V}, V + c.pad);
  fill_logits(s, 2.0, false);
  fill_logits(t, 2.0, true, 6.0);
  if (c.identical) {
    for (int64_t i = 0; i < N; ++i) for (int64_t j = 0; j < V; ++j) t.set(i, j, s.get(i, j));
    t.upload();
  }
  if (c.neg_inf) {
    for (int64_t i = 0; i < N; ++i) {
      s.set(i, (i * 3) % V, -INFINITY);
      if (c.div != FCE_KD_REVERSE_KL) t.set(i, (i * 5 + 1) % V, -INFINITY);  // reverse KL would be +inf
      t.set(i, (i * 3) % V, -INFINITY);  // student -inf where the teacher is also 0: finite divergence
    }
    s.upload(); t.upload();
  }
  Tensor ids, lp;
  std::vector<std::vector<int64_t>> rid(N);
  std::vector<std::vector<double>> rlp(N);
  if (c.K) {
    ids = Tensor(DT::I64, {N, c.K});
    lp = Tensor(DT::F32, {N, c.K});
    std::vector<int64_t> perm(V);
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t j = 0; j < V; ++j) perm[j] = j;
      std::shuffle(perm.begin(), perm.end(), rng());
      std::normal_distribution<double> nd(-3, 2);
      for (int64_t k = 0; k < c.K; ++k) {
        const int64_t id = (k == c.K - 1 && i % 2) ? -1 : perm[k];  // an unused slot on odd rows
        ids.set_int(i * c.K + k, id);
        lp.set(i, k, std::min(0.0, nd(rng())));
        rid[i].push_back(id);
        rlp[i].push_back(lp.get(i, k));
      }
    }
    if (N > 2)  // a row with no used slot is masked
      for (int64_t k = 0; k < c.K; ++k) { ids.set_int(2 * c.K + k, -1); rid[2][k] = -1; }
    ids.upload(); lp.upload();
  }
  Tensor targets(DT::I32, {N});
  std::vector<bool> masked(N, false);
  for (int64_t i = 0; i < N; ++i) {
    const bool m = c.mask && i % 4 == 1;
    targets.set_int(i, m ? -100 : 0);
    masked[i] = m || (c.K && N > 2 && i == 2);
  }
  targets.upload();
  const std::vector<double> sv = values(s), tv = values(t);

  fce_kd_options_t o = FCE_KD_OPTIONS_INIT;
  o.divergence = c.div; o.beta = float(c.beta); o.temperature = float(c.T); o.scale_by_t2 = c.t2;
  o.topk_norm = c.renorm ? FCE_KD_TOPK_RENORMALIZE : FCE_KD_TOPK_FULL_VOCAB; o.reduction = c.reduction;
  fce_kd_teacher_t teacher = FCE_KD_TEACHER_INIT;
  if (c.K) { teacher.topk_ids = ids.dl(); teacher.topk_logprobs = lp.dl(); }
  else teacher.logits = t.dl();
  const bool none = c.reduction == FCE_REDUCTION_NONE;
  Tensor loss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
  Tensor ds(c.dt, {N, V}, V + c.pad);
  loss.poison(); loss.upload(); ds.poison(); ds.upload();
  fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
  out.loss = loss.dl();
  if (!c.fwd_only) out.dstudent = ds.dl();
  FCE_OK(fce_kd_loss(h, test_stream(), s.dl(), &teacher, c.mask ? targets.dl() : nullptr, &o, &out, nullptr, 0));
  loss.download(); ds.download();

  int64_t used = 0;
  double total = 0;
  std::vector<double> rl(N, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    if (masked[i]) continue;
    ++used;
    rl[i] = row_loss(c, &sv[size_t(i * V)], &tv[size_t(i * V)], rid[i], rlp[i]);
    total += rl[i];
  }
  if (c.reduction == FCE_REDUCTION_MEAN) total = used ? total / used : 0;
  if (none) {
    for (int64_t i = 0; i < N; ++i) ASSERT_TRUE(close(loss.get(i), rl[i], 1e-4, 2e-6)) << "loss row " << i;
  } else {
    ASSERT_TRUE(close(loss.get(0), total, 1e-4, 2e-6)) << "reduced loss";
  }
  if (c.identical && !c.K) {
    ASSERT_EQ(loss.get(0), 0.0);
  }
  if (c.fwd_only) {  // dstudent was not asked for: untouched
    for (int64_t i = 0; i < N; ++i) ASSERT_TRUE(std::isnan(ds.get(i, 0)) || ds.get(i, 0) == ds.get(0, 0));
    return;
  }

  // Gradient: central differences of the float64 reference.
  const double gscale = c.reduction == FCE_REDUCTION_MEAN ? 1.0 / std::max<int64_t>(used, 1) : 1.0;
  const double rtol = dtype_rtol(c.dt) + 2e-4;
  for (int64_t i = 0; i < N; ++i) {
    std::vector<double> row(sv.begin() + i * V, sv.begin() + (i + 1) * V);
    // The reverse-KL and JSD gradients are q_j (u_j - A) / T with log-ratios u_j = log q_j - log p_j and their
    // mean A, which reach tens at T = 0.5 against a peaked teacher: fp32 rounds them to a few ulps of their
    // size, so the error to allow grows with q_j (|u_j| + |A|) / T (seen: 1.07e-5 on 8.3e-4, f32, V = 97).
    std::vector<double> cancel(size_t(V), 0.0);
    if (!c.K && c.div != FCE_KD_FORWARD_KL) {
      std::vector<double> zs(static_cast<size_t>(V)), zt(static_cast<size_t>(V));
      for (int64_t j = 0; j < V; ++j) zs[j] = row[j] / c.T, zt[j] = tv[size_t(i * V + j)] / c.T;
      const std::vector<double> lq = log_softmax(zs.data(), V), lpt = log_softmax(zt.data(), V);
      double A = 0;
      for (int64_t j = 0; j < V; ++j)
        if (std::isfinite(lq[j]) && std::isfinite(lpt[j])) A += std::exp(lq[j]) * std::fabs(lq[j] - lpt[j]);
      for (int64_t j = 0; j < V; ++j)
        if (std::isfinite(lq[j]) && std::isfinite(lpt[j]))
          cancel[j] = 16 * 0x1p-24 * std::exp(lq[j]) * (std::fabs(lq[j] - lpt[j]) + A) / c.T * gscale *
                      (c.t2 ? c.T * c.T : 1.0);
    }
    const int64_t checks = c.grad_checks < 0 ? V : c.grad_checks;
    for (int64_t k = 0; k < checks; ++k) {
      int64_t j = c.grad_checks < 0 ? k : (k * 7919) % V;
      if (c.K && k < c.K && rid[i][k] >= 0 && c.grad_checks >= 0) j = rid[i][k];  // include top-K ids
      double want = 0;
      if (!masked[i] && std::isfinite(row[j])) {
        const double hh = 1e-5 * std::max(1.0, std::fabs(row[j])), x0 = row[j];
        row[j] = x0 + hh;
        const double fp = row_loss(c, row.data(), &tv[size_t(i * V)], rid[i], rlp[i]);
        row[j] = x0 - hh;
        const double fm = row_loss(c, row.data(), &tv[size_t(i * V)], rid[i], rlp[i]);
        row[j] = x0;
        want = (fp - fm) / (2 * hh) * gscale;
      }
      ASSERT_TRUE(close(ds.get(i, j), want, rtol, 1e-5 + cancel[size_t(j)]))
          << "dstudent (" << i << "," << j << ")";
    }
  }
}

}  // namespace

TEST(KdLoss, FullVocabularyDivergences) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16})
    for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD})
      for (double beta : {0.0, 0.5, 1.0}) {
        if (div != FCE_KD_JSD && beta != 0.5) continue;
        for (double T : {0.5, 1.0, 4.0}) {
          KdCase c{6, 97, dt, div, beta, T};
          c.t2 = T == 4.0;
          c.reduction = T == 0.5 ? FCE_REDUCTION_NONE : T == 1.0 ? FCE_REDUCTION_SUM : FCE_REDUCTION_MEAN;
          run_case(c);
        }
      }
}

TEST(KdLoss, LargeVocabularies) {
  for (int64_t V : {129920, 151936}) {
    KdCase c{3, V, DT::BF16, FCE_KD_JSD, 0.5, 1.0};
    c.grad_checks = 12;
    run_case(c);
  }
  KdCase c{2, 7, DT::F32, FCE_KD_REVERSE_KL};
  run_case(c);
  // fp32 student and teacher at V = 49152 (the real sample's shape): 48 KiB of slices per block on the GPU.
  KdCase f{3, 49152, DT::F32, FCE_KD_FORWARD_KL};
  f.identical = true;
  f.mask = false;
  f.grad_checks = 8;
  run_case(f);
}

// Loss only, with rows enough (300 > 2 x 132 SMs) for the GPU's one-pass kernels: forward and reverse KL
// (and JSD at beta 0 / 1), the top-K teacher normalized over the full vocabulary; JSD 0.5 and the
// renormalized top-K take the other paths.
TEST(KdLoss, ForwardOnlyManyRows) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16})
    for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
      KdCase c{many_rows(300), 1009, dt, div, div == FCE_KD_JSD ? 1.0 : 0.5, dt == DT::F16 ? 0.5 : dt == DT::BF16 ? 4.0 : 1.0};
      c.fwd_only = true;
      c.t2 = dt == DT::BF16;
      c.reduction = dt == DT::F32 ? FCE_REDUCTION_NONE : dt == DT::BF16 ? FCE_REDUCTION_SUM : FCE_REDUCTION_MEAN;
      run_case(c);
    }
  for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL}) {
    KdCase c{many_rows(300), 640, DT::F32, div};  // -inf logits, and identical rows (exactly 0)
    c.fwd_only = true;
    c.neg_inf = true;
    c.reduction = FCE_REDUCTION_NONE;
    run_case(c);
    KdCase z{many_rows(300), 4096, DT::BF16, div};
    z.fwd_only = true;
    z.identical = true;
    z.mask = false;
    run_case(z);
  }
  KdCase j{many_rows(300), 333, DT::BF16, FCE_KD_JSD, 0.5, 2.0};
  j.fwd_only = true;
  run_case(j);
  for (bool renorm : {false, true})
    for (int div : {FCE_KD_FORWARD_KL, FCE_KD_JSD}) {
      KdCase t{many_rows(300), 2053, DT::BF16, div, 0.5, 2.0};
      t.K = 16;
      t.renorm = renorm;
      t.fwd_only = true;
      run_case(t);
    }
  KdCase big{many_rows(270), 129920, DT::BF16, FCE_KD_FORWARD_KL};
  big.fwd_only = true;
  run_case(big);
}

// With dstudent, rows enough for the GPU's pipelined kernel (>= 132 rows of >= 16 KiB, one dtype, 16-byte
// aligned rows): forward and reverse KL, masked rows, every reduction, -inf logits, identical rows, a padded
// stride with a partial last vector.
TEST(KdLoss, GradientManyRows) {
  for (DT dt : {DT::BF16, DT::F32})
    for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL}) {
      KdCase c{many_rows(150), dt == DT::BF16 ? 8200 : 4100, dt, div, 0.5, div == FCE_KD_FORWARD_KL ? 2.0 : 0.7};
      c.same_dtype = true;
      c.t2 = dt == DT::BF16;
      c.reduction = div == FCE_KD_FORWARD_KL ? FCE_REDUCTION_MEAN : dt == DT::BF16 ? FCE_REDUCTION_SUM : FCE_REDUCTION_NONE;
      c.grad_checks = 6;
      run_case(c);
    }
  for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL}) {
    KdCase n{many_rows(140), 8197, DT::BF16, div};
    n.same_dtype = true;
    n.pad = 3;
    n.neg_inf = true;
    n.grad_checks = 6;
    run_case(n);
    KdCase z{many_rows(140), 8192, DT::F16, div};
    z.identical = true;
    z.mask = false;
    z.grad_checks = 4;
    run_case(z);
    // Row pairs longer than one SM's shared memory (the GPU splits each over a cluster of two blocks, the
    // scalar tail on the second): -inf logits, and identical rows (loss and gradient exactly 0). Rows
    // enough for that path on the GPU; three on the CPU, whose reference check is the slow part.
    KdCase l{target().cuda() ? 140 : 3, 70001, DT::BF16, div, 0.5, 1.5};
    l.same_dtype = true;
    l.pad = 7;
    l.grad_checks = 6;
    if (div == FCE_KD_FORWARD_KL) {
      l.neg_inf = true;
    } else {
      l.identical = true;
      l.mask = false;
    }
    run_case(l);
  }
}

TEST(KdLoss, NegativeInfinityLogitsGiveNoNaN) {
  for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
    KdCase c{5, 64, DT::F32, div};
    c.neg_inf = true;
    run_case(c);
  }
}

TEST(KdLoss, IdenticalDistributionsGiveZero) {
  for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
    KdCase c{4, 50, DT::F32, div};
    c.identical = true;
    c.mask = false;
    run_case(c);
  }
}

TEST(KdLoss, TopK) {
  for (DT dt : {DT::F32, DT::BF16})
    for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD})
      for (bool renorm : {false, true}) {
        KdCase c{5, 211, dt, div, 0.5, renorm ? 2.0 : 1.0};
        c.K = 16;
        c.renorm = renorm;
        c.t2 = renorm;
        run_case(c);
      }
  KdCase c{3, 129920, DT::BF16, FCE_KD_FORWARD_KL};
  c.K = 64;
  c.grad_checks = 70;
  run_case(c);
}

TEST(KdLoss, TopKIdOutOfRangeGivesNaN) {
  Handle h;
  Tensor s(DT::F32, {2, 10});
  fill_logits(s, 1, false);
  Tensor ids(DT::I32, {2, 2}), lp(DT::F32, {2, 2});
  ids.set_int(0, 1); ids.set_int(1, 2); ids.set_int(2, 3); ids.set_int(3, 10);
  for (int k = 0; k < 4; ++k) lp.set(k, -1.0);
  ids.upload(); lp.upload();
  fce_kd_teacher_t t = FCE_KD_TEACHER_INIT;
  t.topk_ids = ids.dl(); t.topk_logprobs = lp.dl();
  fce_kd_options_t o = FCE_KD_OPTIONS_INIT;
  o.reduction = FCE_REDUCTION_NONE;
  Tensor loss(DT::F32, {2});
  fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
  out.loss = loss.dl();
  FCE_OK(fce_kd_loss(h, test_stream(), s.dl(), &t, nullptr, &o, &out, nullptr, 0));
  loss.download();
  EXPECT_FALSE(std::isnan(loss.get(0)));
  EXPECT_TRUE(std::isnan(loss.get(1)));
}
