// GPU-only tests: more than 2^31 elements, bitwise repeatability.
#include <cuda_runtime.h>

#include "../common/testing.hpp"

using namespace fct;

// 65536 x 50257 bf16 logits (3.3e9 elements): row i is 0 except a_i = i % 5 at t_i; loss is known exactly.
TEST(GpuLarge, MoreThan2To31Elements) {
  const int64_t N = 65536, V = 50257;
  Handle h;
  Tensor logits(DT::BF16, {N, V});
  ASSERT_EQ(cudaMemset(logits.dl()->data, 0, size_t(N * V) * 2), cudaSuccess);
  Tensor targets(DT::I64, {N});
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = (i * 7919) % V;
    targets.set_int(i, t);
    const uint16_t a = to_bf16(float(i % 5));
    ASSERT_EQ(cudaMemcpy(static_cast<char*>(logits.dl()->data) + size_t(i * V + t) * 2, &a, 2, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  targets.upload();
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = FCE_REDUCTION_NONE;
  Tensor loss(DT::F32, {N}), lse(DT::F32, {N});
  loss.poison(); loss.upload();
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.lse = lse.dl();
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0));
  loss.download();
  for (int64_t i = 0; i < N; ++i) {
    const double a = i % 5;
    const double want = std::log(double(V - 1) + std::exp(a)) - a;
    ASSERT_TRUE(close(loss.get(i), want, 1e-5, 1e-5)) << "row " << i;
  }
  // logsumexp of the same rows
  Tensor l2(DT::F32, {N});
  FCE_OK(fce_logsumexp(h, test_stream(), logits.dl(), nullptr, l2.dl(), nullptr, 0));
  l2.download();
  for (int64_t i = 0; i < N; i += 97) ASSERT_TRUE(close(l2.get(i), std::log(double(V - 1) + std::exp(double(i % 5))), 1e-5, 1e-5));
}

namespace {
std::vector<uint8_t> run_ce_once(int64_t N, int64_t V, Tensor& logits, Tensor& targets) {
  Handle h;
  Tensor loss(DT::F32, {}), lse(DT::F32, {N}), dl(DT::BF16, {N, V});
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.label_smoothing = 0.1f;
  o.z_loss_scale = 1e-4f;
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl(); out.lse = lse.dl(); out.dlogits = dl.dl();
  EXPECT_EQ(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0), FCE_STATUS_SUCCESS);
  Tensor lse2(DT::F32, {N});
  EXPECT_EQ(fce_logsumexp(h, test_stream(), logits.dl(), nullptr, lse2.dl(), nullptr, 0), FCE_STATUS_SUCCESS);
  loss.download(); lse.download(); dl.download(); lse2.download();
  std::vector<uint8_t> all = loss.bytes();
  for (Tensor* t : {&lse, &dl, &lse2}) all.insert(all.end(), t->bytes().begin(), t->bytes().end());
  return all;
}
}  // namespace

TEST(GpuDeterminism, BitwiseRepeatable) {
  for (int64_t N : {1, 16, 300}) {
    const int64_t V = 151936;
    Tensor logits(DT::BF16, {N, V});
    fill_logits(logits, 3.0, true);
    Tensor targets(DT::I32, {N});
    for (int64_t i = 0; i < N; ++i) targets.set_int(i, (i * 31) % V);
    targets.upload();
    const auto a = run_ce_once(N, V, logits, targets), b = run_ce_once(N, V, logits, targets);
    ASSERT_TRUE(a == b) << "N=" << N << ": two runs differ";
  }
}
