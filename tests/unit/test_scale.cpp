// fce_scale_rows against a float64 reference: x[i, :] * f_i formed in fp32 and rounded once to x's dtype;
// rows whose factor is 1 bitwise untouched (their padding too), every dtype, padded rows, scalar and
// per-row factors with 0, negative, NaN and inf among them; bad input writes nothing.
#include "../common/calls.hpp"

using namespace fct;

namespace {
// v rounded once to dt, on the host (a Tensor would allocate device memory in the GPU suite: per element,
// that made the GPU test take two minutes).
double round_to(DT dt, double v) {
  const float f = float(v);
  return dt == DT::BF16 ? from_bf16(to_bf16(f)) : dt == DT::F16 ? from_f16(to_f16(f)) : f;
}
}  // namespace

TEST(ScaleRows, ScalarAndPerRowFactors) {
  Handle h;
  for (DT dt : {DT::F32, DT::BF16, DT::F16}) {
    for (auto [N, V] : {std::pair<int64_t, int64_t>{1, 7}, {37, 1031}, {300, 4099}}) {
      for (int mode = 0; mode < 4; ++mode) {  // scalar 1, scalar 0.5, per-row mixed, [1]-shaped 2
        SCOPED_TRACE(::testing::Message() << dt_name(dt) << " " << N << "x" << V << " mode " << mode);
        Tensor x(dt, {N, V}, V + 3);
        x.poison();  // padding keeps the poison: it must come back untouched
        fill_logits(x, 2.0, false);
        const std::vector<uint8_t> before = x.bytes();
        std::vector<double> f(static_cast<size_t>(N));
        Tensor factor = mode == 2 ? Tensor(DT::F32, {N}) : mode == 3 ? Tensor(DT::F32, {1}) : Tensor(DT::F32, {});
        const double special[] = {1.0, 0.0, -3.0, NAN, INFINITY, 1.0, 0.25};
        for (int64_t i = 0; i < N; ++i) {
          f[size_t(i)] = mode == 0 ? 1.0 : mode == 1 ? 0.5 : mode == 3 ? 2.0 : special[i % 7];
          if (mode == 2) factor.set(i, f[size_t(i)]);
        }
        if (mode != 2) factor.set(0, f[0]);
        factor.upload();
        FCE_OK(fce_scale_rows(h, test_stream(), x.dl(), factor.dl()));
        const std::vector<double> orig = [&] {
          Tensor o(dt, {N, V}, V + 3);
          std::vector<double> v;
          std::memcpy(const_cast<uint8_t*>(o.bytes().data()), before.data(), before.size());
          for (int64_t i = 0; i < N; ++i)
            for (int64_t j = 0; j < V; ++j) v.push_back(o.get(i, j));
          return v;
        }();
        x.download();
        for (int64_t i = 0; i < N; ++i) {
          for (int64_t j = 0; j < V; ++j) {
            const double want = round_to(dt, double(float(orig[size_t(i * V + j)]) * float(f[size_t(i)])));
            const double got = x.get(i, j);
            ASSERT_TRUE((std::isnan(want) && std::isnan(got)) || got == want)
                << "(" << i << ", " << j << "): got " << got << " want " << want;
          }
          // padding untouched; a factor-1 row bitwise untouched
          const size_t es = dt_size(dt), row0 = size_t(i * (V + 3)) * es;
          const size_t end = f[size_t(i)] == 1.0 ? row0 + size_t(V + 3) * es : row0 + size_t(V) * es;
          for (size_t b = f[size_t(i)] == 1.0 ? row0 : row0 + size_t(V) * es; b < end && b < before.size(); ++b)
            ASSERT_EQ(x.bytes()[b], before[b]) << "row " << i << " byte " << b - row0;
        }
      }
    }
  }
}

TEST(ScaleRows, BadInputWritesNothing) {
  Tensor x = matrix(DT::F32, {{1, 2, 3}, {4, 5, 6}});
  Tensor f3 = floats({2, 2, 2}), f2 = floats({2, 2});
  Tensor fi = ints(DT::I32, {2, 2});
  Handle h;
  EXPECT_EQ(fce_scale_rows(h, test_stream(), x.dl(), f3.dl()), FCE_STATUS_SHAPE_MISMATCH);
  EXPECT_EQ(fce_scale_rows(h, test_stream(), x.dl(), fi.dl()), FCE_STATUS_UNSUPPORTED_DTYPE);
  EXPECT_EQ(fce_scale_rows(h, test_stream(), x.dl(), nullptr), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(fce_scale_rows(h, test_stream(), nullptr, f2.dl()), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(fce_scale_rows(nullptr, test_stream(), x.dl(), f2.dl()), FCE_STATUS_INVALID_ARGUMENT);
  // the factor inside x: aliasing
  DLTensor inside = *x.dl();
  int64_t shape1[1] = {2};
  inside.ndim = 1;
  inside.shape = shape1;
  inside.strides = nullptr;
  EXPECT_EQ(fce_scale_rows(h, test_stream(), x.dl(), &inside), FCE_STATUS_ALIASING);
  x.download();
  EXPECT_EQ(x.get(0, 0), 1.0);
  EXPECT_EQ(x.get(1, 2), 6.0);
}
