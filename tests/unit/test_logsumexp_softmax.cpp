// Logsumexp and temperature softmax against float64 references written here.
#include <algorithm>

#include "../common/testing.hpp"

using namespace fct;

namespace {

double ref_lse(const std::vector<double>& x, int64_t i, int64_t V, double s) {
  double m = -INFINITY;
  for (int64_t j = 0; j < V; ++j) m = std::max(m, s * x[size_t(i * V + j)]);
  if (m == -INFINITY) return -INFINITY;
  double acc = 0;
  for (int64_t j = 0; j < V; ++j) acc += std::exp(s * x[size_t(i * V + j)] - m);
  return m + std::log(acc);
}

void check_lse(int64_t N, int64_t V, DT dt, double scale, int64_t pad, bool peaked) {
  SCOPED_TRACE(::testing::Message() << "N=" << N << " V=" << V << " " << dt_name(dt) << " scale=" << scale);
  Handle h;
  Tensor x(dt, {N, V}, V + pad);
  fill_logits(x, 3.0, peaked);
  Tensor lse(DT::F32, {N});
  lse.poison();
  lse.upload();
  fce_lse_options_t o = FCE_LSE_OPTIONS_INIT;
  o.scale = float(scale);
  FCE_OK(fce_logsumexp(h, test_stream(), x.dl(), &o, lse.dl(), nullptr, 0));
  lse.download();
  const std::vector<double> v = values(x);
  for (int64_t i = 0; i < N; ++i) ASSERT_TRUE(close(lse.get(i), ref_lse(v, i, V, scale), 2e-6, 2e-5)) << "row " << i;
}

}  // namespace

TEST(Logsumexp, ShapesAndDtypes) {
  for (int64_t V : {1, 2, 7, 50021, 129920})
    for (int64_t N : {1, 3, 257})
      for (DT dt : {DT::F32, DT::BF16, DT::F16}) {
        if (V >= 50021 && N == 257 && dt != DT::BF16) continue;
        check_lse(N, V, dt, 1.0, N == 3 ? 4 : 0, V % 2 == 0);
      }
  check_lse(5, 1000, DT::F32, 0.25, 0, true);
  check_lse(5, 1000, DT::BF16, 3.0, 1, false);
}

// Few rows whose rows start 16-byte aligned but end inside a 16-byte vector (the GPU's register-resident
// path reads that last vector element by element), at decode shapes.
TEST(Logsumexp, FewAlignedRowsWithPartialLastVector) {
  check_lse(1, 151939, DT::BF16, 1.0, 5, false);
  check_lse(16, 151939, DT::F32, 0.5, 5, true);
  check_lse(7, 128253, DT::F16, 1.0, 3, false);
  check_lse(1, 128256, DT::BF16, 1.0, 0, true);
  check_lse(64, 1001, DT::BF16, 2.0, 7, false);
  check_lse(24, 151939, DT::BF16, 1.0, 5, false);  // 17..64 rows: register plans of fewer blocks per row
  check_lse(40, 129920, DT::F32, 0.7, 0, true);
}

// Special values in long rows: a slice whose max is -inf or +inf, a NaN alone in a slice of -inf. 7 rows
// take the GPU's register-resident path (few rows, 16-byte aligned, several blocks per row), 70 rows the
// split path as one cluster launch (4 blocks per row); rows from 6 on are plain.
TEST(Logsumexp, FewAlignedRowsSpecialValues) {
  for (DT dt : {DT::BF16, DT::F32})
    for (int64_t N : {7, 70}) {
      SCOPED_TRACE(std::string(dt_name(dt)) + " rows " + std::to_string(N));
      Handle h;
      const int64_t V = 40000;
      Tensor x(dt, {N, V});
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < V; ++j) x.set(i, j, i >= 6 ? 0.001 * double((j + 37 * i) % 1000) : -INFINITY);
      for (int64_t j = 0; j < V; j += 3) { x.set(1, j, 0.5); x.set(2, j, 0.25); x.set(3, j, -1.0); }
      x.set(1, 777, INFINITY);           // +inf: +inf
      x.set(2, 39000, NAN);              // NaN in the last slice of a finite row: NaN
      x.set(3, 5, INFINITY);             // +inf and NaN: NaN
      x.set(3, 39999, NAN);
      x.set(4, V - 1, NAN);              // NaN among -inf: NaN
      x.set(5, V - 2, 2.5);              // one finite value in the last slice: that value
      x.upload();
      Tensor lse(DT::F32, {N});
      lse.poison();
      lse.upload();
      FCE_OK(fce_logsumexp(h, test_stream(), x.dl(), nullptr, lse.dl(), nullptr, 0));
      lse.download();
      EXPECT_EQ(lse.get(0), -INFINITY);
      EXPECT_EQ(lse.get(1), INFINITY);
      EXPECT_TRUE(std::isnan(lse.get(2)));
      EXPECT_TRUE(std::isnan(lse.get(3)));
      EXPECT_TRUE(std::isnan(lse.get(4)));
      EXPECT_TRUE(close(lse.get(5), 2.5, 1e-6, 1e-6));
      const std::vector<double> v = values(x);
      for (int64_t i = 6; i < N; ++i) EXPECT_TRUE(close(lse.get(i), ref_lse(v, i, V, 1.0), 2e-6, 2e-5)) << "row " << i;
    }
}

TEST(Logsumexp, InfinitiesAndNaN) {
  Handle h;
  Tensor x(DT::F32, {3, 5});
  for (int64_t j = 0; j < 5; ++j) { x.set(0, j, -INFINITY); x.set(1, j, j == 2 ? -INFINITY : 1.0); x.set(2, j, j == 4 ? NAN : 0.0); }
  x.upload();
  Tensor lse(DT::F32, {3});
  FCE_OK(fce_logsumexp(h, test_stream(), x.dl(), nullptr, lse.dl(), nullptr, 0));
  lse.download();
  EXPECT_EQ(lse.get(0), -INFINITY);
  EXPECT_TRUE(close(lse.get(1), 1.0 + std::log(4.0), 1e-6, 1e-6));
  EXPECT_TRUE(std::isnan(lse.get(2)));
}

namespace {

struct SmCase {
  int64_t N, V;
  DT dt;
  bool fp32_out;
  std::vector<double> temps;  // one entry = scalar, N entries = per row
  bool logprobs = true;
  bool inplace = false;
  double std = 3.0;
  bool peaked = false;
  int64_t pad = 0;  // row stride V + pad
};

void check_softmax(const SmCase& c) {
  SCOPED_TRACE(::testing::Message() << "N=" << c.N << " V=" << c.V << " " << dt_name(c.dt) << " fp32out=" << c.fp32_out
                                    << " T0=" << c.temps[0] << " inplace=" << c.inplace);
  Handle h;
  const int64_t N = c.N, V = c.V;
  Tensor x(c.dt, {N, V}, V + c.pad);
  fill_logits(x, c.std, c.peaked);
  const std::vector<double> v = values(x);
  const DT odt = c.fp32_out ? DT::F32 : c.dt;
  Tensor probs(odt, {N, V}), logp(odt, {N, V});
  probs.poison(); probs.upload(); logp.poison(); logp.upload();
  fce_softmax_options_t o = FCE_SOFTMAX_OPTIONS_INIT;
  Tensor temps;
  if (c.temps.size() == 1) {
    o.temperature = float(c.temps[0]);
  } else {
    temps = Tensor(DT::F32, {N});
    for (int64_t i = 0; i < N; ++i) temps.set(i, c.temps[size_t(i)]);
    temps.upload();
    o.temperatures = temps.dl();
  }
  Tensor& pout = c.inplace ? x : probs;
  FCE_OK(fce_temp_softmax(h, test_stream(), x.dl(), &o, pout.dl(), c.logprobs ? logp.dl() : nullptr, nullptr, 0));
  pout.download();
  logp.download();
  const double rtol = c.fp32_out ? 2e-5 : dtype_rtol(c.dt);
  for (int64_t i = 0; i < N; ++i) {
    const double T = c.temps.size() == 1 ? c.temps[0] : c.temps[size_t(i)];
    double m = -INFINITY;
    int64_t am = 0;
    for (int64_t j = 0; j < V; ++j) if (v[size_t(i * V + j)] > m) { m = v[size_t(i * V + j)]; am = j; }
    double s = 0, psum = 0;
    for (int64_t j = 0; j < V; ++j) s += T > 0 ? std::exp((v[size_t(i * V + j)] - m) / T) : 0.0;
    for (int64_t j = 0; j < V; ++j) {
      const double got = pout.get(i, j);
      psum += got;
      if (T < 0 || std::isnan(T)) { ASSERT_TRUE(std::isnan(got)) << "bad temperature row " << i; continue; }
      ASSERT_FALSE(std::isnan(got)) << "NaN at (" << i << "," << j << ")";
      double want, wantlog;
      if (T == 0) { want = j == am ? 1 : 0; wantlog = j == am ? 0 : -INFINITY; }
      else { wantlog = (v[size_t(i * V + j)] - m) / T - std::log(s); want = std::exp(wantlog); }
      ASSERT_TRUE(close(got, want, rtol, 1e-7)) << "p(" << i << "," << j << ")";
      if (odt == DT::F16) wantlog = from_f16(to_f16(float(wantlog)));  // may round to -inf
      if (c.logprobs) {
        ASSERT_TRUE(close(logp.get(i, j), wantlog, rtol, rtol * (1 + std::fabs(std::log(s))) + 1e-6))
            << "logp(" << i << "," << j << ")";
      }
    }
    if (T >= 0 && c.fp32_out) {
      ASSERT_TRUE(close(psum, 1.0, 0, 1e-5)) << "row sum " << i;
    }
  }
}

}  // namespace

TEST(TempSoftmax, ScalarTemperatures) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16})
    for (double T : {1.0, 0.5, 4.0, 0.0})
      for (bool f32 : {true, false}) check_softmax({3, 50021, dt, f32, {T}});
  check_softmax({1, 129920, DT::BF16, true, {0.7}, true, false, 3.0, true});
  check_softmax({257, 7, DT::F16, true, {1.0}});
  check_softmax({2, 1, DT::F32, true, {1.0}});
}

// Decode shapes: rows aligned to 16 bytes whose last vector is partial, per-row temperatures with greedy and
// bad rows, fp32 and input-dtype outputs, in place.
TEST(TempSoftmax, FewAlignedRowsWithPartialLastVector) {
  std::vector<double> t16;
  for (int i = 0; i < 16; ++i) t16.push_back(i == 3 ? 0.0 : i == 9 ? -1.0 : 0.5 + 0.25 * i);
  SmCase a{16, 151939, DT::BF16, true, t16};
  a.pad = 5;
  check_softmax(a);
  SmCase b{1, 128253, DT::F16, false, {0.7}};
  b.pad = 3;
  check_softmax(b);
  SmCase c{3, 4093, DT::F32, true, {1.3}, true, true};
  c.pad = 3;
  check_softmax(c);
  SmCase d{2, 129920, DT::BF16, false, {0.0}, false, true};
  check_softmax(d);
  SmCase e{4, 151939, DT::BF16, true, {0.0, 0.7, -1.0, 2.0}};
  e.pad = 5;
  check_softmax(e);
}

// The decode shapes above with probabilities only: the GPU's lean register-resident kernel (a call that
// wants log-probabilities takes the general path), greedy and bad rows falling back inside it, in place.
TEST(TempSoftmax, FewRowsProbabilitiesOnly) {
  std::vector<double> t16;
  for (int i = 0; i < 16; ++i) t16.push_back(i == 3 ? 0.0 : i == 9 ? -1.0 : 0.5 + 0.25 * i);
  SmCase a{16, 151939, DT::BF16, true, t16, false};
  a.pad = 5;
  check_softmax(a);
  SmCase b{1, 128253, DT::F16, false, {0.7}, false};
  b.pad = 3;
  check_softmax(b);
  SmCase c{3, 4093, DT::F32, true, {1.3}, false, true};
  c.pad = 3;
  check_softmax(c);
  SmCase e{4, 151939, DT::BF16, true, {0.0, 0.7, -1.0, 2.0}, false};
  e.pad = 5;
  check_softmax(e);
  SmCase f{64, 32768, DT::BF16, false, {0.9}, false};
  f.peaked = true;
  check_softmax(f);
  // One or two long rows: on the GPU, copies of each row's cluster share the stores (replicate_rows); a
  // greedy row among them falls back in one copy only; fp32 and 16-bit outputs.
  SmCase g{1, 151939, DT::BF16, true, {0.8}, false};
  g.pad = 5;
  check_softmax(g);
  check_softmax({2, 129920, DT::F16, true, {0.0, 1.1}, false});
  check_softmax({1, 256000, DT::BF16, false, {1.3}, false});
  check_softmax({5, 129920, DT::F16, true, {1e-5}, false, false, 10.0});
  // 13 to 16 long rows: on an H100, clusters of 8 blocks of the kernel with registers for two blocks per SM
  // (spread_regs); greedy and bad rows fall back inside it; 16-bit outputs.
  std::vector<double> t15;
  for (int i = 0; i < 15; ++i) t15.push_back(i == 14 ? 0.0 : i == 2 ? NAN : 0.6 + 0.1 * i);
  SmCase k{15, 151939, DT::F16, false, t15, false};
  k.pad = 5;
  check_softmax(k);
  check_softmax({13, 151936, DT::BF16, false, {1.7}, false});
  // On an H100 the register path's clusters of 5 at this width hold 22 rows at once; 23 rows take the
  // shared-memory kernel.
  for (int64_t n : {22, 23}) {
    SmCase h{n, 151939, DT::BF16, true, {0.9}, false};
    h.pad = 5;
    check_softmax(h);
  }
}

// Special values with probabilities only (the GPU's lean kernels): a NaN anywhere or no finite logit gives a
// NaN row; -inf logits get 0; a single finite logit gets probability 1, two equal ones 1/2 each; other rows
// sum to 1. Row 0: a NaN in the last slice; 1: all -inf; 2 and 3: finite logits among -inf; then plain rows.
namespace {

void check_probs_only_special_values(int64_t N, int64_t V) {
  SCOPED_TRACE(::testing::Message() << "N=" << N << " V=" << V);
  Handle h;
  Tensor x(DT::BF16, {N, V});
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) x.set(i, j, i >= 1 && i <= 3 ? -INFINITY : 0.01 * double((i + j) % 100));
  x.set(0, V - 999, NAN);
  x.set(2, 12345, 4.0);
  x.set(3, 10, 1.0);
  x.set(3, V - 10, 1.0);
  x.upload();
  Tensor p(DT::F32, {N, V});
  p.poison();
  p.upload();
  fce_softmax_options_t o = FCE_SOFTMAX_OPTIONS_INIT;
  o.temperature = 0.8f;
  FCE_OK(fce_temp_softmax(h, test_stream(), x.dl(), &o, p.dl(), nullptr, nullptr, 0));
  p.download();
  double sum = 0;
  for (int64_t j = 0; j < V; ++j) {
    ASSERT_TRUE(std::isnan(p.get(0, j))) << j;
    ASSERT_TRUE(std::isnan(p.get(1, j))) << j;
    ASSERT_EQ(p.get(2, j), j == 12345 ? 1.0 : 0.0) << j;
    ASSERT_EQ(p.get(3, j), j == 10 || j == V - 10 ? 0.5 : 0.0) << j;
    sum += p.get(N - 1, j);
  }
  EXPECT_TRUE(close(sum, 1.0, 0, 1e-5));
}

}  // namespace

TEST(TempSoftmax, FewRowsProbabilitiesOnlySpecialValues) {
  check_probs_only_special_values(5, 40000);
  check_probs_only_special_values(16, 151936);  // on an H100, clusters of 8 with two blocks' registers per SM
}

// Many rows with probabilities only: the GPU's lean shared-memory kernel (greedy and bad rows falling back
// inside it), fp32 and input-dtype outputs; special values on rows past the register path's 64.
TEST(TempSoftmax, ManyRowsProbabilitiesOnly) {
  std::vector<double> t140;
  for (int i = 0; i < 140; ++i) t140.push_back(i % 17 == 3 ? 0.0 : i % 23 == 9 ? -1.0 : 0.4 + 0.05 * (i % 13));
  SmCase a{140, 40003, DT::BF16, true, t140, false};
  a.pad = 5;
  a.peaked = true;
  check_softmax(a);
  SmCase c{134, 33000, DT::F16, false, {1.7}, false};
  check_softmax(c);
  check_probs_only_special_values(70, 20000);  // rows past the register path's 64
}

// Rows enough for the GPU's persistent pipelined kernel (>= 132 rows longer than 64 KiB, 16-byte aligned):
// per-row temperatures with greedy and bad rows, both outputs, fp32 and input-dtype outputs, in place.
TEST(TempSoftmax, ManyLongAlignedRows) {
  std::vector<double> t140;
  for (int i = 0; i < 140; ++i) t140.push_back(i % 17 == 3 ? 0.0 : i % 23 == 9 ? -1.0 : 0.4 + 0.05 * (i % 13));
  SmCase a{140, 40003, DT::BF16, true, t140};
  a.pad = 5;
  a.peaked = true;
  check_softmax(a);
  SmCase b{133, 16389, DT::F32, true, {0.9}, false, true};
  b.pad = 3;
  check_softmax(b);
  SmCase c{134, 33000, DT::F16, false, {1.7}};
  check_softmax(c);
}

TEST(TempSoftmax, TinyTemperatureFp16NeverNaN) {
  check_softmax({4, 1000, DT::F16, true, {1e-5}, true, false, 10.0});
  check_softmax({4, 1000, DT::F16, false, {1e-5}, true, false, 10.0});
}

TEST(TempSoftmax, PerRowTemperaturesMixedGreedy) {
  check_softmax({6, 333, DT::BF16, true, {0.0, 1.0, 0.5, 0.0, 2.0, -1.0}});
  check_softmax({4, 333, DT::F32, true, {NAN, 1.0, 0.0, 3.0}});
}

TEST(TempSoftmax, InPlace) {
  check_softmax({5, 1001, DT::F32, true, {0.8}, false, true});
  check_softmax({5, 1001, DT::BF16, false, {0.8}, false, true});
}

TEST(TempSoftmax, GreedyTieIsFirstMaximumAndInfTemperatureUniform) {
  Handle h;
  Tensor x(DT::F32, {2, 6});
  const double row0[6] = {1, 3, 2, 3, -INFINITY, 0};
  for (int64_t j = 0; j < 6; ++j) { x.set(0, j, row0[j]); x.set(1, j, row0[j]); }
  x.upload();
  Tensor p(DT::F32, {2, 6}), temps(DT::F32, {2});
  temps.set(0, 0.0); temps.set(1, INFINITY); temps.upload();
  fce_softmax_options_t o = FCE_SOFTMAX_OPTIONS_INIT;
  o.temperatures = temps.dl();
  FCE_OK(fce_temp_softmax(h, test_stream(), x.dl(), &o, p.dl(), nullptr, nullptr, 0));
  p.download();
  for (int64_t j = 0; j < 6; ++j) {
    EXPECT_EQ(p.get(0, j), j == 1 ? 1.0 : 0.0);
    EXPECT_TRUE(close(p.get(1, j), j == 4 ? 0.0 : 0.2, 1e-6, 1e-7));
  }
}
