// The numerics contract of docs/numerics.md: NaN, +-inf, -inf masks, all-ignored batches, out-of-range targets
// and ids, temperature and option domains, empty top-K rows, V = 1, JSD end points, determinism. Small hand-made
// rows; expected values from float64 arithmetic written here. Tests named DISABLED_* state what the header
// promises where the library does something else today (docs/numerics.md, "Deviations"); run them with
// --gtest_also_run_disabled_tests.
#include <dlfcn.h>

#include <algorithm>
#include <cstring>

#include "../common/calls.hpp"

using namespace fct;

// ------------------------------------------------------------------------------------------------------
// Cross-entropy

TEST(Numerics, CrossEntropyNaNLogit) {
  Tensor x = matrix(DT::F32, {{1, NAN, 3, NAN}, {1, NAN, 3, NAN}, {1, 2, 3, 4}});
  Tensor t = ints(DT::I64, {0, -100, 2});
  Ce r = ce_fwd(x, t, ce_none());
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS) << fce_last_error_message();
  // Row 0: NaN loss, lse, entropy and gradient; argmax = the first NaN (NaN counts as the largest).
  EXPECT_TRUE(std::isnan(r.loss.get(0)));
  EXPECT_TRUE(std::isnan(r.lse.get(0)));
  EXPECT_TRUE(std::isnan(r.ent.get(0)));
  EXPECT_EQ(r.amax.get_int(0), 1);
  for (int64_t j = 0; j < 4; ++j) EXPECT_TRUE(std::isnan(r.dl.get(0, j))) << j;
  // Row 1 is ignored: loss, z-loss and gradient 0; the statistics still report the NaN.
  EXPECT_EQ(r.loss.get(1), 0.0);
  EXPECT_EQ(r.zl.get(1), 0.0);
  EXPECT_TRUE(std::isnan(r.lse.get(1)));
  EXPECT_EQ(r.amax.get_int(1), 1);
  for (int64_t j = 0; j < 4; ++j) EXPECT_EQ(r.dl.get(1, j), 0.0) << j;
  // Row 2 is untouched by its neighbours.
  EXPECT_TRUE(close(r.loss.get(2), lse_of({1, 2, 3, 4}) - 3, 1e-6, 1e-6));
  // A reduction carries the NaN.
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = FCE_REDUCTION_SUM;
  Ce s = ce_fwd(x, t, o);
  ASSERT_EQ(s.status, FCE_STATUS_SUCCESS);
  EXPECT_TRUE(std::isnan(s.loss.get(0)));
}

TEST(Numerics, CrossEntropyPositiveInfinity) {
  // +inf logit without soft-cap: inf - inf inside the log-sum-exp, NaN row (as PyTorch).
  Tensor x = matrix(DT::F32, {{0, INFINITY, 1}, {3e38, 0, 1}});
  Tensor t = ints(DT::I32, {0, 1});
  fce_ce_options_t o = ce_none();
  o.logit_scale = 2.f;  // row 1: 2 * 3e38 overflows to +inf after the scale: same as a +inf logit
  Ce r = ce_fwd(x, t, o);
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(std::isnan(r.loss.get(i))) << i;
    EXPECT_TRUE(std::isnan(r.lse.get(i))) << i;
    EXPECT_EQ(r.amax.get_int(i), i == 0 ? 1 : 0);
    for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(std::isnan(r.dl.get(i, j))) << i << "," << j;
  }
  // With a soft-cap c, z = c*tanh(x/c) maps +inf to c: a finite row.
  o = ce_none();
  o.softcap = 5.f;
  Ce c = ce_fwd(x, t, o);
  ASSERT_EQ(c.status, FCE_STATUS_SUCCESS);
  const std::vector<double> z0 = {0.0, 5.0, 5 * std::tanh(0.2)};
  EXPECT_TRUE(close(c.lse.get(0), lse_of(z0), 1e-6, 1e-6));
  EXPECT_TRUE(close(c.loss.get(0), lse_of(z0) - 0.0, 1e-6, 1e-6));
  for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(std::isfinite(c.dl.get(0, j))) << j;
  EXPECT_EQ(c.dl.get(0, 1), 0.0) << "dz/dx = 1 - tanh^2 = 0 at +inf";
}

TEST(Numerics, CrossEntropyNegativeInfinityMask) {
  const double NI = -INFINITY;
  Tensor x = matrix(DT::F32, {{NI, 0, 1, NI}, {NI, 0, 1, NI}});
  Tensor t = ints(DT::I64, {1, 0});
  Ce r = ce_fwd(x, t, ce_none());
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
  // Masked columns: probability exactly 0, gradient exactly 0; the rest is the softmax over {0, 1}.
  const double l = lse_of({0, 1});
  EXPECT_TRUE(close(r.lse.get(0), l, 1e-6, 1e-6));
  EXPECT_TRUE(close(r.loss.get(0), l - 0, 1e-6, 1e-6));
  EXPECT_TRUE(close(r.ent.get(0), -(std::exp(-l) * (-l) + std::exp(1 - l) * (1 - l)), 1e-5, 1e-6));
  EXPECT_EQ(r.dl.get(0, 0), 0.0);
  EXPECT_EQ(r.dl.get(0, 3), 0.0);
  EXPECT_TRUE(close(r.dl.get(0, 1), std::exp(-l) - 1, 1e-5, 1e-7));
  // Target on a masked column: loss +inf, the gradient stays finite (p - onehot).
  EXPECT_EQ(r.loss.get(1), INFINITY);
  EXPECT_TRUE(close(r.dl.get(1, 0), -1.0, 0, 0));
  EXPECT_TRUE(close(r.dl.get(1, 2), std::exp(1 - l), 1e-5, 1e-7));
  // Label smoothing spreads e/V of the target over every class, masked ones included: loss +inf.
  fce_ce_options_t o = ce_none();
  o.label_smoothing = 0.1f;
  Ce s = ce_fwd(x, t, o);
  ASSERT_EQ(s.status, FCE_STATUS_SUCCESS);
  EXPECT_EQ(s.loss.get(0), INFINITY);
  // A soft-cap maps -inf to -c: the column is no longer masked (it gets probability e^-c / Z).
  o = ce_none();
  o.softcap = 5.f;
  Ce c = ce_fwd(x, t, o);
  ASSERT_EQ(c.status, FCE_STATUS_SUCCESS);
  const std::vector<double> z = {-5.0, 0.0, 5 * std::tanh(0.2), -5.0};
  EXPECT_TRUE(close(c.lse.get(0), lse_of(z), 1e-6, 1e-6));
}

TEST(Numerics, CrossEntropyAllNegativeInfinityRow) {
  const double NI = -INFINITY;
  Tensor x = matrix(DT::F32, {{NI, NI, NI}, {NI, NI, NI}});
  Tensor t = ints(DT::I64, {2, -100});
  Ce r = ce_fwd(x, t, ce_none());
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
  // No distribution: lse -inf, entropy NaN, argmax 0; a non-ignored row has NaN loss and gradient.
  for (int64_t i = 0; i < 2; ++i) {
    EXPECT_EQ(r.lse.get(i), -INFINITY);
    EXPECT_TRUE(std::isnan(r.ent.get(i)));
    EXPECT_EQ(r.amax.get_int(i), 0);
  }
  EXPECT_TRUE(std::isnan(r.loss.get(0)));
  for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(std::isnan(r.dl.get(0, j)));
  EXPECT_EQ(r.loss.get(1), 0.0);
  for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(r.dl.get(1, j), 0.0);
}

TEST(Numerics, CrossEntropyMeanOfNothingIsZero) {
  Tensor x = matrix(DT::BF16, {{1, 2, 3}, {0, 0, 5}, {2, 1, 0}});
  // Every row ignored; then every non-ignored target has class weight 0: both give a zero denominator.
  Tensor t_all = ints(DT::I32, {-100, -100, -100}), t_w0 = ints(DT::I32, {0, -100, 0});
  Tensor w = floats({0.0, 1.0, 2.0});
  for (int k = 0; k < 2; ++k) {
    fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
    o.z_loss_scale = 1e-3f;
    o.class_weights = k ? w.dl() : nullptr;
    Ce r = ce_fwd(x, k ? t_w0 : t_all, o);
    ASSERT_EQ(r.status, FCE_STATUS_SUCCESS) << fce_last_error_message();
    EXPECT_EQ(r.loss.get(0), 0.0) << k;
    EXPECT_EQ(r.zl.get(0), 0.0) << k;
    for (int64_t i = 0; i < 3; ++i)
      for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(r.dl.get(i, j), 0.0) << k << ": " << i << "," << j;
  }
}

TEST(Numerics, CrossEntropyOutOfRangeTargetZLossAndMeanDenominator) {
  Tensor x = matrix(DT::F32, {{1, 2, 3}, {1, 2, 3}, {0, 0, 0}});
  Tensor t = ints(DT::I64, {0, 3, -100});
  fce_ce_options_t o = ce_none();
  o.z_loss_scale = 1e-2f;
  Ce r = ce_fwd(x, t, o);
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
  EXPECT_TRUE(std::isnan(r.zl.get(1)));
  EXPECT_FALSE(std::isnan(r.zl.get(0)));
  // MEAN: the out-of-range row counts 1 in the denominator, so row 0's gradient is divided by 2.
  o.reduction = FCE_REDUCTION_MEAN;
  o.z_loss_scale = 0;
  Ce m = ce_fwd(x, t, o);
  ASSERT_EQ(m.status, FCE_STATUS_SUCCESS);
  EXPECT_TRUE(std::isnan(m.loss.get(0)));
  const double l = lse_of({1, 2, 3});
  EXPECT_TRUE(close(m.dl.get(0, 0), (std::exp(1 - l) - 1) / 2, 1e-5, 1e-7));
  EXPECT_TRUE(close(m.dl.get(0, 2), std::exp(3 - l) / 2, 1e-5, 1e-7));
}

// The header: "that row's ... dlogits row is NaN, loudly". The CPU backend writes zeros instead when the
// row's upstream gradient is 0 (ce_row_grad returns early on g == 0).
TEST(Numerics, CrossEntropyOutOfRangeTargetNaNGradientEvenWithZeroUpstream) {
  Tensor x = matrix(DT::F32, {{1, 2, 3}});
  Tensor t = ints(DT::I64, {7});
  Tensor g = floats({0.0});
  Ce r = ce_fwd(x, t, ce_none(), g.dl());
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
  for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(std::isnan(r.dl.get(0, j))) << j;
}

// Class weights outside their domain (finite and >= 0; issue 47 item 5): a NaN weight at a target with MEAN
// gave loss 0.0 (the NaN vanished in the denominator's test) and a weight of -1 a negative loss. Now such a
// row is NaN (loss, z-loss, gradient row) and counts 1 in the mean's denominator, as a target out of range;
// with label smoothing, every non-ignored row. Fused forward, backward, the shards' combine, linear CE.
TEST(Numerics, CrossEntropyClassWeightsOutsideTheirDomain) {
  Tensor x = matrix(DT::F32, {{1, 2, 3, 4, 5}, {0, 1, 0, 1, 0}, {2, 2, 2, 2, 2}, {5, 4, 3, 2, 1}, {1, 1, 1, 1, 1}});
  Tensor t = ints(DT::I64, {0, 1, 2, 3, -100});
  Tensor w = floats({1.0, NAN, -1.0, INFINITY, 2.0});
  fce_ce_options_t o = ce_none();
  o.class_weights = w.dl();
  Ce r = ce_fwd(x, t, o);
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
  const double l0 = lse_of({1, 2, 3, 4, 5});
  EXPECT_TRUE(close(r.loss.get(0), l0 - 1, 1e-6, 1e-6));
  EXPECT_EQ(r.loss.get(4), 0.0);  // ignored
  for (int64_t i = 1; i <= 3; ++i) {
    EXPECT_TRUE(std::isnan(r.loss.get(i))) << "row " << i << " loss " << r.loss.get(i);
    for (int64_t j = 0; j < 5; ++j) EXPECT_TRUE(std::isnan(r.dl.get(i, j))) << "(" << i << "," << j << ")";
  }
  for (int64_t j = 0; j < 5; ++j) EXPECT_FALSE(std::isnan(r.dl.get(0, j)));
  // MEAN and SUM: NaN, not 0 or a plausible number; row 0's gradient divided by 1 + 1 + 1 + 1.
  o.reduction = FCE_REDUCTION_MEAN;
  const Ce m = ce_fwd(x, t, o);
  ASSERT_EQ(m.status, FCE_STATUS_SUCCESS);
  EXPECT_TRUE(std::isnan(m.loss.get(0))) << m.loss.get(0);
  EXPECT_TRUE(close(m.dl.get(0, 4), std::exp(5 - l0) / 4, 1e-5, 1e-7));
  // The cases alone: a NaN weight at the only target with MEAN; a weight of -1.
  Tensor t1 = ints(DT::I64, {1}), x1 = matrix(DT::F32, {{1, 2, 3, 4, 5}}), t2 = ints(DT::I64, {2});
  EXPECT_TRUE(std::isnan(ce_fwd(x1, t1, o).loss.get(0)));
  EXPECT_TRUE(std::isnan(ce_fwd(x1, t2, o).loss.get(0)));
  // The backward from the saved lse: the same NaN rows.
  Handle h;
  Tensor dl = poisoned(DT::F32, {5, 5});
  fce_ce_options_t b = ce_none();
  b.class_weights = w.dl();
  FCE_OK(fce_cross_entropy_bwd(h, test_stream(), x.dl(), t.dl(), r.lse.dl(), nullptr, &b, dl.dl(), nullptr, 0));
  dl.download();
  for (int64_t j = 0; j < 5; ++j) {
    EXPECT_TRUE(std::isnan(dl.get(2, j)));
    EXPECT_FALSE(std::isnan(dl.get(0, j)));
  }
  // Label smoothing reads every weight: every non-ignored row NaN.
  b.label_smoothing = 0.1f;
  const Ce s = ce_fwd(x, t, b);
  ASSERT_EQ(s.status, FCE_STATUS_SUCCESS);
  for (int64_t i = 0; i < 4; ++i) EXPECT_TRUE(std::isnan(s.loss.get(i))) << "smoothing row " << i;
  // The shards' combine (two shards of 5 = 2 + 3 columns).
  fce_ce_options_t so = ce_none();
  so.class_weights = w.dl();
  so.vocab_total = 5;
  Records rec(2, 5, FCE_CE_RECORD_FIELDS_LOSS);
  Tensor a = matrix(DT::F32, {{1, 2}, {0, 1}, {2, 2}, {5, 4}, {1, 1}}), c = matrix(DT::F32, {{3, 4, 5}, {0, 1, 0}, {2, 2, 2}, {3, 2, 1}, {1, 1, 1}});
  for (int r2 = 0; r2 < 2; ++r2) {
    Tensor one = poisoned(DT::F32, {5, FCE_CE_RECORD_FIELDS_LOSS});
    so.vocab_start = r2 == 0 ? 0 : 2;
    FCE_OK(fce_cross_entropy_partial(h, test_stream(), (r2 == 0 ? a : c).dl(), t.dl(), &so, one.dl()));
    one.download();
    std::memcpy(rec.t.raw() + 4 * size_t(r2 * 5 * FCE_CE_RECORD_FIELDS_LOSS), one.bytes().data(),
                4 * size_t(5 * FCE_CE_RECORD_FIELDS_LOSS));
  }
  rec.t.upload();
  Tensor closs = poisoned(DT::F32, {5});
  fce_ce_outputs_t co = FCE_CE_OUTPUTS_INIT;
  co.loss = closs.dl();
  FCE_OK(fce_cross_entropy_combine(h, test_stream(), &rec.dl, t.dl(), &so, &co, nullptr, 0));
  closs.download();
  EXPECT_TRUE(close(closs.get(0), l0 - 1, 1e-6, 1e-6));
  for (int64_t i = 1; i <= 3; ++i) EXPECT_TRUE(std::isnan(closs.get(i))) << "combined row " << i;
  // Linear CE: the rows NaN.
  Tensor hid = matrix(DT::F32, {{1, 0}, {0, 1}, {1, 1}, {2, 0}, {0, 0}}), wt = matrix(DT::F32, {{1, 0}, {0, 1}, {1, 1}, {-1, 0}, {0, -1}});
  Tensor lloss = poisoned(DT::F32, {5});
  fce_linear_ce_outputs_t lo = FCE_LINEAR_CE_OUTPUTS_INIT;
  lo.loss = lloss.dl();
  fce_ce_options_t lco = ce_none();
  lco.class_weights = w.dl();
  FCE_OK(fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), wt.dl(), nullptr, t.dl(), &lco, &lo, nullptr, 0));
  lloss.download();
  EXPECT_FALSE(std::isnan(lloss.get(0)));
  for (int64_t i = 1; i <= 3; ++i) EXPECT_TRUE(std::isnan(lloss.get(i))) << "linear CE row " << i;
}

TEST(Numerics, CrossEntropyVocabularyOfOne) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16}) {
    Tensor x = matrix(dt, {{2.5}, {-7}});
    Tensor t = ints(DT::I64, {0, 0});
    Ce r = ce_fwd(x, t, ce_none());
    ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
    for (int64_t i = 0; i < 2; ++i) {
      EXPECT_EQ(r.loss.get(i), 0.0) << dt_name(dt);
      EXPECT_EQ(r.lse.get(i), x.get(i, 0)) << dt_name(dt);
      EXPECT_EQ(r.ent.get(i), 0.0) << dt_name(dt);
      EXPECT_EQ(r.amax.get_int(i), 0);
      EXPECT_EQ(r.dl.get(i, 0), 0.0) << dt_name(dt);
    }
  }
}

TEST(Numerics, CrossEntropyOptionDomain) {
  Tensor x = matrix(DT::F32, {{1, 2}});
  Tensor t = ints(DT::I64, {0});
  auto status = [&](void (*edit)(fce_ce_options_t&)) {
    fce_ce_options_t o = ce_none();
    edit(o);
    return ce_fwd(x, t, o).status;
  };
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.logit_scale = NAN; }), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.logit_scale = INFINITY; }), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.logit_scale = -1.f; }), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.logit_scale = 0.f; }), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.softcap = NAN; }), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.softcap = INFINITY; }), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.label_smoothing = NAN; }), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.label_smoothing = -0.1f; }), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.z_loss_scale = -1.f; }), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.z_loss_scale = INFINITY; }), FCE_STATUS_INVALID_ARGUMENT);
  // End points of the domains are accepted: e = 1 (uniform target), c = 0 (no cap), q = 0.
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.label_smoothing = 1.f; }), FCE_STATUS_SUCCESS);
  EXPECT_EQ(status([](fce_ce_options_t& o) { o.softcap = 0.f; }), FCE_STATUS_SUCCESS);
}

// ------------------------------------------------------------------------------------------------------
// Linear cross-entropy (the same per-row cross-entropy after a GEMM)

namespace {
struct Lce {
  Tensor loss, lse, dh, dw, db;
  fce_status_t status;
};
Lce lce_fwd(const std::vector<int64_t>& targets, int reduction, int64_t V = 5) {
  const int64_t N = int64_t(targets.size()), H = 4;
  Tensor hid(DT::F32, {N, H}), w(DT::F32, {V, H}), b(DT::F32, {V});
  for (int64_t i = 0; i < N; ++i)
    for (int64_t k = 0; k < H; ++k) hid.set(i, k, 0.25 * double((i + 1) * (k - 1)));
  for (int64_t v = 0; v < V; ++v) {
    b.set(v, 0.1 * double(v));
    for (int64_t k = 0; k < H; ++k) w.set(v, k, 0.5 - 0.125 * double((v * 3 + k) % 7));
  }
  hid.upload(); w.upload(); b.upload();
  Tensor t = ints(DT::I64, targets);
  const bool none = reduction == FCE_REDUCTION_NONE;
  Lce r{none ? poisoned(DT::F32, {N}) : poisoned(DT::F32, {}), poisoned(DT::F32, {N}), poisoned(DT::F32, {N, H}),
        poisoned(DT::F32, {V, H}), poisoned(DT::F32, {V}), FCE_STATUS_SUCCESS};
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = reduction;
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  out.loss = r.loss.dl(); out.lse = r.lse.dl(); out.dhidden = r.dh.dl(); out.dweight = r.dw.dl(); out.dbias = r.db.dl();
  Handle h;
  r.status = fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), w.dl(), b.dl(), t.dl(), &o, &out, nullptr, 0);
  for (Tensor* x : {&r.loss, &r.lse, &r.dh, &r.dw, &r.db}) x->download();
  return r;
}
}  // namespace

TEST(Numerics, LinearCrossEntropyOutOfRangeTargetPoisonsWeightGradient) {
  Lce r = lce_fwd({1, 7, 2}, FCE_REDUCTION_NONE);
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS) << fce_last_error_message();
  EXPECT_FALSE(std::isnan(r.loss.get(0)));
  EXPECT_TRUE(std::isnan(r.loss.get(1)));
  EXPECT_FALSE(std::isnan(r.loss.get(2)));
  for (int64_t k = 0; k < 4; ++k) {
    EXPECT_FALSE(std::isnan(r.dh.get(0, k)));
    EXPECT_TRUE(std::isnan(r.dh.get(1, k)));
    EXPECT_FALSE(std::isnan(r.dh.get(2, k)));
  }
  // dweight and dbias sum over rows: one NaN row reaches every element.
  for (int64_t v = 0; v < 5; ++v) {
    EXPECT_TRUE(std::isnan(r.db.get(v))) << v;
    for (int64_t k = 0; k < 4; ++k) EXPECT_TRUE(std::isnan(r.dw.get(v, k))) << v << "," << k;
  }
}

TEST(Numerics, LinearCrossEntropyAllIgnoredAndVocabularyOfOne) {
  Lce r = lce_fwd({-100, -100}, FCE_REDUCTION_MEAN);
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS) << fce_last_error_message();
  EXPECT_EQ(r.loss.get(0), 0.0);
  EXPECT_TRUE(std::isfinite(r.lse.get(0)));
  for (int64_t k = 0; k < 4; ++k) EXPECT_EQ(r.dh.get(1, k), 0.0);
  for (int64_t v = 0; v < 5; ++v) {
    EXPECT_EQ(r.db.get(v), 0.0);
    for (int64_t k = 0; k < 4; ++k) EXPECT_EQ(r.dw.get(v, k), 0.0);
  }
  Lce one = lce_fwd({0, 0, 0}, FCE_REDUCTION_SUM, 1);
  ASSERT_EQ(one.status, FCE_STATUS_SUCCESS) << fce_last_error_message();
  EXPECT_EQ(one.loss.get(0), 0.0);
  for (int64_t k = 0; k < 4; ++k) {
    EXPECT_EQ(one.dh.get(0, k), 0.0);
    EXPECT_EQ(one.dw.get(0, k), 0.0);
  }
  EXPECT_EQ(one.db.get(0), 0.0);
}

// ------------------------------------------------------------------------------------------------------
// Logsumexp

TEST(Numerics, LogsumexpInfinitiesScaleDomainAndVocabularyOfOne) {
  Handle h;
  Tensor x = matrix(DT::F32, {{0, INFINITY, 1}, {NAN, INFINITY, 0}, {INFINITY, -INFINITY, INFINITY}});
  Tensor lse = poisoned(DT::F32, {3});
  FCE_OK(fce_logsumexp(h, test_stream(), x.dl(), nullptr, lse.dl(), nullptr, 0));
  lse.download();
  EXPECT_EQ(lse.get(0), INFINITY);
  EXPECT_TRUE(std::isnan(lse.get(1))) << "NaN wins over +inf";
  EXPECT_EQ(lse.get(2), INFINITY);
  // V = 1: lse = s * x.
  Tensor one = matrix(DT::BF16, {{3.5}, {-2}});
  Tensor l1 = poisoned(DT::F32, {2});
  fce_lse_options_t o = FCE_LSE_OPTIONS_INIT;
  o.scale = 0.75f;
  FCE_OK(fce_logsumexp(h, test_stream(), one.dl(), &o, l1.dl(), nullptr, 0));
  l1.download();
  EXPECT_EQ(l1.get(0), 0.75 * 3.5);
  EXPECT_EQ(l1.get(1), 0.75 * -2);
  // The scale must be finite and > 0.
  for (float s : {0.f, -1.f, NAN, INFINITY, -INFINITY}) {
    o.scale = s;
    EXPECT_EQ(fce_logsumexp(h, test_stream(), one.dl(), &o, l1.dl(), nullptr, 0), FCE_STATUS_INVALID_ARGUMENT) << s;
  }
}

// ------------------------------------------------------------------------------------------------------
// Temperature softmax


TEST(Numerics, SoftmaxNaNAndNegativeInfinity) {
  const double NI = -INFINITY;
  Tensor x = matrix(DT::F32, {{1, NAN, 2}, {NI, 0, 1}, {NI, NI, NI}});
  for (float T : {0.f, 0.5f, 1.f, INFINITY}) {
    Sm r = softmax(x, temp(T));
    ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
    // A NaN anywhere, or no finite logit: the whole row is NaN, at every temperature.
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_TRUE(std::isnan(r.p.get(0, j)) && std::isnan(r.lp.get(0, j))) << "T=" << T;
      EXPECT_TRUE(std::isnan(r.p.get(2, j)) && std::isnan(r.lp.get(2, j))) << "T=" << T;
    }
    // A -inf logit: probability exactly 0, log-probability -inf.
    EXPECT_EQ(r.p.get(1, 0), 0.0) << "T=" << T;
    EXPECT_EQ(r.lp.get(1, 0), -INFINITY) << "T=" << T;
    double sum = 0;
    for (int64_t j = 0; j < 3; ++j) sum += r.p.get(1, j);
    EXPECT_TRUE(close(sum, 1.0, 0, 1e-6)) << "T=" << T;
  }
}

TEST(Numerics, SoftmaxPositiveInfinity) {
  Tensor x = matrix(DT::F32, {{1, INFINITY, 2, INFINITY}});
  // Greedy (T = 0): one-hot at the first +inf.
  Sm g = softmax(x, temp(0.f));
  ASSERT_EQ(g.status, FCE_STATUS_SUCCESS);
  for (int64_t j = 0; j < 4; ++j) {
    EXPECT_EQ(g.p.get(0, j), j == 1 ? 1.0 : 0.0);
    EXPECT_EQ(g.lp.get(0, j), j == 1 ? 0.0 : -INFINITY);
  }
  // T > 0: x - max is inf - inf at the +inf entries: a NaN row. (+inf is not a finite input.)
  for (float T : {1.f, INFINITY}) {
    Sm r = softmax(x, temp(T));
    ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
    for (int64_t j = 0; j < 4; ++j) EXPECT_TRUE(std::isnan(r.p.get(0, j))) << "T=" << T << " j=" << j;
  }
}

TEST(Numerics, SoftmaxTemperatureDomain) {
  Tensor x = matrix(DT::F32, {{1, 3, 2}, {0, 0, 1}});
  // A scalar temperature must be >= 0 and not NaN; -0 is 0 (greedy).
  EXPECT_EQ(softmax(x, temp(NAN)).status, FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(softmax(x, temp(-1e-30f)).status, FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(softmax(x, temp(-INFINITY)).status, FCE_STATUS_INVALID_ARGUMENT);
  Sm z = softmax(x, temp(-0.f));
  ASSERT_EQ(z.status, FCE_STATUS_SUCCESS);
  EXPECT_EQ(z.p.get(0, 1), 1.0);
  EXPECT_EQ(z.p.get(1, 2), 1.0);
  // Per-row temperatures: -0 is greedy, -inf is negative (NaN row); read on the device, never a status.
  Tensor temps = floats({-0.0, -INFINITY});
  fce_softmax_options_t o = FCE_SOFTMAX_OPTIONS_INIT;
  o.temperatures = temps.dl();
  Sm r = softmax(x, o);
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
  EXPECT_EQ(r.p.get(0, 1), 1.0);
  for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(std::isnan(r.p.get(1, j)));
}

TEST(Numerics, SoftmaxVocabularyOfOne) {
  Tensor x = matrix(DT::F16, {{-3}, {40000}});
  for (float T : {0.f, 1e-3f, 1.f, INFINITY}) {
    Sm r = softmax(x, temp(T));
    ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
    for (int64_t i = 0; i < 2; ++i) {
      EXPECT_EQ(r.p.get(i, 0), 1.0) << "T=" << T;
      EXPECT_EQ(r.lp.get(i, 0), 0.0) << "T=" << T;
    }
  }
}

// The header: "so no finite input gives NaN at any T > 0". With a subnormal T, 1/T overflows to +inf in fp32
// and (x_max - max) * inf = 0 * inf = NaN: the CPU backend returns a NaN row for T < ~2.9e-39.
TEST(Numerics, SoftmaxSubnormalTemperatureGivesNoNaN) {
  Tensor x = matrix(DT::F32, {{0, 1}});
  Sm r = softmax(x, temp(1e-39f));
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
  EXPECT_FALSE(std::isnan(r.p.get(0, 0)));
  EXPECT_FALSE(std::isnan(r.p.get(0, 1)));
  EXPECT_TRUE(close(r.p.get(0, 1), 1.0, 0, 1e-6));
}

// ------------------------------------------------------------------------------------------------------
// Knowledge distillation


TEST(Numerics, KdEverythingMaskedMeanIsZero) {
  Tensor s = matrix(DT::F32, {{1, 2, 3}, {0, 1, 0}});
  Tensor t = matrix(DT::F32, {{3, 2, 1}, {1, 1, 1}});
  Tensor targets = ints(DT::I64, {-100, -100});
  for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
    Kd r = kd(s, full(t), kd_opts(div, FCE_REDUCTION_MEAN), &targets);
    ASSERT_EQ(r.status, FCE_STATUS_SUCCESS) << fce_last_error_message();
    EXPECT_EQ(r.loss.get(0), 0.0);
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(r.ds.get(i, j), 0.0);
  }
  // Top-K rows without a used slot (every id negative) are masked the same way.
  Tensor ids(DT::I32, {2, 2});
  for (int64_t k = 0; k < 4; ++k) ids.set_int(k, k == 2 ? -5 : -1);
  ids.upload();
  Tensor lp = matrix(DT::F32, {{-0.1, -2}, {NAN, -1}});
  Kd r = kd(s, topk(ids, lp), kd_opts(FCE_KD_FORWARD_KL, FCE_REDUCTION_MEAN));
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS) << fce_last_error_message();
  EXPECT_EQ(r.loss.get(0), 0.0) << "unused slots are never read, NaN log-probabilities included";
  for (int64_t i = 0; i < 2; ++i)
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(r.ds.get(i, j), 0.0);
}

// A NaN logit in the student or the teacher row makes that row's loss and gradient NaN (every divergence):
// the "zero probability contributes 0" guards test p == 0, which NaN is not.
TEST(Numerics, KdNaNLogitsPropagate) {
  Tensor s = matrix(DT::F32, {{1, NAN, 3}, {1, 2, 3}, {0, 1, 2}});
  Tensor t = matrix(DT::BF16, {{0, 1, 2}, {1, NAN, 0}, {2, 1, 0}});
  for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
    Kd r = kd(s, full(t), kd_opts(div));
    ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
    EXPECT_TRUE(std::isfinite(r.loss.get(2))) << div;
    for (int64_t i = 0; i < 2; ++i) {
      EXPECT_TRUE(std::isnan(r.loss.get(i))) << "divergence " << div << " row " << i;
      for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(std::isnan(r.ds.get(i, j))) << "divergence " << div << " row " << i;
    }
    for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(std::isfinite(r.ds.get(2, j))) << div;
  }
}

TEST(Numerics, KdInfiniteDivergenceIsInfNotNaN) {
  const double NI = -INFINITY;
  // Forward KL: the teacher puts mass where the student has -inf. Reverse KL: the other way round.
  Tensor s = matrix(DT::F32, {{NI, 0, 1}});
  Tensor t = matrix(DT::F32, {{0, 0, 1}});
  Kd f = kd(s, full(t), kd_opts(FCE_KD_FORWARD_KL));
  ASSERT_EQ(f.status, FCE_STATUS_SUCCESS);
  EXPECT_EQ(f.loss.get(0), INFINITY);
  for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(std::isfinite(f.ds.get(0, j))) << j;
  Kd r = kd(t, full(s), kd_opts(FCE_KD_REVERSE_KL));
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
  EXPECT_EQ(r.loss.get(0), INFINITY);
  // JSD is bounded: the mixture M has the mass both sides put anywhere.
  Kd j = kd(s, full(t), kd_opts(FCE_KD_JSD));
  ASSERT_EQ(j.status, FCE_STATUS_SUCCESS);
  EXPECT_TRUE(std::isfinite(j.loss.get(0)));
  EXPECT_LE(j.loss.get(0), std::log(2.0) + 1e-6);
}

TEST(Numerics, KdJsdEndPointsAreExactlyTheKls) {
  Tensor s = matrix(DT::BF16, {{1, -2, 0.5, 3}, {0, 0, 1, -1}});
  Tensor t = matrix(DT::F32, {{0.3, 1, -1, 2}, {2, -3, 0, 0}});
  for (float beta : {0.f, 1.f}) {
    fce_kd_options_t j = kd_opts(FCE_KD_JSD);
    j.beta = beta;
    j.temperature = 1.7f;
    fce_kd_options_t k = kd_opts(beta == 0.f ? FCE_KD_FORWARD_KL : FCE_KD_REVERSE_KL);
    k.temperature = 1.7f;
    Kd a = kd(s, full(t), j), b = kd(s, full(t), k);
    ASSERT_EQ(a.status, FCE_STATUS_SUCCESS);
    ASSERT_EQ(b.status, FCE_STATUS_SUCCESS);
    EXPECT_TRUE(bits_equal(a.loss, b.loss)) << "beta=" << beta;
    EXPECT_TRUE(bits_equal(a.ds, b.ds)) << "beta=" << beta;
  }
}

TEST(Numerics, KdTopKIdOutOfRangeGivesNaNGradientRow) {
  Tensor s = matrix(DT::F32, {{1, 2, 3}, {0, 1, 2}});
  Tensor ids(DT::I64, {2, 2});
  const int64_t v[4] = {0, 1, 2, 3};  // row 1 names id 3 = V
  for (int64_t k = 0; k < 4; ++k) ids.set_int(k, v[k]);
  ids.upload();
  Tensor lp = matrix(DT::F32, {{-0.5, -1}, {-0.5, -1}});
  for (int norm : {FCE_KD_TOPK_FULL_VOCAB, FCE_KD_TOPK_RENORMALIZE}) {
    fce_kd_options_t o = kd_opts(FCE_KD_FORWARD_KL);
    o.topk_norm = norm;
    Kd r = kd(s, topk(ids, lp), o);
    ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
    EXPECT_TRUE(std::isfinite(r.loss.get(0)));
    EXPECT_TRUE(std::isnan(r.loss.get(1)));
    for (int64_t j = 0; j < 3; ++j) {
      EXPECT_TRUE(std::isfinite(r.ds.get(0, j)));
      EXPECT_TRUE(std::isnan(r.ds.get(1, j)));
    }
  }
}

TEST(Numerics, KdTopKUnusedSlotIsNeverRead) {
  Tensor s = matrix(DT::F32, {{1, 2, 0.5}});
  Tensor ids(DT::I64, {1, 2});
  ids.set_int(0, 2);
  ids.set_int(1, -1);
  ids.upload();
  Tensor lp = matrix(DT::F32, {{-0.2, NAN}});
  Kd r = kd(s, topk(ids, lp), kd_opts(FCE_KD_FORWARD_KL));
  ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
  // One used slot: the teacher is one-hot on id 2, KL = -log q_2 over the full vocabulary.
  EXPECT_TRUE(close(r.loss.get(0), lse_of({1, 2, 0.5}) - 0.5, 1e-6, 1e-6));
  for (int64_t j = 0; j < 3; ++j) EXPECT_TRUE(std::isfinite(r.ds.get(0, j)));
}

TEST(Numerics, KdVocabularyOfOne) {
  Tensor s = matrix(DT::F16, {{2}, {-30}});
  Tensor t = matrix(DT::F32, {{-1}, {5}});
  Tensor ids(DT::I32, {2, 1});
  ids.set_int(0, 0);
  ids.set_int(1, 0);
  ids.upload();
  Tensor lp = matrix(DT::F32, {{0}, {-0.25}});
  for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
    for (int k = 0; k < 2; ++k) {
      Kd r = k ? kd(s, topk(ids, lp), kd_opts(div)) : kd(s, full(t), kd_opts(div));
      ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
      for (int64_t i = 0; i < 2; ++i) {
        EXPECT_EQ(r.loss.get(i), 0.0) << div << " " << k;
        EXPECT_EQ(r.ds.get(i, 0), 0.0) << div << " " << k;
      }
    }
  }
}

TEST(Numerics, KdOptionDomain) {
  Tensor s = matrix(DT::F32, {{1, 2}});
  Tensor t = matrix(DT::F32, {{2, 1}});
  for (float T : {0.f, -1.f, NAN, INFINITY}) {
    fce_kd_options_t o = kd_opts(FCE_KD_FORWARD_KL);
    o.temperature = T;
    EXPECT_EQ(kd(s, full(t), o).status, FCE_STATUS_INVALID_ARGUMENT) << "T=" << T;
  }
  for (float b : {-0.1f, 1.1f, NAN}) {
    fce_kd_options_t o = kd_opts(FCE_KD_JSD);
    o.beta = b;
    EXPECT_EQ(kd(s, full(t), o).status, FCE_STATUS_INVALID_ARGUMENT) << "beta=" << b;
  }
}

// ------------------------------------------------------------------------------------------------------
// Determinism: the same call repeated writes bitwise identical outputs (rows large enough to be split across
// threads; every reduction). On a CPU handle the repeats also change the OpenMP thread count (1, 3 and the
// default), through the runtime libfusedce loaded (found with dlsym, so the test needs no OpenMP flags).

namespace {
struct OmpThreads {
  using set_fn = void (*)(int);
  using get_fn = int (*)();
  set_fn set = reinterpret_cast<set_fn>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  get_fn get = reinterpret_cast<get_fn>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  int saved = get ? get() : 0;
  void use(int n) { if (set && !target().cuda()) set(n > 0 ? n : saved); }
  ~OmpThreads() { if (set) set(saved); }
};
}  // namespace

TEST(Numerics, BitwiseRepeatable) {
  OmpThreads omp;
  if (!target().cuda()) {
    EXPECT_TRUE(omp.set != nullptr) << "libfusedce's OpenMP runtime not found";
  }
  const int64_t N = 67, V = 1031, H = 24, K = 8;
  Handle h;
  Tensor x(DT::BF16, {N, V}), xt(DT::F32, {N, V}), hid(DT::F32, {N, H}), w(DT::F32, {V, H});
  fill_logits(x, 3.0, true);
  fill_logits(xt, 2.0, false);
  fill_logits(hid, 1.0, false);
  fill_logits(w, 0.5, false);
  Tensor tg(DT::I64, {N}), ids(DT::I32, {N, K}), lp(DT::F32, {N, K});
  for (int64_t i = 0; i < N; ++i) {
    tg.set_int(i, i % 9 == 4 ? -100 : (i * 37) % V);
    for (int64_t k = 0; k < K; ++k) {
      ids.set_int(i * K + k, (i * 13 + k * 101) % V);
      lp.set(i, k, -0.3 * double(k + 1));
    }
  }
  tg.upload(); ids.upload(); lp.upload();
  for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_SUM, FCE_REDUCTION_MEAN}) {
    SCOPED_TRACE(::testing::Message() << "reduction " << red);
    const std::vector<int64_t> lshape = red == FCE_REDUCTION_NONE ? std::vector<int64_t>{N} : std::vector<int64_t>{};
    std::vector<Tensor> first;
    for (int run = 0; run < 3; ++run) {
      const int threads = run == 0 ? 0 : run == 1 ? 1 : 3;
      omp.use(threads);
      if (omp.get && threads && !target().cuda()) {
        ASSERT_EQ(omp.get(), threads);
      }
      std::vector<Tensor> o;
      o.push_back(poisoned(DT::F32, lshape));  // 0 CE loss
      o.push_back(poisoned(DT::F32, {N}));     // 1 CE lse
      o.push_back(poisoned(DT::F32, {N}));     // 2 entropy
      o.push_back(poisoned(DT::BF16, {N, V}));  // 3 dlogits
      o.push_back(poisoned(DT::BF16, {N, V}));  // 4 dlogits from the backward
      o.push_back(poisoned(DT::F32, {N}));     // 5 logsumexp
      o.push_back(poisoned(DT::F32, {N, V}));  // 6 probs
      o.push_back(poisoned(DT::BF16, {N, V}));  // 7 logprobs
      o.push_back(poisoned(DT::F32, lshape));  // 8 KD loss (full)
      o.push_back(poisoned(DT::BF16, {N, V}));  // 9 dstudent
      o.push_back(poisoned(DT::F32, lshape));  // 10 KD loss (top-K)
      o.push_back(poisoned(DT::BF16, {N, V}));  // 11 dstudent (top-K)
      o.push_back(poisoned(DT::F32, lshape));  // 12 linear CE loss
      o.push_back(poisoned(DT::F32, {N, H}));  // 13 dhidden
      o.push_back(poisoned(DT::F32, {V, H}));  // 14 dweight
      fce_ce_options_t co = FCE_CE_OPTIONS_INIT;
      co.reduction = red;
      co.label_smoothing = 0.05f;
      co.z_loss_scale = 1e-4f;
      fce_ce_outputs_t ce = FCE_CE_OUTPUTS_INIT;
      ce.loss = o[0].dl(); ce.lse = o[1].dl(); ce.entropy = o[2].dl(); ce.dlogits = o[3].dl();
      FCE_OK(fce_cross_entropy_fwd(h, test_stream(), x.dl(), tg.dl(), &co, &ce, nullptr, 0));
      FCE_OK(fce_cross_entropy_bwd(h, test_stream(), x.dl(), tg.dl(), o[1].dl(), nullptr, &co, o[4].dl(), nullptr, 0));
      FCE_OK(fce_logsumexp(h, test_stream(), x.dl(), nullptr, o[5].dl(), nullptr, 0));
      fce_softmax_options_t so = FCE_SOFTMAX_OPTIONS_INIT;
      so.temperature = 0.7f;
      FCE_OK(fce_temp_softmax(h, test_stream(), x.dl(), &so, o[6].dl(), o[7].dl(), nullptr, 0));
      fce_kd_options_t ko = kd_opts(FCE_KD_JSD, red);
      ko.temperature = 2.f;
      fce_kd_teacher_t tf = full(xt), tk = topk(ids, lp);
      fce_kd_outputs_t kout = FCE_KD_OUTPUTS_INIT;
      kout.loss = o[8].dl(); kout.dstudent = o[9].dl();
      FCE_OK(fce_kd_loss(h, test_stream(), x.dl(), &tf, tg.dl(), &ko, &kout, nullptr, 0));
      kout.loss = o[10].dl(); kout.dstudent = o[11].dl();
      FCE_OK(fce_kd_loss(h, test_stream(), x.dl(), &tk, tg.dl(), &ko, &kout, nullptr, 0));
      fce_linear_ce_outputs_t lo = FCE_LINEAR_CE_OUTPUTS_INIT;
      lo.loss = o[12].dl(); lo.dhidden = o[13].dl(); lo.dweight = o[14].dl();
      FCE_OK(fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), w.dl(), nullptr, tg.dl(), &co, &lo, nullptr, 0));
      for (Tensor& t : o) t.download();
      if (run == 0) first = std::move(o);
      else
        for (size_t k = 0; k < o.size(); ++k) EXPECT_TRUE(bits_equal(o[k], first[k])) << "output " << k << " run " << run;
    }
  }
}
