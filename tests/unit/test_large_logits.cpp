// Probabilities formed from max-shifted values, whatever the logits' common offset (issue 47, item 2), and a
// vocabulary shard's softmax at any T without NaN (item 4): cross-entropy's fused gradient and its backward
// from the lse pairs [N, 2], the z-loss at a huge lse, the unsharded softmax and KD, linear CE and the
// shards' backward at large offsets, against float64 references written here; the same bound as
// docs/numerics.md section 1 at every offset.
#include <algorithm>

#include "common/calls.hpp"
#include "common/ce_reference.hpp"

using namespace fct;

namespace {

// Section 1's dlogits bound: 1e-6 max(max_j |ref|, g) (+6e-8 for fp16 outputs) + 1e-9, dtype_rtol + 1e-4.
::testing::AssertionResult grad_close(double got, double want, double rowmax, double g, DT dt) {
  const double atol = 1e-6 * std::max(rowmax, g) + (dt == DT::F16 ? 6e-8 : 0.0) + 1e-9;
  return close(got, want, dtype_rtol(dt) + 1e-4, atol);
}

// The fused forward (lean: loss, lse pairs and dlogits, the usual training call; or every output), then the
// backward from the pairs it saved. Both gradients against the float64 reference, and the backward's bits
// against the fused gradient's.
void check_ce(const CeCase& c, Tensor& logits, const std::vector<int64_t>& tg, bool lean) {
  SCOPED_TRACE(testing::Message() << "N " << c.N << " V " << c.V << " " << dt_name(c.dt) << (lean ? " lean" : " full")
                                  << " zq " << c.zq << " eps " << c.eps << " scale " << c.scale);
  const int64_t N = c.N, V = c.V;
  Handle h;
  Tensor targets = ints(DT::I64, tg);
  std::vector<double> w;
  Tensor weights = class_weights(c, V, w);
  const Ref ref = reference(c, values(logits), tg, w, {});
  fce_ce_options_t o = options_of(c, weights);
  const bool none = c.reduction == FCE_REDUCTION_NONE;
  Tensor loss = poisoned(DT::F32, none ? std::vector<int64_t>{N} : std::vector<int64_t>{});
  Tensor pair = poisoned(DT::F32, {N, 2}), ent = poisoned(DT::F32, {N}), amax = poisoned(DT::I64, {N});
  Tensor dl = poisoned(c.dt, {N, V});
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.lse = pair.dl();
  out.dlogits = dl.dl();
  if (!lean) {
    out.entropy = ent.dl();
    out.argmax = amax.dl();
  }
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0));
  for (Tensor* t : {&loss, &pair, &dl}) t->download();
  const double g = c.reduction == FCE_REDUCTION_MEAN && ref.denom > 0 ? 1.0 / ref.denom : 1.0;
  // The loss as lse - z_t = (m - z_t) + l: within fp32's resolution of the loss itself at any offset (a
  // rounded lse would put its ulp, 2^-7 at 1e5, into every row). Label smoothing's sum keeps lse W - sum w z.
  if (c.eps == 0 && c.zq == 0) {
    if (none) {
      for (int64_t i = 0; i < N; ++i)
        ASSERT_TRUE(close(loss.get(i), ref.loss[size_t(i)], 1e-5, 1e-5)) << "loss row " << i;
    } else {
      ASSERT_TRUE(close(loss.get(0), ref.total, 1e-5, 1e-5)) << "reduced loss";
    }
  }
  for (int64_t i = 0; i < N; ++i) {
    ASSERT_TRUE(close(pair.get(i, 0) + pair.get(i, 1), ref.lse[size_t(i)], 2e-6, 1e-5)) << "lse pair row " << i;
    double rowmax = 0;
    for (int64_t j = 0; j < V; ++j) rowmax = std::max(rowmax, std::fabs(ref.grad[size_t(i * V + j)]));
    for (int64_t j = 0; j < V; ++j)
      ASSERT_TRUE(grad_close(dl.get(i, j), ref.grad[size_t(i * V + j)], rowmax, g, c.dt))
          << "fused dlogits (" << i << "," << j << ")";
  }
  Tensor dl2 = poisoned(c.dt, {N, V});
  FCE_OK(fce_cross_entropy_bwd(h, test_stream(), logits.dl(), targets.dl(), pair.dl(), nullptr, &o, dl2.dl(), nullptr, 0));
  dl2.download();
  ASSERT_TRUE(bits_equal(dl2, dl)) << "the backward from the pairs differs from the fused gradient";
}

std::vector<int64_t> random_targets(int64_t N, int64_t V) {
  std::uniform_int_distribution<int64_t> col(0, V - 1);
  std::vector<int64_t> tg(static_cast<size_t>(N));
  for (auto& t : tg) t = col(rng());
  return tg;
}

}  // namespace

// The row: two logits of 2^25 share the mass. A rounded fp32 lse (2^25, ulp 4) gave p = 1 for both
// and dlogits [0, 1, 0, 0].
TEST(LargeLogits, TwoEqualHugeLogitsShareTheMass) {
  for (DT dt : {DT::F32, DT::BF16}) {
    Tensor x = matrix(dt, {{33554432.0, 33554432.0, 0.0, 1.0}});
    CeCase c{1, 4, dt};
    c.reduction = FCE_REDUCTION_NONE;
    check_ce(c, x, {0}, true);
    check_ce(c, x, {0}, false);
    Tensor t = ints(DT::I64, {0});
    const Ce r = ce_fwd(x, t, ce_none());
    ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
    EXPECT_TRUE(close(r.dl.get(0, 0), -0.5, 1e-6, 1e-7));
    EXPECT_TRUE(close(r.dl.get(0, 1), 0.5, 1e-6, 1e-7));
    EXPECT_EQ(r.dl.get(0, 2), 0.0);
  }
}

// fp32 N(0, 1) rows at a common offset up to 1e6 (3e4 was 6x the bound, 1e5 19x), every path's shape:
// few rows (split), rows of the row kernel and of the pipelined kernels on CUDA; lean and full outputs,
// label smoothing and class weights, MEAN.
TEST(LargeLogits, CrossEntropyGradientAtAnyOffset) {
  for (double offset : {0.0, 3e4, 1e5, 1e6})
    for (int64_t N : {1, 3, 40})
      for (int64_t V : {129, 1031, 8192}) {
        SCOPED_TRACE(testing::Message() << "offset " << offset);
        CeCase c{N, V, DT::F32};
        c.reduction = N == 3 ? FCE_REDUCTION_MEAN : FCE_REDUCTION_NONE;
        Tensor x(DT::F32, {N, V});
        fill_logits(x, 1.0, false);
        for (int64_t i = 0; i < N; ++i)
          for (int64_t j = 0; j < V; ++j) x.set(i, j, x.get(i, j) + offset);
        x.upload();
        const std::vector<int64_t> tg = random_targets(N, V);
        check_ce(c, x, tg, true);
        check_ce(c, x, tg, false);
        if (V == 1031) {
          c.eps = 0.1;
          c.weights = true;
          check_ce(c, x, tg, false);
        }
      }
}

// fp16 and bf16 over their whole range: rows holding the dtype's largest value two or three times (the mass
// split between them), the rest random within 30 of it (fp16: 65504 in steps of 32) or far below.
TEST(LargeLogits, HalfPrecisionRowsAtTheirLargestValues) {
  for (DT dt : {DT::F16, DT::BF16}) {
    const double top = dt == DT::F16 ? 65504.0 : 3.3895313892515355e38;
    for (int64_t V : {7, 1031, 8192}) {
      const int64_t N = 4;
      CeCase c{N, V, dt};
      c.reduction = FCE_REDUCTION_NONE;
      Tensor x(dt, {N, V});
      std::uniform_real_distribution<double> u(0.0, 30.0);
      for (int64_t i = 0; i < N; ++i) {
        for (int64_t j = 0; j < V; ++j) x.set(i, j, dt == DT::F16 ? top - u(rng()) : -u(rng()));
        x.set(i, 0, top);
        x.set(i, V / 2, top);
        if (i % 2) x.set(i, V - 1, top);
      }
      x.upload();
      const std::vector<int64_t> tg = random_targets(N, V);
      check_ce(c, x, tg, true);
      check_ce(c, x, tg, false);
    }
  }
}

// A z-loss row with lse 1e15 (twice the true gradient before): its 2 q lse p_j term from the pair's p_j.
TEST(LargeLogits, ZLossAtAHugeLse) {
  Tensor x = matrix(DT::F32, {{1e15, 1e15, 0.0, 1.0}, {1e15, 3.0, 2.0, 1.0}});
  CeCase c{2, 4, DT::F32};
  c.reduction = FCE_REDUCTION_NONE;
  c.zq = 1e-4;
  check_ce(c, x, {1, 0}, true);
  check_ce(c, x, {1, 0}, false);
}

// The entropy's gradient at an offset: mu - z_j formed as -log p_j - H (issue 47 item 2's "the same for").
TEST(LargeLogits, EntropyGradientAtAnOffset) {
  const int64_t N = 3, V = 2053;
  Tensor x(DT::F32, {N, V});
  fill_logits(x, 1.0, false);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) x.set(i, j, x.get(i, j) + 1e5);
  x.upload();
  const std::vector<double> xv = values(x);
  Tensor t = ints(DT::I64, random_targets(N, V)), ge = floats({0.3, -1.0, 2.0});
  Handle h;
  fce_ce_options_t o = ce_none();
  Tensor loss = poisoned(DT::F32, {N}), pair = poisoned(DT::F32, {N, 2}), ent = poisoned(DT::F32, {N});
  Tensor dl = poisoned(DT::F32, {N, V});
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.lse = pair.dl();
  out.entropy = ent.dl();
  out.dlogits = dl.dl();
  out.grad_entropy = ge.dl();
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), x.dl(), t.dl(), &o, &out, nullptr, 0));
  for (Tensor* r : {&ent, &dl, &pair}) r->download();
  for (int64_t i = 0; i < N; ++i) {
    const double* xi = &xv[size_t(i * V)];
    const double m = *std::max_element(xi, xi + V);
    double s = 0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(xi[j] - m);
    const double lse = m + std::log(s);
    double H = 0;
    for (int64_t j = 0; j < V; ++j) H -= std::exp(xi[j] - lse) * (xi[j] - lse);
    std::vector<double> want(static_cast<size_t>(V));
    double rowmax = 0;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(xi[j] - lse);
      want[size_t(j)] = p - (j == t.get_int(i)) + ge.get(i) * p * (-(xi[j] - lse) - H);
      rowmax = std::max(rowmax, std::fabs(want[size_t(j)]));
    }
    for (int64_t j = 0; j < V; ++j)
      ASSERT_TRUE(grad_close(dl.get(i, j), want[size_t(j)], rowmax * 2, 1.0, DT::F32)) << "(" << i << "," << j << ")";
  }
  // The backward from the pairs and the entropy gives the fused bits.
  Tensor dl2 = poisoned(DT::F32, {N, V});
  fce_ce_bwd_inputs_t b = FCE_CE_BWD_INPUTS_INIT;
  b.lse = pair.dl();
  b.entropy = ent.dl();
  b.grad_entropy = ge.dl();
  FCE_OK(fce_cross_entropy_bwd_ex(h, test_stream(), x.dl(), t.dl(), &b, &o, dl2.dl(), nullptr, 0));
  dl2.download();
  EXPECT_TRUE(bits_equal(dl2, dl));
}

// The unsharded softmax and KD were already max-shifted (numerics.md N3, N7): held at offsets up to 1e6.
TEST(LargeLogits, SoftmaxAndKdAtAnyOffset) {
  const int64_t N = 3, V = 1031;
  for (double offset : {1e5, 1e6}) {
    Tensor x(DT::F32, {N, V}), y(DT::F32, {N, V});
    fill_logits(x, 1.0, false);
    fill_logits(y, 1.0, false);
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < V; ++j) {
        x.set(i, j, x.get(i, j) + offset);
        y.set(i, j, y.get(i, j) + offset);
      }
    x.upload();
    y.upload();
    const std::vector<double> xv = values(x), yv = values(y);
    const Sm sm = softmax(x, temp(0.5f));
    ASSERT_EQ(sm.status, FCE_STATUS_SUCCESS);
    for (int64_t i = 0; i < N; ++i) {
      std::vector<double> z(xv.begin() + i * V, xv.begin() + (i + 1) * V);
      for (double& v : z) v /= 0.5;
      const double l = lse_of(z);
      for (int64_t j = 0; j < V; ++j) ASSERT_TRUE(close(sm.p.get(i, j), std::exp(z[size_t(j)] - l), 2e-5, 1e-7));
    }
    // Forward KL(teacher || student): loss and dstudent against float64.
    Kd r = kd(x, full(y), kd_opts(FCE_KD_FORWARD_KL));
    ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
    for (int64_t i = 0; i < N; ++i) {
      std::vector<double> zs(xv.begin() + i * V, xv.begin() + (i + 1) * V), zt(yv.begin() + i * V, yv.begin() + (i + 1) * V);
      const double ls = lse_of(zs), lt = lse_of(zt);
      double kl = 0;
      for (int64_t j = 0; j < V; ++j) {
        const double p = std::exp(zt[size_t(j)] - lt);
        kl += p * ((zt[size_t(j)] - lt) - (zs[size_t(j)] - ls));
      }
      ASSERT_TRUE(close(r.loss.get(i), kl, 1e-4, 2e-6)) << "KD row " << i;
      for (int64_t j = 0; j < V; ++j) {
        const double want = std::exp(zs[size_t(j)] - ls) - std::exp(zt[size_t(j)] - lt);
        ASSERT_TRUE(close(r.ds.get(i, j), want, 2e-4, 1e-6)) << "dstudent (" << i << "," << j << ")";
      }
    }
  }
}

// Linear CE at an offset (a bias of 1e5): the backward from the forward's pairs gives the fused gradients'
// bits, and both agree with the float64 reference of the rounded logits.
TEST(LargeLogits, LinearCrossEntropyAtAnOffset) {
  const int64_t N = 5, H = 16, V = 777;
  Tensor hid(DT::F32, {N, H}), wt(DT::F32, {V, H}), bias(DT::F32, {V});
  fill_logits(hid, 0.5, false);
  fill_logits(wt, 0.5, false);
  for (int64_t j = 0; j < V; ++j) bias.set(j, 1e5);
  bias.upload();
  Tensor t = ints(DT::I64, random_targets(N, V));
  Handle h;
  fce_ce_options_t o = ce_none();
  Tensor loss = poisoned(DT::F32, {N}), pair = poisoned(DT::F32, {N, 2}), dh = poisoned(DT::F32, {N, H});
  Tensor dw = poisoned(DT::F32, {V, H});
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.lse = pair.dl();
  out.dhidden = dh.dl();
  out.dweight = dw.dl();
  FCE_OK(fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), wt.dl(), bias.dl(), t.dl(), &o, &out, nullptr, 0));
  for (Tensor* r : {&pair, &dh, &dw}) r->download();
  // float64 reference from the logits the library forms (fp32 GEMM plus bias): p from max-shifted values.
  const std::vector<double> hv = values(hid), wv = values(wt);
  std::vector<double> dhr(size_t(N * H), 0.0);
  for (int64_t i = 0; i < N; ++i) {
    std::vector<double> z(static_cast<size_t>(V));
    for (int64_t j = 0; j < V; ++j) {
      double a = 0;
      for (int64_t k = 0; k < H; ++k) a += hv[size_t(i * H + k)] * wv[size_t(j * H + k)];
      z[size_t(j)] = double(float(float(a) + 1e5f));
    }
    const double l = lse_of(z);
    for (int64_t j = 0; j < V; ++j) {
      const double d = std::exp(z[size_t(j)] - l) - (j == t.get_int(i));
      for (int64_t k = 0; k < H; ++k) dhr[size_t(i * H + k)] += d * wv[size_t(j * H + k)];
    }
  }
  double dmax = 0;
  for (double v : dhr) dmax = std::max(dmax, std::fabs(v));
  // The logits' fp32 rounding near 1e5 (ulp 2^-7) moves each p by up to 2^-8 relative: the header's bound.
  for (int64_t e = 0; e < N * H; ++e) ASSERT_TRUE(close(dh.get(e / H, e % H), dhr[size_t(e)], 1e-2, 1e-2 * dmax)) << e;
  Tensor dh2 = poisoned(DT::F32, {N, H}), dw2 = poisoned(DT::F32, {V, H});
  fce_linear_ce_outputs_t bo = FCE_LINEAR_CE_OUTPUTS_INIT;
  bo.dhidden = dh2.dl();
  bo.dweight = dw2.dl();
  FCE_OK(fce_linear_cross_entropy_bwd(h, test_stream(), hid.dl(), wt.dl(), bias.dl(), t.dl(), pair.dl(), &o, &bo,
                                      nullptr, 0));
  dh2.download();
  dw2.download();
  EXPECT_TRUE(bits_equal(dh2, dh));
  EXPECT_TRUE(bits_equal(dw2, dw));
}

// The shards' backward from the combine's pairs at an offset of 1e5: each shard's columns of the float64
// gradient within the bound (the combined lse as one fp32 value was off by up to its ulp, 2^-7).
TEST(LargeLogits, ShardBackwardAtAnOffset) {
  const int64_t N = 4, V = 1031;
  CeCase c{N, V, DT::F32};
  c.reduction = FCE_REDUCTION_NONE;
  Tensor x(DT::F32, {N, V});
  fill_logits(x, 1.0, false);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) x.set(i, j, x.get(i, j) + 1e5);
  x.upload();
  const std::vector<int64_t> tg = random_targets(N, V);
  Tensor t = ints(DT::I64, tg), none_w;
  const Ref ref = reference(c, values(x), tg, {}, {});
  const std::vector<Shard> shards = split_vocabulary(V, {400, 300}, 5);
  const int64_t W = int64_t(shards.size()), K = FCE_CE_RECORD_FIELDS_LOSS;
  Handle h;
  fce_ce_options_t o = options_of(c, none_w);
  o.vocab_total = V;
  Records rec(W, N, K);
  std::vector<Tensor> parts;
  for (int64_t r = 0; r < W; ++r) {
    const Shard& s = shards[size_t(r)];
    Tensor part(DT::F32, {N, s.cols});
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < s.cols; ++j) part.set(i, j, j < s.width ? x.get(i, s.start + j) : NAN);
    part.upload();
    Tensor one = poisoned(DT::F32, {N, K});
    o.vocab_start = s.start;
    FCE_OK(fce_cross_entropy_partial(h, test_stream(), part.dl(), t.dl(), &o, one.dl()));
    one.download();
    std::memcpy(rec.t.raw() + 4 * size_t(r * N * K), one.bytes().data(), 4 * size_t(N * K));
    parts.push_back(std::move(part));
  }
  rec.t.upload();
  Tensor loss = poisoned(DT::F32, {N}), pair = poisoned(DT::F32, {N, 2});
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.lse = pair.dl();
  FCE_OK(fce_cross_entropy_combine(h, test_stream(), &rec.dl, t.dl(), &o, &out, nullptr, 0));
  for (int64_t r = 0; r < W; ++r) {
    const Shard& s = shards[size_t(r)];
    Tensor dl = poisoned(DT::F32, {N, s.cols});
    o.vocab_start = s.start;
    FCE_OK(fce_cross_entropy_bwd(h, test_stream(), parts[size_t(r)].dl(), t.dl(), pair.dl(), nullptr, &o, dl.dl(),
                                 nullptr, 0));
    dl.download();
    for (int64_t i = 0; i < N; ++i) {
      double rowmax = 0;
      for (int64_t j = 0; j < V; ++j) rowmax = std::max(rowmax, std::fabs(ref.grad[size_t(i * V + j)]));
      for (int64_t j = 0; j < s.cols; ++j) {
        const double want = j < s.width ? ref.grad[size_t(i * V + s.start + j)] : 0.0;
        ASSERT_TRUE(grad_close(dl.get(i, j), want, rowmax, 1.0, DT::F32)) << "shard " << r << " (" << i << "," << j << ")";
      }
    }
  }
}

// A shard's softmax from the shards' logsumexp at scale 1/T (issue 47 item 4): logits holding +-3e38 over
// shards [0, 3) and [3, 8) at T = 1e-3, 1e-10, 1e-30 gave NaN at the maxima (x / T overflowed, lse = +inf).
// From the combine's pairs: one-hot at the maximum, as the unsharded call; from the [N] lse, no NaN.
// fp16 rows of +-65504 at T = 1e-3 (a row summed to 0.018): rows that sum to 1, the mass split between ties.
TEST(LargeLogits, ShardSoftmaxAtAnyTemperature) {
  struct Row {
    DT dt;
    std::vector<double> x;
  };
  const std::vector<Row> rows = {
      {DT::F32, {3e38, -3e38, 0, 1, 2, -2, 1e30, -1e30}},
      {DT::F16, {65504, -65504, 0, 65504, 2, -2, 1, -1}},
      {DT::BF16, {-3e38, 1, 3.3895313892515355e38, 2, -2, 1e30, -1e30, 3.3895313892515355e38}},
  };
  for (const Row& row : rows)
    for (float T : {1e-3f, 1e-10f, 1e-30f, 1.f, 1e30f}) {
      SCOPED_TRACE(testing::Message() << dt_name(row.dt) << " T " << T);
      const int64_t V = 8;
      Tensor full = matrix(row.dt, {row.x});
      const std::vector<double> xv = values(full);
      const std::vector<Shard> shards = split_vocabulary(V, {3, 5}, 2);
      Handle h;
      const float s = 1.f / T;
      if (!std::isfinite(s)) continue;  // the logsumexp's scale must be finite
      fce_lse_options_t lo = FCE_LSE_OPTIONS_INIT;
      lo.scale = s;
      lo.vocab_total = V;
      Records rec(2, 1, FCE_LSE_RECORD_FIELDS);
      std::vector<Tensor> parts;
      for (int64_t r = 0; r < 2; ++r) {
        const Shard& sh = shards[size_t(r)];
        Tensor part(row.dt, {1, sh.cols});
        for (int64_t j = 0; j < sh.cols; ++j) part.set(0, j, j < sh.width ? full.get(0, sh.start + j) : NAN);
        part.upload();
        Tensor one = poisoned(DT::F32, {1, FCE_LSE_RECORD_FIELDS});
        lo.vocab_start = sh.start;
        FCE_OK(fce_logsumexp_partial(h, test_stream(), part.dl(), &lo, one.dl()));
        one.download();
        std::memcpy(rec.t.raw() + 4 * size_t(r * FCE_LSE_RECORD_FIELDS), one.bytes().data(),
                    4 * size_t(FCE_LSE_RECORD_FIELDS));
        parts.push_back(std::move(part));
      }
      rec.t.upload();
      // float64 reference: the softmax of x / T (the max of the raw logits first).
      const double M = *std::max_element(xv.begin(), xv.end());
      double D = 0;
      for (double v : xv) D += std::exp((v - M) / double(T));
      for (bool pairs : {true, false}) {
        Tensor lse = pairs ? poisoned(DT::F32, {1, 2}) : poisoned(DT::F32, {1});
        FCE_OK(fce_logsumexp_combine(h, test_stream(), &rec.dl, lse.dl()));
        fce_softmax_options_t so = temp(T);
        so.vocab_total = V;
        so.lse = lse.dl();
        double sum = 0;
        for (int64_t r = 0; r < 2; ++r) {
          const Shard& sh = shards[size_t(r)];
          Tensor p = poisoned(DT::F32, {1, sh.cols}), lp = poisoned(DT::F32, {1, sh.cols});
          so.vocab_start = sh.start;
          FCE_OK(fce_temp_softmax(h, test_stream(), parts[size_t(r)].dl(), &so, p.dl(), lp.dl(), nullptr, 0));
          p.download();
          lp.download();
          for (int64_t j = 0; j < sh.width; ++j) {
            ASSERT_FALSE(std::isnan(p.get(0, j))) << (pairs ? "pairs" : "[N] lse") << " column " << sh.start + j;
            ASSERT_FALSE(std::isnan(lp.get(0, j))) << (pairs ? "pairs" : "[N] lse") << " column " << sh.start + j;
            sum += p.get(0, j);
            if (pairs) {
              const double want = std::exp((xv[size_t(sh.start + j)] - M) / double(T)) / D;
              ASSERT_TRUE(close(p.get(0, j), want, 2e-5, 1e-7)) << "column " << sh.start + j;
            }
          }
        }
        if (pairs) {
          EXPECT_TRUE(close(sum, 1.0, 0, 1e-5)) << "the row's probabilities sum to " << sum;
        }
      }
    }
}
