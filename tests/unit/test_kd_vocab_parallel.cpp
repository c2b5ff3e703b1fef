// Vocabulary-parallel knowledge distillation: student and teacher split into shards (even, uneven, padded),
// fce_kd_partial per shard, the records concatenated in rank order, fce_kd_combine (JSD, or `terms`: then
// fce_kd_terms_partial per shard and fce_kd_terms_combine, the second exchange), and each shard's fce_kd_bwd;
// against a float64 reference written here (the loss, and the analytic gradient of forward KL, reverse KL
// and JSD) and against fce_kd_loss of the whole rows.
#include <algorithm>

#include "../common/testing.hpp"

using namespace fct;

namespace {

struct Case {
  int64_t N = 13, V = 1031;  // V prime
  DT ds = DT::F32, dt = DT::F32;  // student and teacher dtypes
  int div = FCE_KD_FORWARD_KL;
  double beta = 0.5;   // JSD's
  bool terms = false;  // KL through the terms' second exchange too (JSD always)
  double T = 1.0;
  bool t2 = false;
  int reduction = FCE_REDUCTION_MEAN;
  std::vector<int64_t> widths{400, 300};
  int64_t pad = 5;
  bool special = false;  // row 0 masked, row 1 identical, row 2 +inf divergence, row 3 a NaN
};

std::vector<double> log_softmax(const std::vector<double>& z) {
  double m = -INFINITY;
  for (double v : z) m = std::max(m, v);
  double s = 0;
  for (double v : z) s += std::exp(v - m);
  std::vector<double> r(z.size());
  for (size_t j = 0; j < z.size(); ++j) r[j] = z[j] - m - std::log(s);
  return r;
}

// KL(P || Q) of one row and its gradient in z = student / T (float64): forward KL P = teacher, Q = student,
// dKL/dz_j = q_j - p_j; reverse KL P = student, dKL/dz_j = q_j (log q_j - log p_j - KL) with q the student.
// JSD with M = b p + (1 - b) q: b KL(P || M) + (1 - b) KL(Q || M), dJSD/dz_j = (1 - b) q_j (log(q_j / m_j) - S),
// S = sum_k q_k log(q_k / m_k) (the same cancellation bound, with log m_j for log p_j).
// cancel: reverse KL's gradient q_j (u_j - KL) / T forms log-ratios u_j of tens at T = 0.5 against a peaked
// teacher, which fp32 rounds to a few ulps of their size (as test_kd.cpp allows): 16 ulps of q_j (|u_j| + A).
struct RowRef {
  double kl;
  std::vector<double> dz, cancel;
};
RowRef reference(const Case& c, const std::vector<double>& s, const std::vector<double>& t) {
  std::vector<double> zs(s.size()), zt(t.size());
  for (size_t j = 0; j < s.size(); ++j) {
    zs[j] = s[j] / c.T;
    zt[j] = t[j] / c.T;
  }
  const std::vector<double> lq = log_softmax(zs), lp = log_softmax(zt);  // student q, teacher p
  RowRef r{0.0, std::vector<double>(s.size()), std::vector<double>(s.size(), 0.0)};
  if (c.div == FCE_KD_JSD) {
    const double b = c.beta;
    std::vector<double> lm(s.size());
    double S = 0, A = 0;
    for (size_t j = 0; j < s.size(); ++j) {
      const double p = std::exp(lp[j]), q = std::exp(lq[j]), m = b * p + (1 - b) * q;
      lm[j] = m > 0 ? std::log(m) : -INFINITY;
      if (p > 0) r.kl += b * p * (lp[j] - lm[j]);
      if (q > 0) {
        r.kl += (1 - b) * q * (lq[j] - lm[j]);
        S += q * (lq[j] - lm[j]);
        A += q * std::fabs(lq[j] - lm[j]);
      }
    }
    for (size_t j = 0; j < s.size(); ++j) {
      const double q = std::exp(lq[j]);
      r.dz[j] = q > 0 ? (1 - b) * q * (lq[j] - lm[j] - S) : 0.0;
      if (q > 0) r.cancel[j] = 16 * 0x1p-24 * q * (std::fabs(lq[j] - lm[j]) + A);
    }
    return r;
  }
  for (size_t j = 0; j < s.size(); ++j) {
    const double p = std::exp(lp[j]), q = std::exp(lq[j]);
    if (c.div == FCE_KD_FORWARD_KL) r.kl += p > 0 ? p * (lp[j] - lq[j]) : 0.0;
    else r.kl += q > 0 ? q * (lq[j] - lp[j]) : 0.0;
  }
  double A = 0;
  for (size_t j = 0; j < s.size(); ++j)
    if (std::isfinite(lq[j]) && std::isfinite(lp[j])) A += std::exp(lq[j]) * std::fabs(lq[j] - lp[j]);
  for (size_t j = 0; j < s.size(); ++j) {
    const double p = std::exp(lp[j]), q = std::exp(lq[j]);
    r.dz[j] = c.div == FCE_KD_FORWARD_KL ? q - p : q * (lq[j] - lp[j] - r.kl);
    if (c.div != FCE_KD_FORWARD_KL && std::isfinite(lq[j]) && std::isfinite(lp[j]))
      r.cancel[j] = 16 * 0x1p-24 * q * (std::fabs(lq[j] - lp[j]) + A);
  }
  return r;
}

fce_kd_options_t options_of(const Case& c) {
  fce_kd_options_t o = FCE_KD_OPTIONS_INIT;
  o.divergence = c.div;
  o.beta = float(c.beta);
  o.temperature = float(c.T);
  o.scale_by_t2 = c.t2;
  o.reduction = c.reduction;
  return o;
}

void run(const Case& c) {
  SCOPED_TRACE(testing::Message() << "student " << dt_name(c.ds) << " teacher " << dt_name(c.dt) << " div " << c.div
                                  << " T " << c.T << " t2 " << c.t2 << " reduction " << c.reduction << " shards "
                                  << c.widths.size() << " pad " << c.pad << (c.special ? " special" : "")
                                  << " beta " << c.beta << (c.terms ? " terms" : ""));
  const int64_t N = c.N, V = c.V;
  Handle h;
  Tensor st(c.ds, {N, V}), te(c.dt, {N, V});
  fill_logits(st, 2.0, false);
  fill_logits(te, 2.0, true, 8.0);
  Tensor targets(DT::I64, {N});
  for (int64_t i = 0; i < N; ++i) targets.set_int(i, i % 4 == 3 ? -100 : i % V);
  const std::vector<Shard> shards = split_vocabulary(V, c.widths, c.pad);
  const int64_t W = int64_t(shards.size());
  if (c.special) {
    targets.set_int(0, -100);
    targets.set_int(1, 1);
    targets.set_int(2, 2);
    targets.set_int(3, 3);
    for (int64_t j = 0; j < V; ++j) te.set(1, j, st.get(1, j));  // identical (the student's dtype rounding)
    // +inf: the student -inf where the teacher has mass (forward), the teacher -inf where the student has
    // (reverse), in the first shard. JSD stays finite there (a row checked as any other).
    if (c.div != FCE_KD_REVERSE_KL) st.set(2, 3, -INFINITY);
    else te.set(2, 3, -INFINITY);
    st.set(3, shards.back().start + 1, NAN);
    st.upload();
    te.upload();
  }
  targets.upload();
  const fce_kd_options_t base = options_of(c);

  // The unsharded call, and the float64 reference.
  const bool none = c.reduction == FCE_REDUCTION_NONE;
  Tensor gl = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
  for (int64_t i = 0; i < (none ? N : 1); ++i) gl.set(i, none ? 0.5 + 0.1 * double(i) : 1.3);
  gl.upload();
  Tensor uloss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {}), ud(c.ds, {N, V});
  {
    fce_kd_teacher_t tt = FCE_KD_TEACHER_INIT;
    tt.logits = te.dl();
    fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
    out.loss = uloss.dl();
    out.dstudent = ud.dl();
    out.grad_loss = gl.dl();
    FCE_OK(fce_kd_loss(h, test_stream(), st.dl(), &tt, targets.dl(), &base, &out, nullptr, 0));
    uloss.download();
    ud.download();
  }
  std::vector<RowRef> ref;
  int64_t used = 0;
  for (int64_t i = 0; i < N; ++i) {
    std::vector<double> s(size_t(V), 0.0), t(size_t(V), 0.0);
    for (int64_t j = 0; j < V; ++j) {
      s[size_t(j)] = st.get(i, j);
      t[size_t(j)] = te.get(i, j);
    }
    ref.push_back(reference(c, s, t));
    used += targets.get_int(i) != -100;
  }

  // Shards: columns (padding NaN, never read), records, combine.
  std::vector<Tensor> sp, tp;
  Records rec(W, N, FCE_KD_RECORD_FIELDS);
  for (int64_t r = 0; r < W; ++r) {
    const Shard& sh = shards[size_t(r)];
    Tensor a(c.ds, {N, sh.cols}), b(c.dt, {N, sh.cols});
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < sh.cols; ++j) {
        a.set(i, j, j < sh.width ? st.get(i, sh.start + j) : NAN);
        b.set(i, j, j < sh.width ? te.get(i, sh.start + j) : NAN);
      }
    a.upload();
    b.upload();
    Tensor one(DT::F32, {N, FCE_KD_RECORD_FIELDS});
    one.poison();
    one.upload();
    fce_kd_options_t o = base;
    o.vocab_start = sh.start;
    o.vocab_total = V;
    fce_kd_teacher_t tt = FCE_KD_TEACHER_INIT;
    tt.logits = b.dl();
    FCE_OK(fce_kd_partial(h, test_stream(), a.dl(), &tt, &o, one.dl()));
    one.download();
    std::memcpy(rec.t.raw() + 4 * size_t(r * N * FCE_KD_RECORD_FIELDS), one.bytes().data(),
                4 * size_t(N * FCE_KD_RECORD_FIELDS));
    sp.push_back(std::move(a));
    tp.push_back(std::move(b));
  }
  rec.t.upload();
  fce_kd_options_t o = base;
  o.vocab_total = V;
  Tensor loss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {}), stats(DT::F32, {N, FCE_KD_ROW_STATS_FIELDS});
  loss.poison();
  loss.upload();
  stats.poison();
  stats.upload();
  const bool terms = c.terms || c.div == FCE_KD_JSD;
  if (c.div == FCE_KD_JSD) {  // the first combine gives only the statistics; A is NaN until the terms'
    FCE_OK(fce_kd_combine(h, test_stream(), &rec.dl, targets.dl(), &o, nullptr, stats.dl(), nullptr, 0));
    stats.download();
    for (int64_t i = 0; i < N; ++i) ASSERT_TRUE(std::isnan(stats.get(i, 4))) << "row " << i;
  } else {
    FCE_OK(fce_kd_combine(h, test_stream(), &rec.dl, targets.dl(), &o, loss.dl(), stats.dl(), nullptr, 0));
  }
  if (terms) {  // the second exchange: each shard's sums of the terms, gathered in rank order, combined
    Tensor one_exchange = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
    if (c.div != FCE_KD_JSD) {
      loss.download();
      std::memcpy(one_exchange.raw(), loss.bytes().data(), loss.bytes().size());
    }
    Records trec(W, N, FCE_KD_TERMS_RECORD_FIELDS);
    for (int64_t r = 0; r < W; ++r) {
      Tensor one(DT::F32, {N, FCE_KD_TERMS_RECORD_FIELDS});
      one.poison();
      one.upload();
      fce_kd_options_t so = o;
      so.vocab_start = shards[size_t(r)].start;
      fce_kd_teacher_t tt = FCE_KD_TEACHER_INIT;
      tt.logits = tp[size_t(r)].dl();
      FCE_OK(fce_kd_terms_partial(h, test_stream(), sp[size_t(r)].dl(), &tt, stats.dl(), &so, one.dl()));
      one.download();
      std::memcpy(trec.t.raw() + 4 * size_t(r * N * FCE_KD_TERMS_RECORD_FIELDS), one.bytes().data(),
                  4 * size_t(N * FCE_KD_TERMS_RECORD_FIELDS));
    }
    trec.t.upload();
    loss.poison();
    loss.upload();
    FCE_OK(fce_kd_terms_combine(h, test_stream(), &trec.dl, targets.dl(), &o, loss.dl(), stats.dl(), nullptr, 0));
    if (c.div != FCE_KD_JSD) {  // the same loss both ways, within the records' roundings
      loss.download();
      for (int64_t i = 0; i < (none ? N : 1); ++i) {
        const double a = loss.get(i), b = one_exchange.get(i);
        if (std::isfinite(b)) EXPECT_TRUE(close(a, b, 2e-5, 2e-6)) << "terms against one exchange, " << i;
        else EXPECT_TRUE(std::isnan(a) == std::isnan(b) && (std::isnan(a) || a == b)) << a << " vs " << b;
      }
    }
  }
  loss.download();
  stats.download();

  const double t2 = c.t2 ? c.T * c.T : 1.0;
  auto is_special = [&](int64_t i) { return c.special && i >= 1 && i <= 3 && (i != 2 || c.div != FCE_KD_JSD); };
  double total = 0;
  for (int64_t i = 0; i < N; ++i) {
    const bool masked = targets.get_int(i) == -100;
    const double want = masked ? 0.0 : ref[size_t(i)].kl * t2;
    if (!is_special(i)) total += want;
    if (!none) continue;
    SCOPED_TRACE(testing::Message() << "row " << i);
    if (is_special(i)) {  // as the unsharded call gives them: exactly 0, +inf, NaN
      if (i == 1) {
        EXPECT_EQ(loss.get(i), 0.0);
      }
      if (i == 2) {
        EXPECT_EQ(loss.get(i), INFINITY);
      }
      if (i == 3) {
        EXPECT_TRUE(std::isnan(loss.get(i)));
      }
      EXPECT_TRUE(close(loss.get(i), uloss.get(i), 0, 0)) << "unsharded";
      continue;
    }
    EXPECT_TRUE(close(loss.get(i), want, 2e-5, 2e-6));
    EXPECT_TRUE(close(loss.get(i), uloss.get(i), 2e-5, 2e-6)) << "unsharded";
  }
  if (!none && !c.special) {
    const double want = c.reduction == FCE_REDUCTION_MEAN ? (used ? total / double(used) : 0.0) : total;
    EXPECT_TRUE(close(loss.get(0), want, 2e-5, 2e-6));
    EXPECT_TRUE(close(loss.get(0), uloss.get(0), 2e-5, 2e-6)) << "unsharded";
  }
  if (!none && c.special) {
    EXPECT_TRUE(std::isnan(loss.get(0)));  // the NaN row reaches the sum
  }

  // Each shard's dstudent: its columns of the reference gradient, padding 0.
  const double gt = dtype_rtol(c.ds) + 2e-4;
  for (int64_t r = 0; r < W; ++r) {
    const Shard& sh = shards[size_t(r)];
    Tensor d(c.ds, {N, sh.cols});
    d.poison();
    d.upload();
    fce_kd_options_t so = o;
    so.vocab_start = sh.start;
    fce_kd_teacher_t tt = FCE_KD_TEACHER_INIT;
    tt.logits = tp[size_t(r)].dl();
    FCE_OK(fce_kd_bwd(h, test_stream(), sp[size_t(r)].dl(), &tt, targets.dl(), stats.dl(), &so, gl.dl(), d.dl(),
                      nullptr, 0));
    d.download();
    for (int64_t i = 0; i < N; ++i) {
      const bool masked = targets.get_int(i) == -100;
      const double g = (none ? gl.get(i) : gl.get(0)) * t2 / c.T /
                       (c.reduction == FCE_REDUCTION_MEAN ? double(std::max<int64_t>(used, 1)) : 1.0);
      double scale = 0;
      for (int64_t j = 0; j < sh.width; ++j) scale = std::max(scale, std::fabs(ref[size_t(i)].dz[size_t(sh.start + j)]));
      for (int64_t j = 0; j < sh.cols; ++j) {
        SCOPED_TRACE(testing::Message() << "shard " << r << " row " << i << " column " << j);
        const double got = d.get(i, j);
        if (j >= sh.width || masked) {
          ASSERT_EQ(got, 0.0);
          continue;
        }
        const double u = ud.get(i, sh.start + j);
        if (is_special(i)) {
          if (i == 1) {
            ASSERT_EQ(got, 0.0) << "identical distributions";
          }
          if (i == 3) {
            ASSERT_TRUE(std::isnan(got));
          }
          if (i == 2) {  // the +inf row's limit, as the unsharded call: same class (NaN, +-inf or finite)
            ASSERT_EQ(std::isnan(got), std::isnan(u)) << got << " vs " << u;
            ASSERT_EQ(std::isinf(got), std::isinf(u)) << got << " vs " << u;
            if (std::isinf(u)) {
              ASSERT_EQ(got, u);
            }
          }
          continue;
        }
        const double want = g * ref[size_t(i)].dz[size_t(sh.start + j)];
        const double at = std::fabs(g) * (gt * scale + ref[size_t(i)].cancel[size_t(sh.start + j)]) + 1e-9;
        ASSERT_TRUE(close(got, want, gt, at));
        ASSERT_TRUE(close(got, u, gt, 2 * at)) << "unsharded";
      }
    }
  }
}

TEST(KdVocabParallel, ShardsDtypesDivergences) {
  struct L {
    std::vector<int64_t> widths;
    int64_t pad;
  };
  const L layouts[] = {{{1031}, 0}, {{400, 300}, 5}, {{1, 700}, 0}, {{64, 64, 64}, 3}};
  for (const L& l : layouts)
    for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD})
      for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_SUM, FCE_REDUCTION_MEAN}) {
        Case c;
        c.widths = l.widths;
        c.pad = l.pad;
        c.div = div;
        c.reduction = red;
        c.terms = red == FCE_REDUCTION_SUM;  // KL's loss the second way too
        run(c);
      }
  for (DT ds : {DT::F32, DT::BF16, DT::F16})
    for (DT dt : {DT::F32, DT::BF16})
      for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
        Case c;
        c.ds = ds;
        c.dt = dt;
        c.div = div;
        c.T = 2.0;
        c.t2 = true;
        run(c);
      }
}

TEST(KdVocabParallel, TemperaturesAndSpecialRows) {
  for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD})
    for (double T : {0.5, 1.0, 4.0}) {
      Case c;
      c.div = div;
      c.T = T;
      c.beta = T == 0.5 ? 0.1 : T == 4.0 ? 0.9 : 0.5;
      c.terms = div != FCE_KD_JSD && T == 1.0;
      c.reduction = FCE_REDUCTION_NONE;
      c.special = true;
      run(c);
      c.reduction = FCE_REDUCTION_SUM;
      run(c);
    }
}

TEST(KdVocabParallel, ManyRowsLongShards) {  // rows and columns enough for every thread of a GPU block
  for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
    Case c;
    c.N = 40;
    c.V = 20011;
    c.ds = c.dt = DT::BF16;
    c.div = div;
    c.widths = {10000, 5000};
    c.pad = 11;
    run(c);
  }
}

TEST(KdVocabParallel, ManyRanksMegatronSplit) {  // V = 151936 over 3 and 7 ranks, Megatron's split
  for (int64_t W : {3, 7}) {
    Case c;
    c.N = 4;
    c.V = 151936;
    c.ds = c.dt = DT::BF16;
    c.div = W == 3 ? FCE_KD_JSD : FCE_KD_REVERSE_KL;
    const EvenSplit e = megatron_split(c.V, W);
    c.widths = e.widths;
    c.pad = e.pad;
    run(c);
  }
}

// A top-K teacher over shards: [N, K] global ids and log-probabilities, the same on every shard. The records,
// the first combine (statistics only), the terms and their combine, each shard's dstudent; against a float64
// reference of fce_kd_loss's top-K semantics written here (the teacher softmax_K(logprobs / T) over the used
// slots; the student's log-probabilities over the whole vocabulary, or renormalized over the K ids) and
// against fce_kd_loss of the whole rows. Row 0 has no used slot (masked), row 1 an id >= V (NaN) when
// `special`.
struct TopkCase {
  int64_t N = 9, V = 1031, K = 17;
  DT ds = DT::F32;
  int div = FCE_KD_FORWARD_KL, norm = FCE_KD_TOPK_FULL_VOCAB, reduction = FCE_REDUCTION_MEAN;
  double T = 1.0, beta = 0.5;
  std::vector<int64_t> widths{400, 300};
  int64_t pad = 5;
  bool special = false;
};

void run_topk(const TopkCase& c) {
  SCOPED_TRACE(testing::Message() << "top-K student " << dt_name(c.ds) << " div " << c.div << " norm " << c.norm
                                  << " T " << c.T << " reduction " << c.reduction << " shards " << c.widths.size()
                                  << (c.special ? " special" : ""));
  const int64_t N = c.N, V = c.V, K = c.K;
  Handle h;
  Tensor st(c.ds, {N, V}), ids(DT::I64, {N, K}), lp(DT::F32, {N, K});
  fill_logits(st, 2.0, false);
  std::vector<std::vector<int64_t>> rid(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) {
    std::vector<int64_t> perm(static_cast<size_t>(V));
    for (int64_t j = 0; j < V; ++j) perm[size_t(j)] = j;
    std::shuffle(perm.begin(), perm.end(), rng());
    std::normal_distribution<double> nd(-3, 2);
    for (int64_t k = 0; k < K; ++k) {
      int64_t id = k % 5 == 4 ? -1 : perm[size_t(k)];  // unused slots
      if (c.special && i == 0) id = -1;
      if (c.special && i == 1 && k == 2) id = V + 3;
      ids.set_int(i * K + k, id);
      rid[size_t(i)].push_back(id);
      lp.set(i, k, std::min(nd(rng()), -1e-3));
    }
  }
  ids.upload();
  lp.upload();
  fce_kd_options_t base = FCE_KD_OPTIONS_INIT;
  base.divergence = c.div;
  base.beta = float(c.beta);
  base.temperature = float(c.T);
  base.topk_norm = c.norm;
  base.reduction = c.reduction;
  fce_kd_teacher_t tt = FCE_KD_TEACHER_INIT;
  tt.topk_ids = ids.dl();
  tt.topk_logprobs = lp.dl();
  const bool none = c.reduction == FCE_REDUCTION_NONE;
  Tensor gl = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
  for (int64_t i = 0; i < (none ? N : 1); ++i) gl.set(i, none ? 0.7 - 0.1 * double(i) : 1.3);
  gl.upload();

  // The unsharded call.
  Tensor uloss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {}), ud(c.ds, {N, V});
  {
    fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
    out.loss = uloss.dl();
    out.dstudent = ud.dl();
    out.grad_loss = gl.dl();
    FCE_OK(fce_kd_loss(h, test_stream(), st.dl(), &tt, nullptr, &base, &out, nullptr, 0));
    uloss.download();
    ud.download();
  }
  // The float64 reference: the loss and dL/dz of each row (z = student / T).
  std::vector<double> rloss(size_t(N), 0.0);
  std::vector<std::vector<double>> rdz(size_t(N), std::vector<double>(size_t(V), 0.0));
  int64_t used = 0;
  for (int64_t i = 0; i < N; ++i) {
    const std::vector<int64_t>& id = rid[size_t(i)];
    bool any = false;
    for (int64_t k = 0; k < K; ++k) any |= id[size_t(k)] >= 0;
    if (!any || (c.special && i == 1)) {
      used += any;
      continue;
    }
    ++used;
    std::vector<double> zt, zs(static_cast<size_t>(V)), zsel;
    for (int64_t j = 0; j < V; ++j) zs[size_t(j)] = st.get(i, j) / c.T;
    for (int64_t k = 0; k < K; ++k)
      if (id[size_t(k)] >= 0) {
        zt.push_back(lp.get(i, k) / c.T);
        zsel.push_back(zs[size_t(id[size_t(k)])]);
      }
    const std::vector<double> lpt = log_softmax(zt), lqf = log_softmax(zs), lqs = log_softmax(zsel);
    const bool renorm = c.norm == FCE_KD_TOPK_RENORMALIZE;
    std::vector<double> a(zt.size());
    double A = 0;
    for (size_t k = 0, u = 0; k < size_t(K); ++k) {
      if (id[k] < 0) continue;
      const double lpk = lpt[u], lqk = renorm ? lqs[u] : lqf[size_t(id[k])], p = std::exp(lpk), q = std::exp(lqk);
      if (c.div == FCE_KD_FORWARD_KL) {
        rloss[size_t(i)] += p * (lpk - lqk);
        a[u] = -p;
      } else if (c.div == FCE_KD_REVERSE_KL) {
        rloss[size_t(i)] += q * (lqk - lpk);
        a[u] = q * (lqk - lpk + 1);
      } else {
        const double b = c.beta, lm = std::log(b * p + (1 - b) * q);
        rloss[size_t(i)] += b * p * (lpk - lm) + (1 - b) * q * (lqk - lm);
        a[u] = (1 - b) * q * (lqk - lm);
      }
      A += a[u];
      ++u;
    }
    if (!renorm)
      for (int64_t j = 0; j < V; ++j) rdz[size_t(i)][size_t(j)] = -std::exp(lqf[size_t(j)]) * A;
    for (size_t k = 0, u = 0; k < size_t(K); ++k) {
      if (id[k] < 0) continue;
      const double q = std::exp(renorm ? lqs[u] : lqf[size_t(id[k])]);
      rdz[size_t(i)][size_t(id[k])] = a[u] - q * A;
      ++u;
    }
  }

  // Shards: records, the first combine, the terms, their combine.
  const std::vector<Shard> shards = split_vocabulary(V, c.widths, c.pad);
  const int64_t W = int64_t(shards.size());
  std::vector<Tensor> sp;
  Records rec(W, N, FCE_KD_RECORD_FIELDS), trec(W, N, FCE_KD_TERMS_RECORD_FIELDS);
  fce_kd_options_t o = base;
  o.vocab_total = V;
  auto options_of_shard = [&](int64_t r) {
    fce_kd_options_t so = o;
    so.vocab_start = shards[size_t(r)].start;
    return so;
  };
  for (int64_t r = 0; r < W; ++r) {
    const Shard& sh = shards[size_t(r)];
    Tensor x(c.ds, {N, sh.cols});
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < sh.cols; ++j) x.set(i, j, j < sh.width ? st.get(i, sh.start + j) : NAN);
    x.upload();
    Tensor one(DT::F32, {N, FCE_KD_RECORD_FIELDS});
    one.poison();
    one.upload();
    const fce_kd_options_t so = options_of_shard(r);
    FCE_OK(fce_kd_partial(h, test_stream(), x.dl(), &tt, &so, one.dl()));
    one.download();
    std::memcpy(rec.t.raw() + 4 * size_t(r * N * FCE_KD_RECORD_FIELDS), one.bytes().data(),
                4 * size_t(N * FCE_KD_RECORD_FIELDS));
    sp.push_back(std::move(x));
  }
  rec.t.upload();
  Tensor loss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {}), stats(DT::F32, {N, FCE_KD_ROW_STATS_FIELDS});
  for (Tensor* t : {&loss, &stats}) {
    t->poison();
    t->upload();
  }
  FCE_OK(fce_kd_combine(h, test_stream(), &rec.dl, nullptr, &o, nullptr, stats.dl(), nullptr, 0));
  for (int64_t r = 0; r < W; ++r) {
    Tensor one(DT::F32, {N, FCE_KD_TERMS_RECORD_FIELDS});
    one.poison();
    one.upload();
    const fce_kd_options_t so = options_of_shard(r);
    FCE_OK(fce_kd_terms_partial(h, test_stream(), sp[size_t(r)].dl(), &tt, stats.dl(), &so, one.dl()));
    one.download();
    std::memcpy(trec.t.raw() + 4 * size_t(r * N * FCE_KD_TERMS_RECORD_FIELDS), one.bytes().data(),
                4 * size_t(N * FCE_KD_TERMS_RECORD_FIELDS));
  }
  trec.t.upload();
  FCE_OK(fce_kd_terms_combine(h, test_stream(), &trec.dl, nullptr, &o, loss.dl(), stats.dl(), nullptr, 0));
  loss.download();
  const double t2 = 1.0;
  if (none) {
    for (int64_t i = 0; i < N; ++i) {
      SCOPED_TRACE(testing::Message() << "row " << i);
      if (c.special && i == 1) {
        EXPECT_TRUE(std::isnan(loss.get(i)) && std::isnan(uloss.get(i)));
        continue;
      }
      EXPECT_TRUE(close(loss.get(i), rloss[size_t(i)] * t2, 2e-5, 2e-6));
      EXPECT_TRUE(close(loss.get(i), uloss.get(i), 2e-5, 2e-6)) << "unsharded";
    }
  } else {
    double total = 0;
    for (double l : rloss) total += l;
    const double want = c.reduction == FCE_REDUCTION_MEAN ? total / double(std::max<int64_t>(used, 1)) : total;
    EXPECT_TRUE(close(loss.get(0), want, 2e-5, 2e-6));
    EXPECT_TRUE(close(loss.get(0), uloss.get(0), 2e-5, 2e-6)) << "unsharded";
  }

  // Each shard's dstudent.
  const double gt = dtype_rtol(c.ds) + 2e-4;
  for (int64_t r = 0; r < W; ++r) {
    const Shard& sh = shards[size_t(r)];
    Tensor d(c.ds, {N, sh.cols});
    d.poison();
    d.upload();
    const fce_kd_options_t so = options_of_shard(r);
    FCE_OK(fce_kd_bwd(h, test_stream(), sp[size_t(r)].dl(), &tt, nullptr, stats.dl(), &so, gl.dl(), d.dl(), nullptr,
                      0));
    d.download();
    for (int64_t i = 0; i < N; ++i) {
      const double g = (none ? gl.get(i) : gl.get(0)) / c.T /
                       (c.reduction == FCE_REDUCTION_MEAN ? double(std::max<int64_t>(used, 1)) : 1.0);
      double scale = 0;
      for (double v : rdz[size_t(i)]) scale = std::max(scale, std::fabs(v));
      for (int64_t j = 0; j < sh.cols; ++j) {
        SCOPED_TRACE(testing::Message() << "shard " << r << " row " << i << " column " << j);
        const double got = d.get(i, j);
        if (j >= sh.width || (c.special && i == 0)) {
          ASSERT_EQ(got, 0.0);
          continue;
        }
        if (c.special && i == 1) {
          ASSERT_TRUE(std::isnan(got));
          continue;
        }
        const double want = g * rdz[size_t(i)][size_t(sh.start + j)];
        ASSERT_TRUE(close(got, want, gt, std::fabs(g) * gt * scale + 1e-9));
        ASSERT_TRUE(close(got, ud.get(i, sh.start + j), gt, 2 * std::fabs(g) * gt * scale + 1e-9)) << "unsharded";
      }
    }
  }
}

TEST(KdVocabParallel, TopkTeacher) {
  for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD})
    for (int norm : {FCE_KD_TOPK_FULL_VOCAB, FCE_KD_TOPK_RENORMALIZE})
      for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_MEAN}) {
        TopkCase c;
        c.div = div;
        c.norm = norm;
        c.reduction = red;
        c.special = red == FCE_REDUCTION_NONE;
        c.T = div == FCE_KD_JSD ? 2.0 : 1.0;
        c.beta = 0.3;
        run_topk(c);
      }
  for (DT ds : {DT::BF16, DT::F16}) {  // three shards, one of a single column; 16-bit students
    TopkCase c;
    c.ds = ds;
    c.widths = {1, 600, 200};
    c.pad = 3;
    c.K = 40;
    run_topk(c);
  }
}

TEST(KdVocabParallel, Validation) {
  Handle h;
  Tensor s(DT::F32, {3, 10}), t(DT::F32, {3, 10}), rec(DT::F32, {3, FCE_KD_RECORD_FIELDS}), bad(DT::F32, {3, 4});
  fill_logits(s, 1.0, false);
  fill_logits(t, 1.0, false);
  rec.poison();
  rec.upload();
  fce_kd_teacher_t tt = FCE_KD_TEACHER_INIT;
  tt.logits = t.dl();
  fce_kd_options_t o = FCE_KD_OPTIONS_INIT;
  EXPECT_EQ(fce_kd_partial(h, test_stream(), s.dl(), &tt, &o, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);  // no shard
  EXPECT_NE(std::string(fce_last_error_message()).find("vocab_total"), std::string::npos);
  EXPECT_EQ(fce_kd_partial(h, test_stream(), s.dl(), &tt, nullptr, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);
  o.vocab_total = 20;
  o.vocab_start = 21;  // outside [0, vocab_total]
  EXPECT_EQ(fce_kd_partial(h, test_stream(), s.dl(), &tt, &o, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);
  o.vocab_start = 10;
  EXPECT_EQ(fce_kd_partial(h, test_stream(), s.dl(), &tt, &o, bad.dl()), FCE_STATUS_SHAPE_MISMATCH);
  Tensor ids(DT::I64, {3, 2}), lp(DT::F32, {3, 2});
  fce_kd_teacher_t topk = FCE_KD_TEACHER_INIT;
  topk.topk_ids = ids.dl();
  topk.topk_logprobs = lp.dl();
  topk.logits = t.dl();  // both kinds of teacher
  EXPECT_EQ(fce_kd_partial(h, test_stream(), s.dl(), &topk, &o, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);
  topk.logits = nullptr;
  rec.download();
  for (uint8_t b : rec.bytes()) ASSERT_EQ(b, 0xff) << "written on a failed call";
  // JSD at beta 0 is forward KL exactly, and runs.
  o.divergence = FCE_KD_JSD;
  o.beta = 0.f;
  FCE_OK(fce_kd_partial(h, test_stream(), s.dl(), &tt, &o, rec.dl()));
  o.beta = 0.5f;
  FCE_OK(fce_kd_partial(h, test_stream(), s.dl(), &tt, &o, rec.dl()));
  // fce_kd_loss refuses a shard.
  Tensor loss(DT::F32, {});
  fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
  out.loss = loss.dl();
  EXPECT_EQ(fce_kd_loss(h, test_stream(), s.dl(), &tt, nullptr, &o, &out, nullptr, 0), FCE_STATUS_INVALID_ARGUMENT);
  // 0.1.0's options struct (without the shard's fields) is still taken.
  fce_kd_options_t old = FCE_KD_OPTIONS_INIT;
  old.struct_size = uint32_t(offsetof(fce_kd_options_t, vocab_start));
  FCE_OK(fce_kd_loss(h, test_stream(), s.dl(), &tt, nullptr, &old, &out, nullptr, 0));
  // The combine: records [W, N, 5], row_stats [N, 5].
  Records r(2, 3, FCE_KD_RECORD_FIELDS);
  o.divergence = FCE_KD_FORWARD_KL;
  Tensor st(DT::F32, {3, FCE_KD_ROW_STATS_FIELDS}), st_bad(DT::F32, {3, 4});
  EXPECT_EQ(fce_kd_combine(h, test_stream(), &r.dl, nullptr, &o, loss.dl(), st_bad.dl(), nullptr, 0),
            FCE_STATUS_SHAPE_MISMATCH);
  r.shape[2] = 4;
  EXPECT_EQ(fce_kd_combine(h, test_stream(), &r.dl, nullptr, &o, loss.dl(), st.dl(), nullptr, 0),
            FCE_STATUS_SHAPE_MISMATCH);
  r.shape[2] = FCE_KD_RECORD_FIELDS;
  size_t bytes = 1;
  FCE_OK(fce_kd_combine_workspace_size(h, &r.dl, nullptr, &o, loss.dl(), st.dl(), &bytes));
  // JSD's first combine: no loss (it needs the terms' exchange), the statistics required.
  fce_kd_options_t j = o;
  j.divergence = FCE_KD_JSD;
  st.poison();
  st.upload();
  EXPECT_EQ(fce_kd_combine(h, test_stream(), &r.dl, nullptr, &j, loss.dl(), st.dl(), nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_last_error_message()).find("fce_kd_terms_combine"), std::string::npos);
  EXPECT_EQ(fce_kd_combine(h, test_stream(), &r.dl, nullptr, &j, nullptr, nullptr, nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  st.download();
  for (uint8_t b : st.bytes()) ASSERT_EQ(b, 0xff) << "written on a failed call";
  // The terms: records [N, 3] per shard, [W, N, 3] gathered; the combine needs the statistics.
  Tensor trec(DT::F32, {3, FCE_KD_TERMS_RECORD_FIELDS});
  trec.poison();
  trec.upload();
  EXPECT_EQ(fce_kd_terms_partial(h, test_stream(), s.dl(), &tt, st.dl(), &j, rec.dl()), FCE_STATUS_SHAPE_MISMATCH);
  EXPECT_EQ(fce_kd_terms_partial(h, test_stream(), s.dl(), &tt, st_bad.dl(), &j, trec.dl()),
            FCE_STATUS_SHAPE_MISMATCH);
  Tensor ids_bad(DT::I64, {2, 2}), lp_bad(DT::F32, {2, 2});  // a top-K teacher of the wrong rows
  fce_kd_teacher_t topk_bad = FCE_KD_TEACHER_INIT;
  topk_bad.topk_ids = ids_bad.dl();
  topk_bad.topk_logprobs = lp_bad.dl();
  EXPECT_EQ(fce_kd_terms_partial(h, test_stream(), s.dl(), &topk_bad, st.dl(), &j, trec.dl()),
            FCE_STATUS_SHAPE_MISMATCH);
  trec.download();
  for (uint8_t b : trec.bytes()) ASSERT_EQ(b, 0xff) << "written on a failed call";
  Records tr(2, 3, FCE_KD_TERMS_RECORD_FIELDS);
  EXPECT_EQ(fce_kd_terms_combine(h, test_stream(), &tr.dl, nullptr, &j, loss.dl(), nullptr, nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(fce_kd_terms_combine(h, test_stream(), &r.dl, nullptr, &j, loss.dl(), st.dl(), nullptr, 0),
            FCE_STATUS_SHAPE_MISMATCH);
  FCE_OK(fce_kd_terms_combine_workspace_size(h, &tr.dl, nullptr, &j, loss.dl(), st.dl(), &bytes));
  // NCCL mode needs a communicator (and a CUDA handle: fce_comm_create refuses a CPU one).
  {
    fce_kd_outputs_t vo = FCE_KD_OUTPUTS_INIT;
    vo.loss = loss.dl();
    EXPECT_EQ(fce_kd_fwd_vp(h, nullptr, test_stream(), s.dl(), &tt, nullptr, &o, &vo, nullptr, nullptr, 0),
              FCE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(std::string(fce_last_error_message()).find("comm"), std::string::npos);
    EXPECT_EQ(fce_kd_fwd_vp_workspace_size(h, nullptr, s.dl(), &tt, nullptr, &o, &vo, nullptr, &bytes),
              FCE_STATUS_INVALID_ARGUMENT);
  }
  // The backward: dstudent of the student's shape and dtype.
  Tensor d16(DT::BF16, {3, 10});
  EXPECT_EQ(fce_kd_bwd(h, test_stream(), s.dl(), &tt, nullptr, st.dl(), &o, nullptr, d16.dl(), nullptr, 0),
            FCE_STATUS_UNSUPPORTED_DTYPE);
  EXPECT_EQ(fce_kd_bwd(h, test_stream(), s.dl(), &tt, nullptr, st_bad.dl(), &o, nullptr, s.dl(), nullptr, 0),
            FCE_STATUS_SHAPE_MISMATCH);
}

}  // namespace
