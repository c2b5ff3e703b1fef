// Cross-entropy forward/backward against a float64 reference written here.
#include <algorithm>

#include "../common/ce_reference.hpp"

using namespace fct;

namespace {

std::string describe(const CeCase& c) {
  char b[256];
  snprintf(b, sizeof b, "N=%lld V=%lld %s tgt=%s pad=%lld red=%d eps=%g zq=%g cap=%g scale=%g w=%d peaked=%d grad=%d inplace=%d",
           (long long)c.N, (long long)c.V, dt_name(c.dt), dt_name(c.tdt), (long long)c.pad, c.reduction, c.eps, c.zq,
           c.cap, c.scale, c.weights, c.peaked, c.grad_mode, c.inplace);
  return b;
}

void run_case(const CeCase& c) {
  SCOPED_TRACE(describe(c));
  Handle h;
  const int64_t N = c.N, V = c.V;
  Tensor logits(c.dt, {N, V}, V + c.pad);
  fill_logits(logits, c.logit_std, c.peaked);
  Tensor targets(c.tdt, {N});
  std::uniform_int_distribution<int64_t> col(0, V - 1);
  std::bernoulli_distribution ign(c.ignore_frac);
  std::vector<int64_t> tg(N);
  for (int64_t i = 0; i < N; ++i) {
    tg[i] = ign(rng()) ? -100 : col(rng());
    targets.set_int(i, tg[i]);
  }
  targets.upload();
  std::vector<double> w;
  Tensor weights = class_weights(c, V, w);
  std::vector<double> gup;
  Tensor grad_loss;
  if (c.grad_mode == 2) {
    if (c.reduction == FCE_REDUCTION_NONE) {
      grad_loss = Tensor(DT::F32, {N});
      std::uniform_real_distribution<double> u(-2, 2);
      for (int64_t i = 0; i < N; ++i) { grad_loss.set(i, u(rng())); gup.push_back(grad_loss.get(i)); }
      grad_loss.upload();
    } else {
      grad_loss = scalar_f32(0.75);
      gup = {0.75};
    }
  }
  const std::vector<double> x = values(logits);
  const Ref ref = reference(c, x, tg, w, gup);

  fce_ce_options_t o = options_of(c, weights);

  const bool none = c.reduction == FCE_REDUCTION_NONE;
  Tensor loss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
  Tensor zl = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
  Tensor lse(DT::F32, {N}), ent(DT::F32, {N}), amax(DT::I64, {N});
  Tensor dlogits(c.dt, {N, V}, V + (c.dpad < 0 ? c.pad + 1 : c.dpad));
  for (Tensor* t : {&loss, &zl, &lse, &ent, &amax, &dlogits}) { t->poison(); t->upload(); }

  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.z_loss = zl.dl();
  out.lse = lse.dl();
  if (!c.lean) {
    out.entropy = ent.dl();
    out.argmax = amax.dl();
  }
  if (c.grad_mode) {
    out.dlogits = c.inplace ? logits.dl() : dlogits.dl();
    out.grad_loss = c.grad_mode == 2 ? grad_loss.dl() : nullptr;
  }
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0));
  for (Tensor* t : {&loss, &zl, &lse, &ent, &amax}) t->download();

  const double stat_tol = 2e-5;
  for (int64_t i = 0; i < N; ++i) {
    ASSERT_TRUE(close(lse.get(i), ref.lse[i], stat_tol, 1e-5)) << "lse row " << i;
    if (!c.lean) {
      ASSERT_TRUE(close(ent.get(i), ref.ent[i], 1e-4, 1e-4 * (1 + std::fabs(ref.lse[i])))) << "entropy row " << i;
      ASSERT_EQ(amax.get_int(i), ref.amax[i]) << "argmax row " << i;
    }
    if (none) {
      ASSERT_TRUE(close(loss.get(i), ref.loss[i], stat_tol, 2e-5 * (1 + std::fabs(ref.lse[i])))) << "loss row " << i;
      ASSERT_TRUE(close(zl.get(i), ref.zl[i], 1e-4, 1e-7)) << "z-loss row " << i;
    }
  }
  if (!none) {
    ASSERT_TRUE(close(loss.get(0), ref.total, 1e-5, 1e-5)) << "reduced loss";
    ASSERT_TRUE(close(zl.get(0), ref.ztotal, 1e-4, 1e-7)) << "reduced z-loss";
  }
  if (!c.grad_mode) {
    dlogits.download();
    for (uint8_t b : dlogits.bytes()) ASSERT_EQ(b, 0xff) << "dlogits written though not requested";
    return;
  }
  Tensor& dl = c.inplace ? logits : dlogits;
  dl.download();
  double gmax = 0;
  for (double g : ref.grad) gmax = std::max(gmax, std::fabs(g));
  // fp32 forms p with a relative error near 2^-22, so an element that cancels (p - 1 with p ~ 1) keeps an
  // absolute error of that order times the row's gradient scale.
  double gscale = 1.0;
  if (!gup.empty()) { gscale = 0; for (double g : gup) gscale = std::max(gscale, std::fabs(g)); }
  if (c.reduction == FCE_REDUCTION_MEAN && ref.denom > 0) gscale /= ref.denom;
  const double subnormal = c.dt == DT::F16 ? 6e-8 : 0.0;  // fp16 spacing below 6.1e-5
  const double rtol = dtype_rtol(c.dt) + 1e-4, atol = 1e-6 * std::max(gmax, gscale) + subnormal + 1e-9;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j)
      ASSERT_TRUE(close(dl.get(i, j), ref.grad[size_t(i * V + j)], rtol, atol)) << "dlogits (" << i << "," << j << ")";
  if (!c.inplace) {  // padding between rows untouched
    const size_t es = dt_size(c.dt);
    for (int64_t i = 0; i + 1 < N; ++i)
      for (size_t b = size_t((i * dlogits.ld() + V) * es); b < size_t((i + 1) * dlogits.ld() * es); ++b)
        ASSERT_EQ(dlogits.bytes()[b], 0xff) << "padding of dlogits row " << i << " written";
  }

  // The separate backward from the saved lse gives the fused gradient.
  if (!c.inplace) {
    Tensor dl2(c.dt, {N, V});
    dl2.poison();
    dl2.upload();
    FCE_OK(fce_cross_entropy_bwd(h, test_stream(), logits.dl(), targets.dl(), lse.dl(),
                                 c.grad_mode == 2 ? grad_loss.dl() : nullptr, &o, dl2.dl(), nullptr, 0));
    dl2.download();
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < V; ++j)
        ASSERT_TRUE(close(dl2.get(i, j), ref.grad[size_t(i * V + j)], rtol, atol)) << "bwd dlogits (" << i << "," << j << ")";
  }
}

}  // namespace

TEST(CrossEntropy, ShapesDtypesReductions) {
  for (int64_t V : {1, 2, 7, 50021})
    for (int64_t N : {1, 3, 257})
      for (DT dt : {DT::F32, DT::BF16, DT::F16})
        for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_SUM, FCE_REDUCTION_MEAN}) {
          if (V == 50021 && N == 257 && dt != DT::BF16) continue;  // keep the suite fast
          CeCase c{N, V, dt};
          c.reduction = red;
          c.pad = (N % 2) ? 3 : 0;
          c.tdt = red == FCE_REDUCTION_SUM ? DT::I32 : DT::I64;
          run_case(c);
        }
}

TEST(CrossEntropy, Vocab129920) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16}) {
    CeCase c{3, 129920, dt};
    c.peaked = true;  // the phantom-column bug shows on peaked rows
    run_case(c);
  }
}

TEST(CrossEntropy, EveryOption) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16})
    for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_MEAN}) {
      CeCase c{33, 1031, dt};
      c.reduction = red;
      c.eps = 0.1;
      c.zq = 1e-4;
      c.cap = 30;
      c.scale = 0.7;
      c.weights = true;
      c.logit_std = 20;
      c.grad_mode = 2;
      c.pad = 5;
      run_case(c);
      c.weights = false; c.cap = 0; c.eps = 0.25;
      run_case(c);
      c.eps = 0; c.zq = 0; c.cap = 5; c.scale = 1.3;
      run_case(c);
      c.weights = true;  // class weights without smoothing: no class-weight sum is formed
      run_case(c);
    }
  CeCase c{9, 263, DT::BF16};  // the same with a summed loss
  c.reduction = FCE_REDUCTION_SUM;
  c.weights = true;
  c.grad_mode = 2;
  run_case(c);
}

TEST(CrossEntropy, PeakedAndFlatRows) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16}) {
    CeCase c{17, 4099, dt};
    c.peaked = true;
    run_case(c);
    c.peaked = false;
    c.logit_std = 1e-30;  // flat: every logit 0 after rounding; argmax 0
    run_case(c);
  }
}

TEST(CrossEntropy, InPlaceGradientAndNoGradient) {
  for (DT dt : {DT::F32, DT::BF16}) {
    CeCase c{9, 513, dt};
    c.inplace = true;
    run_case(c);
    c.inplace = false;
    c.grad_mode = 0;
    run_case(c);
  }
}

TEST(CrossEntropy, AllIgnoredMeanIsZero) {
  CeCase c{5, 100, DT::F32};
  c.ignore_frac = 1.0;
  run_case(c);  // reference gives 0 loss and zero gradient
}

TEST(CrossEntropy, OutOfRangeTargetGivesNaNRow) {
  Handle h;
  const int64_t N = 4, V = 10;
  Tensor logits(DT::F32, {N, V});
  fill_logits(logits, 1, false);
  Tensor targets(DT::I64, {N});
  const int64_t tg[N] = {1, V, -5, 3};
  for (int64_t i = 0; i < N; ++i) targets.set_int(i, tg[i]);
  targets.upload();
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = FCE_REDUCTION_NONE;
  Tensor loss(DT::F32, {N}), dl(DT::F32, {N, V});
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.dlogits = dl.dl();
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0));
  loss.download();
  dl.download();
  EXPECT_FALSE(std::isnan(loss.get(0)));
  EXPECT_TRUE(std::isnan(loss.get(1)));
  EXPECT_TRUE(std::isnan(loss.get(2)));
  EXPECT_FALSE(std::isnan(loss.get(3)));
  for (int64_t j = 0; j < V; ++j) {
    EXPECT_TRUE(std::isnan(dl.get(1, j)));
    EXPECT_FALSE(std::isnan(dl.get(3, j)));
  }
  // Reduced: the NaN reaches the sum.
  o.reduction = FCE_REDUCTION_MEAN;
  Tensor total(DT::F32, {});
  out.loss = total.dl();
  out.dlogits = nullptr;
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0));
  total.download();
  EXPECT_TRUE(std::isnan(total.get(0)));
}

// Finite differences of the library's own fp32 loss agree with its gradient (checks the formula itself).
TEST(CrossEntropy, FiniteDifferenceSpotCheck) {
  Handle h;
  const int64_t N = 3, V = 37;
  Tensor logits(DT::F32, {N, V});
  fill_logits(logits, 1.5, false);
  Tensor targets(DT::I32, {N});
  for (int64_t i = 0; i < N; ++i) targets.set_int(i, (i * 7) % V);
  targets.upload();
  Tensor weights(DT::F32, {V});
  for (int64_t j = 0; j < V; ++j) weights.set(j, 0.5 + 0.03 * j);
  weights.upload();
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = FCE_REDUCTION_SUM;
  o.label_smoothing = 0.1f;
  o.z_loss_scale = 0.01f;
  o.softcap = 3.f;
  o.logit_scale = 0.9f;
  o.class_weights = weights.dl();
  Tensor loss(DT::F32, {}), dl(DT::F32, {N, V});
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.dlogits = dl.dl();
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0));
  dl.download();
  out.dlogits = nullptr;
  const double eps = 1e-2;
  for (int64_t k = 0; k < 8; ++k) {
    const int64_t i = k % N, j = (k * 11) % V;
    const double x0 = logits.get(i, j);
    double f[2];
    for (int s = 0; s < 2; ++s) {
      logits.set(i, j, x0 + (s ? eps : -eps));
      logits.upload();
      FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0));
      loss.download();
      f[s] = loss.get(0);
    }
    logits.set(i, j, x0);
    logits.upload();
    EXPECT_TRUE(close(dl.get(i, j), (f[1] - f[0]) / (2 * eps), 2e-2, 2e-3)) << "element (" << i << "," << j << ")";
  }
}

// Enough rows that the GPU takes one block per row (no split): the fused-gradient kernel that keeps the row
// in shared memory between its passes, with rows longer than shared memory holds.
TEST(CrossEntropy, ManyRowsFusedGradient) {
  for (DT dt : {DT::BF16, DT::F32}) {
    CeCase c{many_rows(300), 129920, dt};
    c.peaked = true;
    c.reduction = FCE_REDUCTION_MEAN;
    run_case(c);
  }
  {  // in place, as linear cross-entropy does with its chunk buffer
    CeCase c{many_rows(300), 128256, DT::BF16};
    c.inplace = true;
    c.logit_std = 1.3;
    c.ignore_frac = 0.0;
    run_case(c);
  }
  CeCase c{many_rows(600), 5003, DT::F16};
  c.eps = 0.1;
  c.grad_mode = 2;
  run_case(c);
  // Aligned rows of >= 16 KiB, several per block of the GPU's persistent pipelined kernel, every option, a
  // partial last vector (V = 8195, stride 8200), explicit upstream gradients, NONE reduction.
  CeCase o{many_rows(400), 8195, DT::BF16};
  o.pad = 5;
  o.dpad = 13;
  o.eps = 0.1;
  o.zq = 1e-3;
  o.cap = 15;
  o.weights = true;
  o.grad_mode = 2;
  o.reduction = FCE_REDUCTION_NONE;
  run_case(o);
  CeCase q{many_rows(350), 4100, DT::F32};
  q.pad = 4;
  q.dpad = 0;
  q.scale = 0.7;
  q.ignore_frac = 0.5;
  run_case(q);
  // The usual training call (loss, lse, dlogits only): the GPU's lean pipelined path. Peaked and flat rows,
  // z-loss and a logit scale, an explicit upstream gradient per row, in place, a partial last vector.
  for (DT dt : {DT::BF16, DT::F16, DT::F32}) {
    CeCase l{many_rows(300), dt == DT::F32 ? 65539 : 129920, dt};
    l.lean = true;
    l.peaked = dt != DT::F16;
    l.pad = dt == DT::F32 ? 1 : 0;
    l.dpad = dt == DT::F32 ? 5 : 8;
    l.zq = dt == DT::BF16 ? 1e-4 : 0.0;
    l.scale = dt == DT::F16 ? 0.5 : 1.0;
    l.inplace = dt == DT::F16;
    l.grad_mode = dt == DT::F32 ? 2 : 1;
    l.reduction = dt == DT::F32 ? FCE_REDUCTION_NONE : FCE_REDUCTION_MEAN;
    run_case(l);
  }
}

// Few long rows, forward only, with the outputs the GPU's one-launch register path covers (loss, z-loss, lse;
// logit scale, class weights, ignore_index): 16-byte aligned rows take it, V = 50021 (odd stride) and a
// call asking for the entropy take the split path. Every reduction and dtype.
TEST(CrossEntropy, FewRowsForward) {
  const int reds[] = {FCE_REDUCTION_NONE, FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM};
  const DT dts[] = {DT::F32, DT::BF16, DT::F16};
  int k = 0;
  for (DT dt : dts)
    for (int red : reds) {
      const int64_t rows[] = {1, 16, 37};
      CeCase c{rows[k % 3], (k % 4 == 3) ? 50021 : 129920, dt};
      c.reduction = red;
      c.lean = k != 8;  // one call with every output: the split path
      c.grad_mode = 0;
      c.zq = (k % 2) ? 1e-4 : 0.0;
      c.scale = (k % 3 == 1) ? 0.8 : 1.0;
      c.weights = k % 3 == 2;
      c.peaked = k % 2 == 0;
      c.ignore_frac = 0.3;
      c.tdt = (k % 2) ? DT::I32 : DT::I64;
      run_case(c);
      ++k;
    }
  CeCase big{16, 151936, DT::BF16};  // the decode benchmark's shape
  big.lean = true;
  big.grad_mode = 0;
  big.reduction = FCE_REDUCTION_NONE;
  run_case(big);
}

namespace {

// Special values in long rows: a NaN, a +inf logit, a row of -inf, a target on a masked (-inf) column, an
// ignored row with a NaN; rows from 6 on are plain. `stride` 0: packed rows.
void check_ce_special_rows(Handle& h, DT dt, int64_t N, int64_t V, int64_t stride) {
  SCOPED_TRACE(std::to_string(N) + "x" + std::to_string(V) + " stride " + std::to_string(stride));
  Tensor x(dt, {N, V}, stride);
  fill_logits(x, 2.0, false);
  for (int64_t j = 0; j < V; ++j) x.set(2, j, -INFINITY);
  x.set(0, V / 2 + 1, NAN);
  x.set(1, V - 1, INFINITY);
  x.set(3, 5, -INFINITY);
  x.set(5, 3, NAN);
  x.upload();
  const std::vector<double> xv = values(x);
  Tensor t(DT::I64, {N});
  for (int64_t i = 0; i < N; ++i) t.set_int(i, i == 5 ? -100 : i == 3 ? 5 : (i * 7919) % V);
  t.upload();
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = FCE_REDUCTION_NONE;
  Tensor loss(DT::F32, {N}), lse(DT::F32, {N});
  loss.poison(); lse.poison(); loss.upload(); lse.upload();
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.lse = lse.dl();
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), x.dl(), t.dl(), &o, &out, nullptr, 0));
  loss.download();
  lse.download();
  EXPECT_TRUE(std::isnan(loss.get(0)) && std::isnan(lse.get(0))) << "NaN logit";
  EXPECT_TRUE(std::isnan(loss.get(1)) && std::isnan(lse.get(1))) << "+inf logit: inf - inf";
  EXPECT_EQ(lse.get(2), -INFINITY);
  EXPECT_TRUE(std::isnan(loss.get(2))) << "no distribution";
  EXPECT_EQ(loss.get(5), 0.0) << "ignored row";
  EXPECT_TRUE(std::isnan(lse.get(5)));
  // Row 3: a finite lse, loss +inf on the masked target; the others plain.
  for (int64_t i = 3; i < N; ++i) {
    if (i == 5) continue;
    double m = -INFINITY, d = 0;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, xv[size_t(i * V + j)]);
    for (int64_t j = 0; j < V; ++j) d += std::exp(xv[size_t(i * V + j)] - m);
    const double l = m + std::log(d);
    EXPECT_TRUE(close(lse.get(i), l, 2e-5, 1e-5)) << "lse row " << i;
    if (i == 3) EXPECT_EQ(loss.get(i), INFINITY);
    else EXPECT_TRUE(close(loss.get(i), l - xv[size_t(i * V + t.get_int(i))], 2e-5, 2e-5)) << "loss row " << i;
  }
}

}  // namespace

// Long rows with special values: 6 rows take the GPU's register path; 40 rows with a stride that is not a
// multiple of 16 bytes, and 70 rows (past the register plans), take the split path (7 and 4 blocks per row,
// one cluster launch each); the CPU backend runs the same cases.
TEST(CrossEntropy, FewRowsSpecialValues) {
  for (DT dt : {DT::F32, DT::BF16}) {
    SCOPED_TRACE(dt_name(dt));
    Handle h;
    const int64_t V = 129920;
    check_ce_special_rows(h, dt, 6, V, 0);
    check_ce_special_rows(h, dt, 40, V, V + 3);
    check_ce_special_rows(h, dt, 70, 65536, 0);
    fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
    o.reduction = FCE_REDUCTION_NONE;
    fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
    if (dt == DT::F32) {  // a finite logit that overflows with the scale: a +inf logit
      Tensor y(DT::F32, {1, V});
      fill_logits(y, 1.0, false);
      y.set(0, 9, 3e38);
      y.upload();
      o.logit_scale = 2.f;
      Tensor t1(DT::I64, {1}), l1(DT::F32, {1});
      t1.set_int(0, 4);
      t1.upload();
      l1.poison(); l1.upload();
      out = FCE_CE_OUTPUTS_INIT;
      out.loss = l1.dl();
      FCE_OK(fce_cross_entropy_fwd(h, test_stream(), y.dl(), t1.dl(), &o, &out, nullptr, 0));
      l1.download();
      EXPECT_TRUE(std::isnan(l1.get(0)));
    }
  }
}
