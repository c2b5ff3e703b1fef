// The entropy's upstream gradient (grad_entropy) in cross-entropy's fused gradient, in the backward from
// saved statistics (fce_cross_entropy_bwd_ex), in linear cross-entropy and in a vocabulary shard's
// backward: against a float64 reference written here, against central differences of the library's own
// forward, and the fused and separate paths against each other.
#include <algorithm>

#include "../common/ce_reference.hpp"

using namespace fct;

namespace {

// Float64 reference of sum_i ge_i dH_i/dx_ij: dH/dz_j = p_j (mu - z_j), mu = sum_k p_k z_k, times dz/dx
// (scale, soft-cap). Rows of all -inf are not generated here.
std::vector<double> entropy_grad_ref(const CeCase& c, const std::vector<double>& x, const std::vector<double>& ge) {
  const int64_t N = c.N, V = c.V;
  std::vector<double> g(size_t(N * V), 0.0), z(size_t(V), 0.0);
  for (int64_t i = 0; i < N; ++i) {
    const double gi = ge.size() == 1 ? ge[0] : ge[size_t(i)];
    const double* xi = &x[size_t(i * V)];
    double m = -INFINITY;
    for (int64_t j = 0; j < V; ++j) {
      z[j] = c.cap > 0 ? c.cap * std::tanh(c.scale * xi[j] / c.cap) : c.scale * xi[j];
      m = std::max(m, z[j]);
    }
    double s = 0, sz = 0;
    for (int64_t j = 0; j < V; ++j) {
      const double e = std::exp(z[j] - m);
      s += e;
      if (e > 0) sz += e * z[j];
    }
    const double mu = sz / s;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(z[j] - m) / s;
      const double th = c.cap > 0 ? std::tanh(c.scale * xi[j] / c.cap) : 0;
      g[size_t(i * V + j)] = p > 0 ? gi * p * (mu - z[j]) * c.scale * (1 - th * th) : 0.0;
    }
  }
  return g;
}

struct EntCase {
  CeCase ce;
  bool ge_scalar = false;
  bool loss_grad = true;  // grad_loss given (random); false: NULL (1)
};

std::string describe(const EntCase& k) {
  const CeCase& c = k.ce;
  char b[256];
  snprintf(b, sizeof b, "N=%lld V=%lld %s red=%d eps=%g zq=%g cap=%g scale=%g w=%d peaked=%d ge_scalar=%d",
           (long long)c.N, (long long)c.V, dt_name(c.dt), c.reduction, c.eps, c.zq, c.cap, c.scale, c.weights,
           c.peaked, k.ge_scalar);
  return b;
}

// Random targets (ignore_frac of them ignored), class weights when asked, upstream gradients.
struct Inputs {
  Tensor targets, weights, grad_loss, grad_entropy;
  std::vector<int64_t> tg;
  std::vector<double> w, gl, ge;
  Inputs(const EntCase& k) : targets(k.ce.tdt, {k.ce.N}) {
    const CeCase& c = k.ce;
    std::uniform_int_distribution<int64_t> col(0, c.V - 1);
    std::bernoulli_distribution ign(c.ignore_frac);
    std::uniform_real_distribution<double> u(-2, 2);
    tg.resize(size_t(c.N));
    for (int64_t i = 0; i < c.N; ++i) {
      tg[i] = ign(rng()) ? -100 : col(rng());
      targets.set_int(i, tg[i]);
    }
    targets.upload();
    if (c.weights) {
      weights = Tensor(DT::F32, {c.V});
      std::uniform_real_distribution<double> uw(0.1, 2.0);
      for (int64_t j = 0; j < c.V; ++j) { weights.set(j, uw(rng())); w.push_back(weights.get(j)); }
      weights.upload();
    }
    if (k.loss_grad) {
      if (c.reduction == FCE_REDUCTION_NONE) {
        grad_loss = Tensor(DT::F32, {c.N});
        for (int64_t i = 0; i < c.N; ++i) { grad_loss.set(i, u(rng())); gl.push_back(grad_loss.get(i)); }
        grad_loss.upload();
      } else {
        grad_loss = scalar_f32(0.75);
        gl = {0.75};
      }
    }
    if (k.ge_scalar) {
      grad_entropy = scalar_f32(-0.4);
      ge = {-0.4};
    } else {
      grad_entropy = Tensor(DT::F32, {c.N});
      for (int64_t i = 0; i < c.N; ++i) { grad_entropy.set(i, u(rng())); ge.push_back(grad_entropy.get(i)); }
      grad_entropy.upload();
    }
  }
};

void run_fused(const EntCase& k) {
  SCOPED_TRACE(describe(k));
  const CeCase& c = k.ce;
  const int64_t N = c.N, V = c.V;
  Handle h;
  Tensor logits(c.dt, {N, V}, V + c.pad);
  fill_logits(logits, c.logit_std, c.peaked);
  Inputs in(k);
  const std::vector<double> x = values(logits);
  const Ref ref = reference(c, x, in.tg, in.w, in.gl);
  const std::vector<double> eref = entropy_grad_ref(c, x, in.ge);
  fce_ce_options_t o = options_of(c, in.weights);
  const bool none = c.reduction == FCE_REDUCTION_NONE;
  Tensor loss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
  Tensor lse(DT::F32, {N}), ent(DT::F32, {N}), dl(c.dt, {N, V}, V + 3);
  for (Tensor* t : {&loss, &lse, &ent, &dl}) { t->poison(); t->upload(); }
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.lse = lse.dl();
  out.entropy = ent.dl();
  out.dlogits = dl.dl();
  out.grad_loss = k.loss_grad ? in.grad_loss.dl() : nullptr;
  out.grad_entropy = in.grad_entropy.dl();
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), in.targets.dl(), &o, &out, nullptr, 0));
  for (Tensor* t : {&lse, &ent, &dl}) t->download();
  double gmax = 0, xmax = 0, glmax = k.loss_grad ? 0.0 : 1.0, gemax = 0;
  for (size_t e = 0; e < eref.size(); ++e) gmax = std::max(gmax, std::fabs(ref.grad[e] + eref[e]));
  for (double v : x) xmax = std::max(xmax, std::fabs(v));
  for (double g : in.gl) glmax = std::max(glmax, std::fabs(g));
  for (double g : in.ge) gemax = std::max(gemax, std::fabs(g));
  if (c.reduction == FCE_REDUCTION_MEAN && ref.denom > 0) glmax /= ref.denom;
  const double subnormal = c.dt == DT::F16 ? 6e-8 : 0.0;
  // fp32 forms p_j = exp(z_j - lse) with an absolute error near 2^-20 at p ~ 1 (the rounding of lse, of the
  // order of |z| 2^-24, in the exponent), times the row's upstream gradients: the loss's, and the entropy's
  // with its factor mu - z up to the span of z.
  const double gscale = glmax + gemax * (1 + 2 * c.scale * xmax);
  const double rtol = dtype_rtol(c.dt) + 1e-4, atol = 2e-6 * std::max(gmax, gscale) + subnormal + 1e-9;
  for (int64_t i = 0; i < N; ++i) {
    ASSERT_TRUE(close(ent.get(i), ref.ent[i], 1e-4, 1e-4 * (1 + std::fabs(ref.lse[i])))) << "entropy row " << i;
    for (int64_t j = 0; j < V; ++j) {
      const double want = ref.grad[size_t(i * V + j)] + eref[size_t(i * V + j)];
      ASSERT_TRUE(close(dl.get(i, j), want, rtol, atol)) << "dlogits (" << i << "," << j << ")";
    }
  }
  // The same forward with the lse as its pairs [N, 2] (max z, log of the shifted sum): the same gradient bits,
  // and pairs whose sum is the lse.
  Tensor lsep(DT::F32, {N, 2}), dlp(c.dt, {N, V}, V + 3);
  for (Tensor* t : {&lsep, &dlp}) { t->poison(); t->upload(); }
  out.lse = lsep.dl();
  out.dlogits = dlp.dl();
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), in.targets.dl(), &o, &out, nullptr, 0));
  for (Tensor* t : {&lsep, &dlp}) t->download();
  for (int64_t i = 0; i < N; ++i) {
    ASSERT_TRUE(close(double(lsep.get(i, 0)) + lsep.get(i, 1), ref.lse[i], 2e-5, 1e-5)) << "lse pair row " << i;
    for (int64_t j = 0; j < V; ++j) ASSERT_EQ(dlp.get(i, j), dl.get(i, j)) << "dlogits with the lse pair (" << i << "," << j << ")";
  }
  // The backward from the saved pairs and entropy: the same bits as the fused gradient; from the [N] lse,
  // within the same bound (its p_j carry the lse's rounding, far below the bound at these magnitudes).
  for (Tensor* saved : {&lsep, &lse}) {
    Tensor dl2(c.dt, {N, V}, V + 3);
    dl2.poison();
    dl2.upload();
    fce_ce_bwd_inputs_t b = FCE_CE_BWD_INPUTS_INIT;
    b.lse = saved->dl();
    b.entropy = ent.dl();
    b.grad_loss = out.grad_loss;
    b.grad_entropy = in.grad_entropy.dl();
    FCE_OK(fce_cross_entropy_bwd_ex(h, test_stream(), logits.dl(), in.targets.dl(), &b, &o, dl2.dl(), nullptr, 0));
    dl2.download();
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < V; ++j) {
        if (saved == &lsep)
          ASSERT_EQ(dl2.get(i, j), dl.get(i, j)) << "bwd_ex differs from the fused gradient at (" << i << "," << j << ")";
        else
          ASSERT_TRUE(close(dl2.get(i, j), ref.grad[size_t(i * V + j)] + eref[size_t(i * V + j)], rtol, atol))
              << "bwd_ex from the [N] lse at (" << i << "," << j << ")";
      }
  }
  // padding between rows untouched
  const size_t es = dt_size(c.dt);
  for (int64_t i = 0; i + 1 < N; ++i)
    for (size_t at = size_t((i * dl.ld() + V) * es); at < size_t((i + 1) * dl.ld() * es); ++at)
      ASSERT_EQ(dl.bytes()[at], 0xff) << "padding of dlogits row " << i << " written";
}

}  // namespace

TEST(EntropyGrad, FusedAndBackwardAgainstFloat64) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16})
    for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_MEAN, FCE_REDUCTION_SUM})
      for (int64_t N : {1, 5, 33})
        for (int64_t V : {7, 1031}) {
          EntCase k{CeCase{N, V, dt}};
          k.ce.reduction = red;
          k.ce.peaked = N == 5;
          k.ge_scalar = N == 33 && red == FCE_REDUCTION_SUM;
          k.loss_grad = N != 1;
          run_fused(k);
          if (HasFatalFailure()) return;
        }
}

TEST(EntropyGrad, EveryOptionAndTemperature) {
  for (DT dt : {DT::F32, DT::BF16})
    for (double scale : {1.0 / 0.6, 1.0, 1.0 / 1.5})  // temperatures 0.6..1.5
      for (int opt = 0; opt < 4; ++opt) {
        EntCase k{CeCase{9, 263, dt}};
        k.ce.reduction = FCE_REDUCTION_NONE;
        k.ce.scale = scale;
        k.ce.cap = opt == 1 ? 4.0 : 0.0;
        k.ce.eps = opt == 2 ? 0.1 : 0.0;
        k.ce.zq = opt == 2 ? 1e-3 : 0.0;
        k.ce.weights = opt == 3;
        k.ce.pad = opt;
        run_fused(k);
        if (HasFatalFailure()) return;
      }
}

// Peaked rows at V = 129920 (the distributions behind verl's entropy reports): few rows (split rows on the
// GPU) and enough rows for one block per row.
TEST(EntropyGrad, PeakedLargeVocabulary) {
  for (int64_t N : {int64_t(2), many_rows(160)})
    for (DT dt : {DT::BF16, DT::F32}) {
      EntCase k{CeCase{N, 129920, dt}};
      k.ce.reduction = FCE_REDUCTION_NONE;
      k.ce.peaked = true;
      k.ce.scale = 1.0 / 0.7;
      k.ce.ignore_frac = 0.1;
      run_fused(k);
      if (HasFatalFailure()) return;
    }
}

// Central differences of the library's own forward: L = sum_i gl_i loss_i + sum_i ge_i H_i (a reduced loss
// times its scalar grad_loss), for every combination of upstream gradients, reductions, logit_scale,
// soft-cap and ignored rows.
TEST(EntropyGrad, FiniteDifferences) {
  const int64_t N = 4, V = 23;
  for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_SUM, FCE_REDUCTION_MEAN})
    for (int which = 1; which < 4; ++which)  // 1 loss only, 2 entropy only, 3 both
      for (double scale : {1.0, 0.6})
        for (double cap : {0.0, 3.0}) {
          Handle h;
          Tensor logits(DT::F32, {N, V});
          fill_logits(logits, 1.5, false);
          Tensor targets(DT::I64, {N});
          for (int64_t i = 0; i < N; ++i) targets.set_int(i, i == 1 ? -100 : (i * 5 + 2) % V);  // row 1 ignored
          targets.upload();
          fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
          o.reduction = red;
          o.logit_scale = float(scale);
          o.softcap = float(cap);
          const bool none = red == FCE_REDUCTION_NONE;
          std::vector<double> gl(none ? N : 1), ge(N);
          Tensor tgl = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {}), tge(DT::F32, {N});
          for (size_t i = 0; i < gl.size(); ++i) { tgl.set(int64_t(i), (which & 1) ? 0.5 + 0.25 * double(i) : 0.0); gl[i] = tgl.get(int64_t(i)); }
          for (int64_t i = 0; i < N; ++i) { tge.set(i, (which & 2) ? 0.8 - 0.3 * double(i) : 0.0); ge[size_t(i)] = tge.get(i); }
          tgl.upload();
          tge.upload();
          Tensor loss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {}), ent(DT::F32, {N}), dl(DT::F32, {N, V});
          dl.poison();
          dl.upload();
          fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
          out.loss = loss.dl();
          out.entropy = ent.dl();
          out.dlogits = dl.dl();
          out.grad_loss = tgl.dl();
          out.grad_entropy = tge.dl();
          FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0));
          dl.download();
          if (which == 2) {  // only the entropy: the ignored row still has a gradient
            double s = 0;
            for (int64_t j = 0; j < V; ++j) s += std::fabs(dl.get(1, j));
            EXPECT_GT(s, 0.0) << "the entropy's gradient of an ignored row is missing";
          }
          out.dlogits = nullptr;
          out.grad_loss = nullptr;
          out.grad_entropy = nullptr;
          auto objective = [&] {
            loss.download();
            ent.download();
            double f = 0;
            for (size_t i = 0; i < gl.size(); ++i) f += gl[i] * loss.get(int64_t(i));
            for (int64_t i = 0; i < N; ++i) f += ge[size_t(i)] * ent.get(i);
            return f;
          };
          const double eps = 1e-2;
          for (int64_t k = 0; k < 10; ++k) {
            const int64_t i = k % N, j = (k * 7 + 3) % V;
            const double x0 = logits.get(i, j);
            double f[2];
            for (int s = 0; s < 2; ++s) {
              logits.set(i, j, x0 + (s ? eps : -eps));
              logits.upload();
              FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0));
              f[s] = objective();
            }
            logits.set(i, j, x0);
            logits.upload();
            EXPECT_TRUE(close(dl.get(i, j), (f[1] - f[0]) / (2 * eps), 2e-2, 2e-3))
                << "red=" << red << " which=" << which << " scale=" << scale << " cap=" << cap << " element (" << i
                << "," << j << ")";
          }
        }
}

// -inf logits (a masked tail) get a zero gradient and no NaN; a zero grad_entropy gives the bits of the
// backward without one.
TEST(EntropyGrad, MaskedTailAndZeroUpstream) {
  const int64_t N = 3, V = 40;
  Handle h;
  Tensor logits(DT::F32, {N, V});
  fill_logits(logits, 1.0, false);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 30; j < V; ++j) logits.set(i, j, -INFINITY);
  logits.upload();
  Tensor targets(DT::I32, {N});
  for (int64_t i = 0; i < N; ++i) targets.set_int(i, i * 3);
  targets.upload();
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = FCE_REDUCTION_SUM;
  Tensor loss(DT::F32, {}), lse(DT::F32, {N}), ent(DT::F32, {N}), dl(DT::F32, {N, V});
  Tensor ge(DT::F32, {N});
  for (int64_t i = 0; i < N; ++i) ge.set(i, 1.0 + double(i));
  ge.upload();
  dl.poison();
  dl.upload();
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.lse = lse.dl();
  out.entropy = ent.dl();
  out.dlogits = dl.dl();
  out.grad_entropy = ge.dl();
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0));
  dl.download();
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) {
      ASSERT_FALSE(std::isnan(dl.get(i, j))) << "(" << i << "," << j << ")";
      if (j >= 30) {
        ASSERT_EQ(dl.get(i, j), 0.0) << "(" << i << "," << j << ")";
      }
    }
  // zero grad_entropy: bwd_ex == bwd, bit for bit
  Tensor zero = scalar_f32(0.0), a(DT::F32, {N, V}), b(DT::F32, {N, V});
  for (Tensor* t : {&a, &b}) { t->poison(); t->upload(); }
  FCE_OK(fce_cross_entropy_bwd(h, test_stream(), logits.dl(), targets.dl(), lse.dl(), nullptr, &o, a.dl(), nullptr, 0));
  fce_ce_bwd_inputs_t in = FCE_CE_BWD_INPUTS_INIT;
  in.lse = lse.dl();
  in.entropy = ent.dl();
  in.grad_entropy = zero.dl();
  FCE_OK(fce_cross_entropy_bwd_ex(h, test_stream(), logits.dl(), targets.dl(), &in, &o, b.dl(), nullptr, 0));
  a.download();
  b.download();
  EXPECT_TRUE(a.bytes() == b.bytes());
}

TEST(EntropyGrad, Validation) {
  const int64_t N = 4, V = 11;
  Handle h;
  Tensor logits(DT::F32, {N, V});
  fill_logits(logits, 1.0, false);
  Tensor targets(DT::I64, {N});
  for (int64_t i = 0; i < N; ++i) targets.set_int(i, i);
  targets.upload();
  Tensor loss(DT::F32, {}), lse(DT::F32, {N}), ent(DT::F32, {N}), dl(DT::F32, {N, V}), ge(DT::F32, {N}),
      ge_bad(DT::F32, {N + 1});
  for (Tensor* t : {&ge, &ge_bad}) t->upload();
  auto untouched = [&] {
    for (Tensor* t : {&loss, &dl}) {
      t->download();
      for (uint8_t b : t->bytes()) if (b != 0xff) return false;
    }
    return true;
  };
  for (Tensor* t : {&loss, &dl}) { t->poison(); t->upload(); }
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.grad_entropy = ge.dl();  // without dlogits
  EXPECT_EQ(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), nullptr, &out, nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_last_error_message()).find("grad_entropy"), std::string::npos);
  out.dlogits = dl.dl();
  out.grad_entropy = ge_bad.dl();
  EXPECT_EQ(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), nullptr, &out, nullptr, 0),
            FCE_STATUS_SHAPE_MISMATCH);
  EXPECT_TRUE(untouched());
  fce_ce_bwd_inputs_t in = FCE_CE_BWD_INPUTS_INIT;
  EXPECT_EQ(fce_cross_entropy_bwd_ex(h, test_stream(), logits.dl(), targets.dl(), nullptr, nullptr, dl.dl(), nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(fce_cross_entropy_bwd_ex(h, test_stream(), logits.dl(), targets.dl(), &in, nullptr, dl.dl(), nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);  // no lse
  in.lse = lse.dl();
  in.grad_entropy = ge.dl();  // without entropy
  EXPECT_EQ(fce_cross_entropy_bwd_ex(h, test_stream(), logits.dl(), targets.dl(), &in, nullptr, dl.dl(), nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_last_error_message()).find("inputs->entropy"), std::string::npos);
  EXPECT_TRUE(untouched());
  // linear cross-entropy: grad_entropy without a gradient output; saved_entropy in the forward
  Tensor hid(DT::F32, {N, 8}), wt(DT::F32, {V, 8}), dh(DT::F32, {N, 8});
  fill_logits(hid, 1.0, false);
  fill_logits(wt, 1.0, false);
  fce_linear_ce_outputs_t lo = FCE_LINEAR_CE_OUTPUTS_INIT;
  lo.loss = loss.dl();
  lo.grad_entropy = ge.dl();
  EXPECT_EQ(fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), wt.dl(), nullptr, targets.dl(), nullptr, &lo,
                                         nullptr, 0), FCE_STATUS_INVALID_ARGUMENT);
  lo.dhidden = dh.dl();
  lo.saved_entropy = ent.dl();
  EXPECT_EQ(fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), wt.dl(), nullptr, targets.dl(), nullptr, &lo,
                                         nullptr, 0), FCE_STATUS_INVALID_ARGUMENT);
  fce_linear_ce_outputs_t lb = FCE_LINEAR_CE_OUTPUTS_INIT;
  lb.dhidden = dh.dl();
  lb.grad_entropy = ge.dl();  // backward without saved_entropy
  EXPECT_EQ(fce_linear_cross_entropy_bwd(h, test_stream(), hid.dl(), wt.dl(), nullptr, targets.dl(), lse.dl(), nullptr,
                                         &lb, nullptr, 0), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_TRUE(untouched());
}

// Linear cross-entropy with both upstream gradients: dhidden = G W, dweight = G^T h with G the float64
// reference of the logits' gradient; the backward from the saved lse and entropy agrees.
TEST(EntropyGrad, LinearCrossEntropy) {
  for (DT dt : {DT::F32, DT::BF16})
    for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_MEAN}) {
      const int64_t N = 13, H = 24, V = 131;
      SCOPED_TRACE(std::string(dt_name(dt)) + " red=" + std::to_string(red));
      Handle h;
      Tensor hid(dt, {N, H}), wt(dt, {V, H});
      fill_logits(hid, 1.0, false);
      fill_logits(wt, 0.5, false);
      EntCase k{CeCase{N, V, dt}};
      k.ce.reduction = red;
      k.ce.scale = 1.0 / 0.8;
      Inputs in(k);
      // logits as the library forms them: fp32 accumulation, rounded to the inputs' dtype
      Tensor lg(dt, {N, V});
      for (int64_t i = 0; i < N; ++i)
        for (int64_t v = 0; v < V; ++v) {
          double s = 0;
          for (int64_t c = 0; c < H; ++c) s += hid.get(i, c) * wt.get(v, c);
          lg.set(i, v, s);
        }
      const std::vector<double> x = values(lg);
      const Ref ref = reference(k.ce, x, in.tg, in.w, in.gl);
      const std::vector<double> eref = entropy_grad_ref(k.ce, x, in.ge);
      fce_ce_options_t o = options_of(k.ce, in.weights);
      const bool none = red == FCE_REDUCTION_NONE;
      Tensor loss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
      Tensor lse(DT::F32, {N}), ent(DT::F32, {N}), dh(dt, {N, H}), dw(dt, {V, H}), dh2(dt, {N, H}), dw2(dt, {V, H});
      for (Tensor* t : {&loss, &lse, &ent, &dh, &dw, &dh2, &dw2}) { t->poison(); t->upload(); }
      fce_linear_ce_outputs_t lo = FCE_LINEAR_CE_OUTPUTS_INIT;
      lo.loss = loss.dl();
      lo.lse = lse.dl();
      lo.entropy = ent.dl();
      lo.dhidden = dh.dl();
      lo.dweight = dw.dl();
      lo.grad_loss = in.grad_loss.dl();
      lo.grad_entropy = in.grad_entropy.dl();
      FCE_OK(fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), wt.dl(), nullptr, in.targets.dl(), &o, &lo,
                                          nullptr, 0));
      fce_linear_ce_outputs_t lb = FCE_LINEAR_CE_OUTPUTS_INIT;
      lb.dhidden = dh2.dl();
      lb.dweight = dw2.dl();
      lb.grad_loss = in.grad_loss.dl();
      lb.grad_entropy = in.grad_entropy.dl();
      lb.saved_entropy = ent.dl();
      FCE_OK(fce_linear_cross_entropy_bwd(h, test_stream(), hid.dl(), wt.dl(), nullptr, in.targets.dl(), lse.dl(), &o,
                                          &lb, nullptr, 0));
      for (Tensor* t : {&dh, &dw, &dh2, &dw2}) t->download();
      // G rounded to the inputs' dtype is the GEMMs' operand: compare with a tolerance of that rounding
      std::vector<double> G(size_t(N * V));
      double gmax = 0;
      for (size_t e = 0; e < G.size(); ++e) { G[e] = ref.grad[e] + eref[e]; gmax = std::max(gmax, std::fabs(G[e])); }
      const double tol = (dt == DT::F32 ? 1e-4 : 3e-2) * gmax * std::sqrt(double(std::max(N, V)));
      for (int64_t i = 0; i < N; ++i)
        for (int64_t c = 0; c < H; ++c) {
          double s = 0;
          for (int64_t v = 0; v < V; ++v) s += G[size_t(i * V + v)] * wt.get(v, c);
          ASSERT_NEAR(dh.get(i, c), s, tol) << "dhidden (" << i << "," << c << ")";
          ASSERT_NEAR(dh2.get(i, c), s, tol) << "bwd dhidden (" << i << "," << c << ")";
        }
      for (int64_t v = 0; v < V; ++v)
        for (int64_t c = 0; c < H; ++c) {
          double s = 0;
          for (int64_t i = 0; i < N; ++i) s += G[size_t(i * V + v)] * hid.get(i, c);
          ASSERT_NEAR(dw.get(v, c), s, tol) << "dweight (" << v << "," << c << ")";
          ASSERT_NEAR(dw2.get(v, c), s, tol) << "bwd dweight (" << v << "," << c << ")";
        }
    }
}

// A vocabulary shard's backward with the entropy's gradient: records of 3 uneven shards (the last padded),
// combined into lse and entropy, then each shard's dlogits from fce_cross_entropy_bwd_ex; the same bits as
// the unsharded backward from the same lse and entropy, and the float64 reference within bounds.
TEST(EntropyGrad, VocabularyShards) {
  const int64_t N = 6, V = 97, K = 7;
  const int64_t starts[3] = {0, 40, 71}, widths[3] = {40, 31, 26}, pads[3] = {0, 0, 5};
  for (DT dt : {DT::F32, DT::BF16}) {
    SCOPED_TRACE(dt_name(dt));
    Handle h;
    EntCase k{CeCase{N, V, dt}};
    k.ce.reduction = dt == DT::F32 ? FCE_REDUCTION_MEAN : FCE_REDUCTION_NONE;
    k.ce.eps = dt == DT::F32 ? 0.05 : 0.0;
    k.ce.weights = dt == DT::BF16;  // class weights without smoothing: no class-weight sum is formed
    Tensor full(dt, {N, V});
    fill_logits(full, 2.0, true);
    Inputs in(k);
    const std::vector<double> x = values(full);
    const Ref ref = reference(k.ce, x, in.tg, in.w, in.gl);
    const std::vector<double> eref = entropy_grad_ref(k.ce, x, in.ge);
    fce_ce_options_t o = options_of(k.ce, in.weights);
    o.vocab_total = V;
    Tensor rec(DT::F32, {3 * N, K});
    std::vector<Tensor> parts;
    for (int r = 0; r < 3; ++r) {
      Tensor part(dt, {N, widths[r] + pads[r]});
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < widths[r] + pads[r]; ++j) part.set(i, j, j < widths[r] ? full.get(i, starts[r] + j) : NAN);
      part.upload();
      Tensor one(DT::F32, {N, K});
      o.vocab_start = starts[r];
      FCE_OK(fce_cross_entropy_partial(h, test_stream(), part.dl(), in.targets.dl(), &o, one.dl()));
      one.download();
      std::memcpy(rec.raw() + 4 * size_t(r * N * K), one.bytes().data(), 4 * size_t(N * K));
      parts.push_back(std::move(part));
    }
    rec.upload();
    int64_t shape3[3] = {3, N, K};
    DLTensor r3 = *rec.dl();
    r3.ndim = 3;
    r3.shape = shape3;
    r3.strides = nullptr;
    Tensor loss = k.ce.reduction == FCE_REDUCTION_NONE ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
    Tensor lse(DT::F32, {N}), ent(DT::F32, {N});
    fce_ce_outputs_t co = FCE_CE_OUTPUTS_INIT;
    co.loss = loss.dl();
    co.lse = lse.dl();
    co.entropy = ent.dl();
    FCE_OK(fce_cross_entropy_combine(h, test_stream(), &r3, in.targets.dl(), &o, &co, nullptr, 0));
    fce_ce_bwd_inputs_t b = FCE_CE_BWD_INPUTS_INIT;
    b.lse = lse.dl();
    b.entropy = ent.dl();
    b.grad_loss = in.grad_loss.dl();
    b.grad_entropy = in.grad_entropy.dl();
    fce_ce_options_t uo = options_of(k.ce, in.weights);
    Tensor whole(dt, {N, V});
    FCE_OK(fce_cross_entropy_bwd_ex(h, test_stream(), full.dl(), in.targets.dl(), &b, &uo, whole.dl(), nullptr, 0));
    whole.download();
    double gmax = 0;
    for (size_t e = 0; e < eref.size(); ++e) gmax = std::max(gmax, std::fabs(ref.grad[e] + eref[e]));
    for (int r = 0; r < 3; ++r) {
      Tensor d(dt, {N, widths[r] + pads[r]});
      d.poison();
      d.upload();
      o.vocab_start = starts[r];
      FCE_OK(fce_cross_entropy_bwd_ex(h, test_stream(), parts[size_t(r)].dl(), in.targets.dl(), &b, &o, d.dl(), nullptr, 0));
      d.download();
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < widths[r] + pads[r]; ++j) {
          if (j >= widths[r]) {
            ASSERT_EQ(d.get(i, j), 0.0) << "padding (" << i << "," << j << ") of shard " << r;
            continue;
          }
          const int64_t gj = starts[r] + j;
          ASSERT_EQ(d.get(i, j), whole.get(i, gj)) << "shard " << r << " (" << i << "," << gj << ")";
          ASSERT_TRUE(close(d.get(i, j), ref.grad[size_t(i * V + gj)] + eref[size_t(i * V + gj)],
                            dtype_rtol(dt) + 1e-4, 1e-5 * gmax))
              << "shard " << r << " (" << i << "," << gj << ")";
        }
    }
  }
}

// The entropy of peaked rows (one logit far above the rest: H down to ~1e-8 nats) to an absolute error near
// fp32's resolution of the softmax's sum (~1e-7), not the ulp of the largest logit (~4e-6 at z ~ 60) that
// lse - sum p z would leave; unsharded, and combined from two shards' records.
TEST(EntropyGrad, PeakedEntropyPrecision) {
  const int64_t N = 4, K = 7;
  for (int64_t V : {1031, 129920}) {
    SCOPED_TRACE("V=" + std::to_string(V));
    Handle h;
    Tensor x(DT::F32, {N, V});
    std::normal_distribution<double> nd(0.0, 1.0);
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t j = 0; j < V; ++j) x.set(i, j, nd(rng()));
      x.set(i, (i * 7919) % V, 14.0 + 3.0 * double(i));  // z_max = x / 0.6 up to ~40
    }
    x.upload();
    const double scale = 1.0 / 0.6;
    std::vector<double> ref(size_t(N), 0.0);
    for (int64_t i = 0; i < N; ++i) {
      double m = -INFINITY, s = 0, sz = 0;
      for (int64_t j = 0; j < V; ++j) m = std::max(m, scale * x.get(i, j));
      for (int64_t j = 0; j < V; ++j) {
        const double d = scale * x.get(i, j) - m, e = std::exp(d);
        s += e;
        sz += e * d;
      }
      ref[size_t(i)] = std::log(s) - sz / s;  // in the shifted form, exact in float64
    }
    Tensor targets(DT::I64, {N});
    for (int64_t i = 0; i < N; ++i) targets.set_int(i, i);
    targets.upload();
    fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
    o.reduction = FCE_REDUCTION_NONE;
    o.logit_scale = float(scale);
    Tensor loss(DT::F32, {N}), ent(DT::F32, {N});
    ent.poison();
    ent.upload();
    fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
    out.loss = loss.dl();
    out.entropy = ent.dl();
    FCE_OK(fce_cross_entropy_fwd(h, test_stream(), x.dl(), targets.dl(), &o, &out, nullptr, 0));
    ent.download();
    for (int64_t i = 0; i < N; ++i)
      // a few fp32 ulps of the row's sums (lse - sum p z would miss by the ulp of z_max, ~4e-6)
      EXPECT_NEAR(ent.get(i), ref[size_t(i)], 5e-7 + 1e-4 * ref[size_t(i)]) << "row " << i << " (H = " << ref[size_t(i)] << ")";
    // two shards, split at V/2 (the peak of some rows in each)
    o.vocab_total = V;
    Tensor rec(DT::F32, {2 * N, K});
    for (int r = 0; r < 2; ++r) {
      const int64_t start = r == 0 ? 0 : V / 2, width = r == 0 ? V / 2 : V - V / 2;
      Tensor part(DT::F32, {N, width});
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < width; ++j) part.set(i, j, x.get(i, start + j));
      part.upload();
      Tensor one(DT::F32, {N, K});
      o.vocab_start = start;
      FCE_OK(fce_cross_entropy_partial(h, test_stream(), part.dl(), targets.dl(), &o, one.dl()));
      one.download();
      std::memcpy(rec.raw() + 4 * size_t(r * N * K), one.bytes().data(), 4 * size_t(N * K));
    }
    rec.upload();
    int64_t shape3[3] = {2, N, K};
    DLTensor r3 = *rec.dl();
    r3.ndim = 3;
    r3.shape = shape3;
    r3.strides = nullptr;
    ent.poison();
    ent.upload();
    FCE_OK(fce_cross_entropy_combine(h, test_stream(), &r3, targets.dl(), &o, &out, nullptr, 0));
    ent.download();
    for (int64_t i = 0; i < N; ++i)
      EXPECT_NEAR(ent.get(i), ref[size_t(i)], 5e-7 + 1e-4 * ref[size_t(i)]) << "combined row " << i;
  }
}
