// The contract on adversarial input: numerics edge cases the header and docs/numerics.md promise (huge
// logits at huge temperatures, subnormal soft-caps, the KD temperature domain, reverse KL against a teacher
// with zero-probability classes, KD invariance to a common logit offset, results independent of BLAS
// threads), and the ABI rules of the header's conventions (growing structs, workspace alignment, device
// types, the init functions, build info). Every expected value is float64 arithmetic written here.
#include <cstddef>
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cfloat>
#include <cstdio>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>

#include "../common/calls.hpp"
#include "../common/ce_reference.hpp"

using namespace fct;

namespace {

// |got - want| <= atol + rtol |want| for every element of a matrix against a row-major reference.
::testing::AssertionResult all_close(const Tensor& got, const std::vector<double>& want, double rtol, double atol) {
  for (int64_t i = 0; i < got.rows(); ++i)
    for (int64_t j = 0; j < got.cols(); ++j) {
      const auto r = close(got.get(i, j), want[size_t(i * got.cols() + j)], rtol, atol);
      if (!r) return ::testing::AssertionFailure() << "(" << i << ", " << j << "): " << r.message();
    }
  return ::testing::AssertionSuccess();
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

}  // namespace

// ------------------------------------------------------------------------------------------------------
// 1. Temperature softmax: finite logits of any magnitude at T = +inf and at huge finite T. (x - max)/T is
// formed without overflowing fp32: the uniform distribution over finite logits at T = +inf, no lost mass
// at T = 1e38, no NaN anywhere. Shapes reach the GPU's few-row register kernel, its general kernels
// (log-probabilities asked for) and the many-row kernels.

namespace {
// float64: max of the finite logits first, then (x - max)/T (0 at T = +inf); -inf logits get 0.
void softmax_ref(const Tensor& x, int64_t i, double T, std::vector<double>* p, std::vector<double>* lp) {
  const int64_t V = x.cols();
  double m = -INFINITY;
  for (int64_t j = 0; j < V; ++j) m = std::max(m, x.get(i, j));
  std::vector<double> d(static_cast<size_t>(V));
  double s = 0;
  for (int64_t j = 0; j < V; ++j) {
    const double v = x.get(i, j);
    d[size_t(j)] = v == -INFINITY ? -INFINITY : std::isinf(T) ? 0.0 : (v - m) / T;
    s += std::exp(d[size_t(j)]);
  }
  for (int64_t j = 0; j < V; ++j) {
    (*p)[size_t(i * V + j)] = std::exp(d[size_t(j)]) / s;
    (*lp)[size_t(i * V + j)] = d[size_t(j)] - std::log(s);
  }
}
}  // namespace

TEST(Contract, SoftmaxHugeLogitsAtInfiniteAndHugeTemperatures) {
  const std::vector<double> temps = {INFINITY, 3.0e38, 1.0e38, 1.0e37, 1.0e30, 2.0};
  for (DT dt : {DT::F32, DT::BF16}) {
    for (auto [N, V] : {std::pair<int64_t, int64_t>{3, 1031}, {16, 16384}, {130, 4099}}) {
      SCOPED_TRACE(::testing::Message() << dt_name(dt) << " " << N << "x" << V);
      Tensor x(dt, {N, V});
      fill_logits(x, 2.0, false);
      for (int64_t i = 0; i < N; ++i) {  // +-3e38 and a -inf mask in every row, at columns that move
        x.set(i, (3 * i) % V, 3.0e38);
        x.set(i, (3 * i + 1) % V, -3.0e38);
        x.set(i, (3 * i + 2) % V, -INFINITY);
      }
      x.upload();
      // One scalar temperature per call, then per-row temperatures cycling through the same values.
      for (size_t k = 0; k <= temps.size(); ++k) {
        const bool per_row = k == temps.size();
        auto T_of = [&](int64_t i) { return per_row ? temps[size_t(i) % temps.size()] : temps[k]; };
        SCOPED_TRACE(::testing::Message() << (per_row ? "per-row temperatures" : "T = ") << (per_row ? 0 : temps[k]));
        std::vector<double> rp(static_cast<size_t>(N * V)), rlp(static_cast<size_t>(N * V));
        for (int64_t i = 0; i < N; ++i) softmax_ref(x, i, double(float(T_of(i))), &rp, &rlp);
        Tensor tv(DT::F32, {N});
        for (int64_t i = 0; i < N; ++i) tv.set(i, T_of(i));
        tv.upload();
        fce_softmax_options_t o = FCE_SOFTMAX_OPTIONS_INIT;
        if (per_row) {
          o.temperatures = tv.dl();
        } else {
          o.temperature = float(temps[k]);
        }
        Handle h;
        for (bool with_logprobs : {true, false}) {  // probabilities only take the GPU's lean kernels
          Tensor p = poisoned(DT::F32, {N, V}), lp = poisoned(DT::F32, {N, V});
          FCE_OK(fce_temp_softmax(h, test_stream(), x.dl(), &o, p.dl(), with_logprobs ? lp.dl() : nullptr, nullptr, 0));
          p.download();
          lp.download();
          EXPECT_TRUE(all_close(p, rp, 2e-5, 1e-7)) << "probs, logprobs asked: " << with_logprobs;
          for (int64_t i = 0; i < N; ++i) {
            double sum = 0;
            for (int64_t j = 0; j < V; ++j) sum += p.get(i, j);
            ASSERT_TRUE(close(sum, 1.0, 0, 1e-5)) << "row " << i;
          }
          if (with_logprobs) {
            EXPECT_TRUE(all_close(lp, rlp, 2e-5, 1e-6 + 2e-5 * std::log(double(V))));
          }
        }
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// 2. Cross-entropy with a soft-cap c inside its domain but subnormal (1/c overflows fp32): z = c tanh(s x/c)
// is +-c (or 0 at x = 0), every statistic finite, and the gradient s sech^2(s x/c) is 0 except at x = 0.

TEST(Contract, CrossEntropySubnormalSoftcap) {
  for (float cap : {1e-40f, 1.4e-45f, 2e-38f}) {
    for (DT dt : {DT::F32, DT::BF16}) {
      for (auto [N, V] : {std::pair<int64_t, int64_t>{5, 1031}, {300, 4099}}) {
        CeCase c{N, V};
        c.dt = dt;
        c.reduction = FCE_REDUCTION_NONE;
        c.cap = double(cap);
        c.scale = 0.5;
        c.zq = 1e-4;
        SCOPED_TRACE(::testing::Message() << "cap " << cap << " " << dt_name(dt) << " " << N << "x" << V);
        Tensor x(dt, {N, V}), t(DT::I64, {N});
        fill_logits(x, 2.0, false);
        std::vector<int64_t> tg(static_cast<size_t>(N));
        for (int64_t i = 0; i < N; ++i) {
          x.set(i, (7 * i) % V, 0.0);  // exact zeros: tanh(0/c) must be 0, not NaN
          tg[size_t(i)] = i % 4 == 3 ? -100 : i % 4 == 1 ? (7 * i) % V : (13 * i + 5) % V;
          t.set_int(i, tg[size_t(i)]);
        }
        x.upload();
        t.upload();
        const Ref ref = reference(c, values(x), tg, {}, {});
        fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
        o.reduction = FCE_REDUCTION_NONE;
        o.softcap = cap;
        o.logit_scale = 0.5f;
        o.z_loss_scale = 1e-4f;
        Ce r = ce_fwd(x, t, o);
        ASSERT_EQ(r.status, FCE_STATUS_SUCCESS) << fce_last_error_message();
        Tensor bw = poisoned(dt, {N, V});
        Handle h;
        FCE_OK(fce_cross_entropy_bwd(h, test_stream(), x.dl(), t.dl(), r.lse.dl(), nullptr, &o, bw.dl(), nullptr, 0));
        bw.download();
        for (int64_t i = 0; i < N; ++i) {
          const double lse = ref.lse[size_t(i)];
          ASSERT_TRUE(close(r.lse.get(i), lse, 2e-5, 1e-5)) << "lse row " << i;
          ASSERT_TRUE(close(r.loss.get(i), ref.loss[size_t(i)], 2e-5, 2e-5 * (1 + std::fabs(lse)))) << "loss row " << i;
          ASSERT_TRUE(close(r.ent.get(i), ref.ent[size_t(i)], 1e-4, 1e-4 * (1 + std::fabs(lse)))) << "entropy row " << i;
        }
        const double gtol = 1e-6 * max_abs(ref.grad) + 1e-9;
        EXPECT_TRUE(all_close(r.dl, ref.grad, dtype_rtol(dt) + 1e-4, gtol)) << "fused dlogits";
        EXPECT_TRUE(all_close(bw, ref.grad, dtype_rtol(dt) + 1e-4, gtol)) << "dlogits from the backward";
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// KD references in float64: log-softmax over z = x/T, the divergence per row, and dL/dx in closed form
// (forward KL (q - p)/T, reverse KL q (log q - log p - KL)/T; JSD q_j (g_j - sum_k q_k g_k)/T with
// g_j = dL/dq_j = (1 - b) log(q_j/m_j)).

namespace {
std::vector<double> log_softmax_row(const Tensor& x, int64_t i, double T) {
  const int64_t V = x.cols();
  double m = -INFINITY;
  for (int64_t j = 0; j < V; ++j) m = std::max(m, x.get(i, j));
  std::vector<double> u(static_cast<size_t>(V));
  double s = 0;
  for (int64_t j = 0; j < V; ++j) {
    u[size_t(j)] = (x.get(i, j) - m) / T;
    s += std::exp(u[size_t(j)]);
  }
  for (double& v : u) v -= std::log(s);
  return u;
}

struct KdRef {
  std::vector<double> loss, grad;  // loss [N] (before T^2), dL/dx [N, V] for grad_loss 1 (before T^2)
};

KdRef kd_reference(const Tensor& s, const Tensor& t, int div, double beta, double T) {
  const int64_t N = s.rows(), V = s.cols();
  KdRef r{std::vector<double>(static_cast<size_t>(N)), std::vector<double>(static_cast<size_t>(N * V))};
  for (int64_t i = 0; i < N; ++i) {
    const std::vector<double> lq = log_softmax_row(s, i, T), lp = log_softmax_row(t, i, T);
    std::vector<double> g(static_cast<size_t>(V));
    double L = 0, qg = 0;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(lp[size_t(j)]), q = std::exp(lq[size_t(j)]);
      if (div == FCE_KD_FORWARD_KL) {
        if (p > 0) L += p * (lp[size_t(j)] - lq[size_t(j)]);
      } else if (div == FCE_KD_REVERSE_KL) {
        if (q > 0) L += q * (lq[size_t(j)] - lp[size_t(j)]);
      } else {
        const double a = std::log(beta) + lp[size_t(j)], b = std::log1p(-beta) + lq[size_t(j)];
        const double lm = std::max(a, b) + std::log1p(std::exp(-std::fabs(a - b)));  // log m, m = b p + (1-b) q
        if (p > 0) L += beta * p * (lp[size_t(j)] - lm);
        if (q > 0) L += (1 - beta) * q * (lq[size_t(j)] - lm);
        g[size_t(j)] = q > 0 ? (1 - beta) * (lq[size_t(j)] - lm) : 0;
        qg += q * g[size_t(j)];
      }
    }
    r.loss[size_t(i)] = L;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(lp[size_t(j)]), q = std::exp(lq[size_t(j)]);
      double d = 0;
      if (div == FCE_KD_FORWARD_KL) d = q - p;
      else if (q > 0) d = div == FCE_KD_REVERSE_KL ? q * (lq[size_t(j)] - lp[size_t(j)] - L) : q * (g[size_t(j)] - qg);
      r.grad[size_t(i * V + j)] = d / T;
    }
  }
  return r;
}

struct KdRun {
  Tensor loss, ds;
};
KdRun run_kd(Tensor& s, Tensor& t, const fce_kd_options_t& o, bool with_grad) {
  KdRun r{poisoned(DT::F32, {s.rows()}), poisoned(s.dtype(), {s.rows(), s.cols()})};
  fce_kd_teacher_t teacher = full(t);
  fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
  out.loss = r.loss.dl();
  out.dstudent = with_grad ? r.ds.dl() : nullptr;
  Handle h;
  const fce_status_t st = fce_kd_loss(h, test_stream(), s.dl(), &teacher, nullptr, &o, &out, nullptr, 0);
  EXPECT_EQ(st, FCE_STATUS_SUCCESS) << fce_last_error_message();
  r.loss.download();
  r.ds.download();
  return r;
}

// Checks loss and (when asked) dstudent of a full-teacher KD call against kd_reference, with the bounds of
// docs/numerics.md section 1: absolute bounds on the divergence and on dL/dz, z = x/T (T^2 scaling
// multiplies the loss, its gradient and their absolute bounds; dL/dx = dL/dz / T).
void check_kd(Tensor& s, Tensor& t, int div, double beta, float T, bool t2, bool with_grad) {
  fce_kd_options_t o = kd_opts(div);
  o.beta = float(beta);
  o.temperature = T;
  o.scale_by_t2 = t2;
  const KdRun got = run_kd(s, t, o, with_grad);
  const KdRef ref = kd_reference(s, t, div, beta, double(T));
  const double f = t2 ? double(T) * double(T) : 1.0;
  for (int64_t i = 0; i < s.rows(); ++i)
    ASSERT_TRUE(close(got.loss.get(i), ref.loss[size_t(i)] * f, 1e-4, 2e-6 * f)) << "loss row " << i;
  if (!with_grad) return;
  std::vector<double> g = ref.grad;
  for (double& v : g) v *= f;
  // atol 1e-5 on dL/dz (z = x/T; dL/dx carries 1/T, and T^2 with scale_by_t2), plus the rounding of
  // forming a_j - q_j A in fp32 when the row's divergence is large (a_j and q_j A are then ~KL apart from
  // their difference: reverse KL at small T).
  const double rtol = dtype_rtol(s.dtype()) + 2e-4;
  for (int64_t i = 0; i < s.rows(); ++i) {
    const double atol = 1e-5 * std::max({1.0, max_abs(g), f / double(T)}) * (1.0 + 0.1 * std::fabs(ref.loss[size_t(i)]));
    for (int64_t j = 0; j < s.cols(); ++j)
      ASSERT_TRUE(close(got.ds.get(i, j), g[size_t(i * s.cols() + j)], rtol, atol)) << "dstudent (" << i << ", " << j << ")";
  }
}
}  // namespace

// ------------------------------------------------------------------------------------------------------
// 3. The KD temperature domain: [FCE_KD_TEMPERATURE_MIN, FCE_KD_TEMPERATURE_MAX]. Inside it every divergence
// meets the documented bounds at both ends (T^2 included); outside it the call is INVALID_ARGUMENT and
// writes nothing.

TEST(Contract, KdTemperatureDomainEdges) {
  const int64_t N = 6, V = 257;
  Tensor s(DT::F32, {N, V}), t(DT::F32, {N, V});
  fill_logits(s, 2.0, false);
  fill_logits(t, 2.0, true, 4.0);
  for (float T : {FCE_KD_TEMPERATURE_MIN, 1e-2f, 0.5f, 8.0f, FCE_KD_TEMPERATURE_MAX}) {
    for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
      for (bool t2 : {false, true}) {
        SCOPED_TRACE(::testing::Message() << "T=" << T << " div=" << div << " t2=" << t2);
        check_kd(s, t, div, 0.5, T, t2, true);
      }
    }
  }
  const float out_of_domain[] = {std::nextafter(FCE_KD_TEMPERATURE_MIN, 0.f),
                                 std::nextafter(FCE_KD_TEMPERATURE_MAX, INFINITY), 1e-40f, 1e20f, 1e19f};
  for (float T : out_of_domain) {
    fce_kd_options_t o = kd_opts(FCE_KD_FORWARD_KL);
    o.temperature = T;
    o.scale_by_t2 = 1;
    Tensor loss = poisoned(DT::F32, {N});
    fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
    out.loss = loss.dl();
    fce_kd_teacher_t teacher = full(t);
    Handle h;
    EXPECT_EQ(fce_kd_loss(h, test_stream(), s.dl(), &teacher, nullptr, &o, &out, nullptr, 0),
              FCE_STATUS_INVALID_ARGUMENT) << "T=" << T;
    const std::string msg = fce_last_error_message();
    EXPECT_NE(msg.find("temperature"), std::string::npos) << msg;
    loss.download();
    for (int64_t i = 0; i < N; ++i) EXPECT_TRUE(std::isnan(loss.get(i))) << "output written, T=" << T;
  }
}

// ------------------------------------------------------------------------------------------------------
// 4. Reverse KL (and JSD at b = 1) where the teacher has probability 0 (a -inf logit) and the student does
// not: the loss is +inf and dstudent is the limit of the gradient as those teacher logits go to -inf:
// +inf at such columns, -inf at the other columns the student puts mass on, 0 where the student's own
// probability is 0; times the sign of the upstream gradient (0 gives 0). Never NaN.

TEST(Contract, KdReverseKlGradientWhereTheTeacherHasZeroProbability) {
  for (auto [N, V] : {std::pair<int64_t, int64_t>{3, 1031}, {200, 4100}}) {  // 200 x 4100 fp32: the GPU's pipeline
    for (int div : {FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
      SCOPED_TRACE(::testing::Message() << N << "x" << V << " div=" << div);
      Tensor s(DT::F32, {N, V}), t(DT::F32, {N, V});
      fill_logits(s, 2.0, false);
      fill_logits(t, 2.0, true, 4.0);
      auto dead = [&](int64_t i, int64_t j) { return j == (5 * i) % V || j == (5 * i + 1) % V; };  // teacher -inf
      auto masked = [&](int64_t i, int64_t j) { return j == (5 * i + 2) % V || j == (5 * i + 1) % V; };  // student -inf
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < V; ++j) {
          if (dead(i, j)) t.set(i, j, -INFINITY);
          if (masked(i, j)) s.set(i, j, -INFINITY);
        }
      s.upload();
      t.upload();
      Tensor g(DT::F32, {N});  // upstream gradient per row: 1, -2, 0, ...
      for (int64_t i = 0; i < N; ++i) g.set(i, i % 3 == 0 ? 1.0 : i % 3 == 1 ? -2.0 : 0.0);
      g.upload();
      fce_kd_options_t o = kd_opts(div);
      o.beta = 1.f;
      o.temperature = 1.5f;
      fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
      Tensor loss = poisoned(DT::F32, {N}), ds = poisoned(DT::F32, {N, V});
      out.loss = loss.dl();
      out.dstudent = ds.dl();
      out.grad_loss = g.dl();
      fce_kd_teacher_t teacher = full(t);
      Handle h;
      FCE_OK(fce_kd_loss(h, test_stream(), s.dl(), &teacher, nullptr, &o, &out, nullptr, 0));
      loss.download();
      ds.download();
      for (int64_t i = 0; i < N; ++i) {
        ASSERT_EQ(loss.get(i), INFINITY) << "row " << i;
        const double gi = g.get(i);
        for (int64_t j = 0; j < V; ++j) {
          const double want = masked(i, j) || gi == 0 ? 0.0 : dead(i, j) ? INFINITY * gi : -INFINITY * gi;
          ASSERT_EQ(ds.get(i, j), want) << "row " << i << " col " << j;
        }
      }
    }
  }
}

// The same for a top-K teacher whose log-probabilities hold -inf at a listed id (probability 0 there).
TEST(Contract, KdTopKReverseKlGradientWhereTheTeacherHasZeroProbability) {
  const int64_t N = 4, V = 67, K = 5;
  Tensor s(DT::F32, {N, V}), ids(DT::I64, {N, K}), lp(DT::F32, {N, K});
  fill_logits(s, 1.0, false);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t k = 0; k < K; ++k) {
      ids.set_int(i * K + k, (11 * i + 3 * k) % V);
      lp.set(i, k, k == 2 ? -INFINITY : -0.5 * double(k + 1));
    }
  ids.upload();
  lp.upload();
  for (int norm : {FCE_KD_TOPK_FULL_VOCAB, FCE_KD_TOPK_RENORMALIZE}) {
    fce_kd_options_t o = kd_opts(FCE_KD_REVERSE_KL);
    o.topk_norm = norm;
    Kd r = kd(s, topk(ids, lp), o);
    ASSERT_EQ(r.status, FCE_STATUS_SUCCESS) << fce_last_error_message();
    for (int64_t i = 0; i < N; ++i) {
      ASSERT_EQ(r.loss.get(i), INFINITY) << "row " << i;
      for (int64_t j = 0; j < V; ++j) {
        int64_t slot = -1;
        for (int64_t k = 0; k < K; ++k)
          if (ids.get_int(i * K + k) == j) slot = k;
        const double want = slot == 2 ? INFINITY : (slot >= 0 || norm == FCE_KD_TOPK_FULL_VOCAB) ? -INFINITY : 0.0;
        ASSERT_EQ(r.ds.get(i, j), want) << "norm " << norm << " row " << i << " col " << j;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// 5. KD is invariant to a common offset of the logits: log-ratios are formed from max-shifted values, so
// the error does not grow with the offset (fp32 logits, offsets up to 1e4; many rows reach the GPU's
// one-pass and pipelined kernels, few rows its general kernels).

TEST(Contract, KdInvariantToACommonLogitOffset) {
  for (auto [N, V] : {std::pair<int64_t, int64_t>{5, 1031}, {many_rows(300), 4100}}) {
    Tensor s0(DT::F32, {N, V}), t0(DT::F32, {N, V});
    fill_logits(s0, 2.0, false);
    fill_logits(t0, 2.0, true, 3.0);
    for (double off : {0.0, 50.0, 500.0, 1e4}) {
      Tensor s(DT::F32, {N, V}), t(DT::F32, {N, V});
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < V; ++j) {
          s.set(i, j, s0.get(i, j) + off);
          t.set(i, j, t0.get(i, j) + off);
        }
      s.upload();
      t.upload();
      for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD})
        for (bool grad : {false, true}) {
          SCOPED_TRACE(::testing::Message() << N << "x" << V << " offset " << off << " div " << div << " grad " << grad);
          check_kd(s, t, div, 0.5, 1.0f, false, grad);
          check_kd(s, t, div, 0.5, 2.0f, true, grad);
        }
      // Top-K teacher, full-vocabulary student: the student's offset.
      const int64_t K = 8;
      Tensor ids(DT::I64, {N, K}), lp(DT::F32, {N, K});
      for (int64_t i = 0; i < N; ++i)
        for (int64_t k = 0; k < K; ++k) {
          ids.set_int(i * K + k, (17 * i + 5 * k) % V);
          lp.set(i, k, -0.25 * double(k + 1));
        }
      ids.upload();
      lp.upload();
      Kd r = kd(s, topk(ids, lp), kd_opts(FCE_KD_FORWARD_KL));
      ASSERT_EQ(r.status, FCE_STATUS_SUCCESS);
      for (int64_t i = 0; i < N; ++i) {
        const std::vector<double> lq = log_softmax_row(s, i, 1.0);
        std::vector<double> zt(static_cast<size_t>(K));
        for (int64_t k = 0; k < K; ++k) zt[size_t(k)] = lp.get(i, k);
        const double lse_t = lse_of(zt);
        double L = 0;
        for (int64_t k = 0; k < K; ++k) {
          const double lpk = zt[size_t(k)] - lse_t;
          L += std::exp(lpk) * (lpk - lq[size_t(ids.get_int(i * K + k))]);
        }
        ASSERT_TRUE(close(r.loss.get(i), L, 1e-4, 2e-6)) << "top-K, offset " << off << ", row " << i;
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// 6. On a CPU handle, results do not depend on the number of threads: OpenMP's, set by the host
// (omp_set_num_threads) or by OMP_NUM_THREADS, nor the BLAS's (OPENBLAS_NUM_THREADS, BLIS_NUM_THREADS and
// BLIS's per-loop variables, which a BLAS reads when it is loaded: those runs are child processes, this
// executable again with the environment changed). Nor does another BLAS loaded ahead of the library
// (LD_PRELOAD) change them: none of its symbols can be bound in place of the library's GEMMs. Issue 47's
// case, linear CE at N=33 V=20011 H=96 with a bias, fp32 and bf16: the forward with every gradient, the
// backward from its lse, and two vocabulary shards (the partial records, then each shard's backward from
// the combined lse). Every output is compared bit for bit with the first run's.

namespace {

// One output's bytes and the size of its elements.
struct Blob {
  std::string name;
  size_t elem = 4;
  std::vector<uint8_t> bytes;
};

// Reproducible inputs (rng() is seeded at random, and the child processes must see the same values).
void fill_seeded(Tensor& t, std::mt19937_64& g, double scale) {
  std::normal_distribution<double> nd(0.0, scale);
  for (int64_t r = 0; r < t.rows(); ++r)
    for (int64_t c = 0; c < t.cols(); ++c) t.set(r, c, nd(g));
  t.upload();
}

void lce_thread_outputs(std::vector<Blob>* out) {
  const int64_t N = 33, H = 96, V = 20011, K = FCE_CE_RECORD_FIELDS_ALL;
  for (DT dt : {DT::F32, DT::BF16}) {
    const std::string d = dt_name(dt);
    auto keep = [&](const std::string& what, Tensor& t) {
      t.download();
      const size_t e = dt_size(t.dtype());  // the elements, not the host copy's padding
      out->push_back({d + " " + what, e, std::vector<uint8_t>(t.bytes().begin(), t.bytes().begin() + t.size() * e)});
    };
    std::mt19937_64 g(47);
    Tensor hid(dt, {N, H}), w(dt, {V, H}), b(dt, {V}), tg(DT::I64, {N});
    fill_seeded(hid, g, 1.0);
    fill_seeded(w, g, 0.5);
    fill_seeded(b, g, 1.0);
    for (int64_t i = 0; i < N; ++i) tg.set_int(i, i % 11 == 3 ? -100 : int64_t(g() % uint64_t(V)));
    tg.upload();
    Handle h;

    // The forward with every gradient.
    Tensor loss = poisoned(DT::F32, {}), lse = poisoned(DT::F32, {N}), dh = poisoned(dt, {N, H}),
           dw = poisoned(dt, {V, H}), db = poisoned(dt, {V});
    fce_linear_ce_outputs_t o = FCE_LINEAR_CE_OUTPUTS_INIT;
    o.loss = loss.dl();
    o.lse = lse.dl();
    o.dhidden = dh.dl();
    o.dweight = dw.dl();
    o.dbias = db.dl();
    FCE_OK(fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), w.dl(), b.dl(), tg.dl(), nullptr, &o, nullptr, 0));
    keep("forward loss", loss);
    keep("forward lse", lse);
    keep("forward dhidden", dh);
    keep("forward dweight", dw);
    keep("forward dbias", db);

    // The backward from that lse (dhidden in fp32, as a shard's).
    Tensor bdh = poisoned(DT::F32, {N, H}), bdw = poisoned(dt, {V, H}), bdb = poisoned(dt, {V});
    fce_linear_ce_outputs_t bo = FCE_LINEAR_CE_OUTPUTS_INIT;
    bo.dhidden = bdh.dl();
    bo.dweight = bdw.dl();
    bo.dbias = bdb.dl();
    FCE_OK(fce_linear_cross_entropy_bwd(h, test_stream(), hid.dl(), w.dl(), b.dl(), tg.dl(), lse.dl(), nullptr, &bo,
                                        nullptr, 0));
    keep("backward dhidden", bdh);
    keep("backward dweight", bdw);
    keep("backward dbias", bdb);

    // Two vocabulary shards, the last padded (NaN rows, never read).
    const std::vector<Shard> shards = split_vocabulary(V, {7001, 0}, 3);
    const int64_t W = int64_t(shards.size());
    fce_ce_options_t so = FCE_CE_OPTIONS_INIT;
    so.vocab_total = V;
    std::vector<Tensor> ws, bs;
    Records rec(W, N, K);
    for (int64_t r = 0; r < W; ++r) {
      const Shard& s = shards[size_t(r)];
      Tensor wr(dt, {s.cols, H}), br(dt, {s.cols});
      for (int64_t v = 0; v < s.cols; ++v) {
        br.set(v, v < s.width ? b.get(s.start + v) : NAN);
        for (int64_t j = 0; j < H; ++j) wr.set(v, j, v < s.width ? w.get(s.start + v, j) : NAN);
      }
      wr.upload();
      br.upload();
      Tensor one = poisoned(DT::F32, {N, K});
      so.vocab_start = s.start;
      FCE_OK(fce_linear_cross_entropy_partial(h, test_stream(), hid.dl(), wr.dl(), br.dl(), tg.dl(), &so, one.dl(),
                                              nullptr, 0));
      keep("shard " + std::to_string(r) + " records", one);
      std::memcpy(rec.t.raw() + 4 * size_t(r * N * K), one.bytes().data(), 4 * size_t(N * K));
      ws.push_back(std::move(wr));
      bs.push_back(std::move(br));
    }
    rec.t.upload();
    Tensor closs = poisoned(DT::F32, {}), clse = poisoned(DT::F32, {N});
    fce_ce_outputs_t co = FCE_CE_OUTPUTS_INIT;
    co.loss = closs.dl();
    co.lse = clse.dl();
    FCE_OK(fce_cross_entropy_combine(h, test_stream(), &rec.dl, tg.dl(), &so, &co, nullptr, 0));
    keep("combined lse", clse);
    for (int64_t r = 0; r < W; ++r) {
      const Shard& s = shards[size_t(r)];
      Tensor sdh = poisoned(DT::F32, {N, H}), sdw = poisoned(dt, {s.cols, H}), sdb = poisoned(dt, {s.cols});
      fce_linear_ce_outputs_t sb = FCE_LINEAR_CE_OUTPUTS_INIT;
      sb.dhidden = sdh.dl();
      sb.dweight = sdw.dl();
      sb.dbias = sdb.dl();
      so.vocab_start = s.start;
      FCE_OK(fce_linear_cross_entropy_bwd(h, test_stream(), hid.dl(), ws[size_t(r)].dl(), bs[size_t(r)].dl(), tg.dl(),
                                          clse.dl(), &so, &sb, nullptr, 0));
      const std::string sr = "shard " + std::to_string(r) + " backward ";
      keep(sr + "dhidden", sdh);
      keep(sr + "dweight", sdw);
      keep(sr + "dbias", sdb);
    }
  }
}

constexpr const char* kChildOut = "FCE_TEST_LCE_THREADS_OUT";  // set: this process is a child run

void write_blobs(const std::vector<Blob>& blobs, const char* path) {
  FILE* f = std::fopen(path, "wb");
  ASSERT_NE(f, nullptr) << path;
  for (const Blob& b : blobs) {
    const uint64_t head[3] = {b.name.size(), b.elem, b.bytes.size()};
    std::fwrite(head, sizeof head, 1, f);
    std::fwrite(b.name.data(), 1, b.name.size(), f);
    std::fwrite(b.bytes.data(), 1, b.bytes.size(), f);
  }
  ASSERT_EQ(std::fclose(f), 0) << path;
}

std::vector<Blob> read_blobs(const std::string& path) {
  std::vector<Blob> blobs;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return blobs;
  uint64_t head[3];
  while (std::fread(head, sizeof head, 1, f) == 1) {
    Blob b;
    b.name.resize(size_t(head[0]));
    b.elem = size_t(head[1]);
    b.bytes.resize(size_t(head[2]));
    if (std::fread(&b.name[0], 1, b.name.size(), f) != b.name.size() ||
        std::fread(b.bytes.data(), 1, b.bytes.size(), f) != b.bytes.size())
      break;
    blobs.push_back(std::move(b));
  }
  std::fclose(f);
  return blobs;
}

// Each output of `now` against `ref`: the number of elements whose bytes differ, 0 expected.
void expect_same(const std::vector<Blob>& ref, const std::vector<Blob>& now, const std::string& run) {
  ASSERT_EQ(now.size(), ref.size()) << run << ": outputs missing";
  for (size_t k = 0; k < ref.size(); ++k) {
    ASSERT_EQ(now[k].name, ref[k].name);
    ASSERT_EQ(now[k].bytes.size(), ref[k].bytes.size()) << ref[k].name;
    size_t differ = 0;
    const size_t n = ref[k].bytes.size() / ref[k].elem;
    for (size_t i = 0; i < n; ++i)
      differ += std::memcmp(&now[k].bytes[i * ref[k].elem], &ref[k].bytes[i * ref[k].elem], ref[k].elem) != 0;
    EXPECT_EQ(differ, 0u) << ref[k].name << ": " << differ << " of " << n << " elements differ at " << run;
  }
}

// This executable run again with only the child test and `env` over this process's environment; its outputs.
std::vector<Blob> child_run(const std::vector<std::pair<std::string, std::string>>& env, const std::string& out) {
  std::vector<std::string> vars;
  for (char** e = environ; *e; ++e) {
    const std::string v = *e;
    bool replaced = v.rfind(std::string(kChildOut) + "=", 0) == 0;
    for (const auto& [k, x] : env) replaced = replaced || v.rfind(k + "=", 0) == 0;
    if (!replaced) vars.push_back(v);
  }
  for (const auto& [k, x] : env) vars.push_back(k + "=" + x);
  vars.push_back(std::string(kChildOut) + "=" + out);
  std::vector<char*> envp;
  for (std::string& v : vars) envp.push_back(&v[0]);
  envp.push_back(nullptr);
  // This executable's path (a tool such as valgrind answers with its client's, where exec of /proc/self/exe
  // would start the tool).
  char self[4096] = {};
  const ssize_t len = readlink("/proc/self/exe", self, sizeof self - 1);
  EXPECT_GT(len, 0) << "readlink /proc/self/exe";
  std::string exe = len > 0 ? std::string(self, size_t(len)) : "/proc/self/exe",
              filter = "--gtest_filter=Contract.DISABLED_LinearCrossEntropyThreadCountsChild",
              disabled = "--gtest_also_run_disabled_tests";
  char* argv[] = {&exe[0], &filter[0], &disabled[0], nullptr};
  std::remove(out.c_str());
  const pid_t pid = fork();
  if (pid == 0) {
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) { dup2(null, 1); dup2(null, 2); }
    execve(argv[0], argv, envp.data());
    _exit(127);
  }
  int status = 0;
  EXPECT_GT(pid, 0) << "fork";
  if (pid > 0) waitpid(pid, &status, 0);
  EXPECT_TRUE(pid > 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child run failed (status " << status << ")";
  std::vector<Blob> blobs = read_blobs(out);
  std::remove(out.c_str());
  return blobs;
}

// Under AddressSanitizer its runtime must be the first library loaded: "PATH:" of it, to go first in an
// LD_PRELOAD; empty otherwise.
std::string asan_runtime() {
  Dl_info info{};
  void* init = dlsym(RTLD_DEFAULT, "__asan_init");
  if (!init || !dladdr(init, &info) || !info.dli_fname) return "";
  const std::string path = info.dli_fname;
  return path.find("asan") != std::string::npos ? path + ":" : "";
}

}  // namespace

// The child run (started by the test below, with the environment it names): writes every output.
TEST(Contract, DISABLED_LinearCrossEntropyThreadCountsChild) {
  const char* out = std::getenv(kChildOut);
  if (!out) GTEST_SKIP() << "a child of Contract.LinearCrossEntropyIndependentOfThreadCounts";
  std::vector<Blob> blobs;
  lce_thread_outputs(&blobs);
  if (!HasFatalFailure()) write_blobs(blobs, out);
}

TEST(Contract, LinearCrossEntropyIndependentOfThreadCounts) {
  if (target().cuda()) GTEST_SKIP() << "thread counts are a CPU-handle matter";
  using set_fn = void (*)(int);
  using get_fn = int (*)();
  const auto omp_set = reinterpret_cast<set_fn>(dlsym(RTLD_DEFAULT, "omp_set_num_threads"));
  const auto omp_get = reinterpret_cast<get_fn>(dlsym(RTLD_DEFAULT, "omp_get_max_threads"));
  ASSERT_TRUE(omp_set && omp_get) << "libfusedce's OpenMP runtime not found";
  // An OpenBLAS in the process (the library's, when it binds one): the host may set its thread count too.
  const auto blas_set = reinterpret_cast<set_fn>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
  const auto blas_get = reinterpret_cast<get_fn>(dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  const int omp0 = omp_get(), blas0 = blas_get ? blas_get() : 0;

  // In this process: the host's omp_set_num_threads (and OpenBLAS's setter, where there is one).
  std::vector<Blob> ref;
  for (auto [omp, blas] : {std::pair<int, int>{1, 1}, {2, 2}, {3, 1}, {1, 2}, {2, 4}}) {
    omp_set(omp);
    if (blas_set) blas_set(blas);
    std::vector<Blob> now;
    lce_thread_outputs(&now);
    ASSERT_FALSE(HasFatalFailure());
    if (ref.empty()) ref = std::move(now);
    else expect_same(ref, now, "omp_set_num_threads(" + std::to_string(omp) + ")" +
                                   (blas_set ? ", openblas_set_num_threads(" + std::to_string(blas) + ")" : ""));
  }
  omp_set(omp0);
  if (blas_set) blas_set(blas0);

  // Child processes: the thread counts of the environment, read when OpenMP and the BLAS load.
  using Env = std::vector<std::pair<std::string, std::string>>;
  auto threads = [](const char* omp, const char* blas) {
    return Env{{"OMP_NUM_THREADS", omp}, {"OPENBLAS_NUM_THREADS", blas}, {"GOTO_NUM_THREADS", blas},
               {"BLIS_NUM_THREADS", blas}};
  };
  const std::vector<Env> counts = {threads("1", "1"), threads("1", "2"), threads("2", "1"), threads("2", "2"),
                                   threads("3", "4")};
  auto joined = [](const Env& e) {
    std::string run;
    for (const auto& [k, v] : e) run += (run.empty() ? "" : " ") + k + "=" + v;
    return run;
  };
  const std::string out = ::testing::TempDir() + "fce_lce_threads_" + std::to_string(getpid()) + ".bin";
  // This machine's kernels: every run as the in-process ones. With BLIS's per-loop thread variables too,
  // and with another BLAS loaded ahead of the library (LD_PRELOAD, as by a host that loaded it first), any
  // of Debian's builds that is installed: none of its symbols may be bound in place of the library's GEMMs.
  std::vector<Env> runs = counts;
  runs.push_back(Env{{"OMP_NUM_THREADS", "2"}, {"BLIS_JC_NT", "2"}, {"BLIS_IC_NT", "2"}, {"BLIS_JR_NT", "2"}});
  for (const char* lib : {"/usr/lib/x86_64-linux-gnu/blis-openmp/libblis.so.4",
                          "/usr/lib/x86_64-linux-gnu/blis-pthread/libblis.so.4",
                          "/usr/lib/x86_64-linux-gnu/openblas-serial/libopenblas.so.0",
                          "/usr/lib/x86_64-linux-gnu/openblas-openmp/libopenblas.so.0",
                          "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"})
    if (access(lib, R_OK) == 0) {
      Env e = threads("2", "2");
      e.push_back({"LD_PRELOAD", asan_runtime() + lib});
      runs.push_back(e);
    }
  for (const Env& e : runs) expect_same(ref, child_run(e, out), joined(e));
#if defined(__x86_64__)
  // The AVX2 kernels that the BLAS takes on an AVX2 machine (AMD Zen, where issue 47 was found: OpenBLAS's
  // Haswell kernels, not invariant to its thread count, unlike the AVX-512 ones), forced on this one: the
  // same thread counts, against the first of them (other kernels give other bits). BLIS_ARCH_TYPE=3 is
  // BLIS_ARCH_HASWELL of BLIS 0.9's arch_t (blis.h).
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    std::vector<Blob> avx2;
    for (Env e : counts) {
      e.push_back({"OPENBLAS_CORETYPE", "Haswell"});
      e.push_back({"BLIS_ARCH_TYPE", "3"});
      std::vector<Blob> now = child_run(e, out);
      if (avx2.empty()) avx2 = std::move(now);
      else expect_same(avx2, now, joined(e));
    }
    EXPECT_FALSE(avx2.empty());
  }
#endif
}


// ------------------------------------------------------------------------------------------------------
// 7. Growing structs: a struct_size larger than this library's struct is accepted when every byte past it
// is zero (results equal to the plain call) and refused, naming the struct and the library's version, when
// one is not; also above FCE_MAX_STRUCT_SIZE and below the library's size. Refused calls write nothing.

namespace {
// `call(p)` runs one op with the struct at p in place of `base`, every output poisoned first, and returns
// its status and the bytes of its outputs.
// first_size: the struct's first published size (sizeof for a struct that has not grown), the smallest
// struct_size taken; below it is refused.
template <class T, class Call>
void check_struct_growth(const char* type_name, const T& base, Call call, size_t first_size = sizeof(T)) {
  SCOPED_TRACE(type_name);
  constexpr size_t kExtra = 40;
  alignas(16) unsigned char buf[sizeof(T) + kExtra];
  auto reset = [&](uint32_t size) {
    std::memset(buf, 0, sizeof(buf));
    std::memcpy(buf, &base, sizeof(T));
    reinterpret_cast<T*>(buf)->struct_size = size;
  };
  const T* p = reinterpret_cast<const T*>(buf);
  reset(sizeof(T));
  const auto plain = call(p);
  ASSERT_EQ(plain.first, FCE_STATUS_SUCCESS) << fce_last_error_message();
  reset(sizeof(T) + kExtra);  // a newer header's struct, the newer fields at their (zero) defaults
  const auto grown = call(p);
  ASSERT_EQ(grown.first, FCE_STATUS_SUCCESS) << fce_last_error_message();
  EXPECT_TRUE(grown.second == plain.second) << "a zero tail changed the results";
  auto refused = [&](const char* what) {
    SCOPED_TRACE(what);
    std::string msg;
    const auto r = call(p, &msg);
    EXPECT_EQ(r.first, FCE_STATUS_INVALID_ARGUMENT);
    EXPECT_NE(msg.find(type_name), std::string::npos) << msg;
    return r;
  };
  for (size_t at : {sizeof(T), sizeof(T) + 7, sizeof(T) + kExtra - 1}) {
    reset(sizeof(T) + kExtra);
    buf[at] = 1;
    std::string msg;
    const auto r = call(p, &msg);
    EXPECT_EQ(r.first, FCE_STATUS_INVALID_ARGUMENT) << "non-zero byte " << at;
    EXPECT_NE(msg.find(type_name), std::string::npos) << msg;
    EXPECT_NE(msg.find(fce_version_string()), std::string::npos) << msg;
    EXPECT_TRUE(r.second == call.poisoned()) << "outputs written by a refused call";
  }
  reset(FCE_MAX_STRUCT_SIZE + 1);
  EXPECT_TRUE(refused("above FCE_MAX_STRUCT_SIZE").second == call.poisoned());
  reset(uint32_t(first_size - 4));
  EXPECT_TRUE(refused("below the struct's first published size").second == call.poisoned());
  if (first_size < sizeof(T)) {  // an older header's struct: the fields it lacks get their defaults
    reset(uint32_t(first_size));
    const auto old = call(p);
    ASSERT_EQ(old.first, FCE_STATUS_SUCCESS) << fce_last_error_message();
    EXPECT_TRUE(old.second == plain.second) << "an older header's struct changed the results";
    reset(uint32_t(first_size + 4));  // no header had this size: it would cut the next field in half
    EXPECT_TRUE(refused("between the published sizes").second == call.poisoned());
  }
}

// One op's call for check_struct_growth: `run(options or outputs pointer)` makes the call; the outputs are
// the tensors in `outs`, poisoned before every call and downloaded after it.
template <class T, class Run>
struct GrowthCall {
  std::vector<Tensor*> outs;
  Run run;
  std::vector<uint8_t> poisoned() const {
    std::vector<uint8_t> r;
    for (Tensor* t : outs) {
      Tensor c(t->dtype(), {t->rows(), t->cols()});
      c.poison();
      r.insert(r.end(), c.bytes().begin(), c.bytes().end());
    }
    return r;
  }
  std::pair<fce_status_t, std::vector<uint8_t>> operator()(const T* p, std::string* msg = nullptr) {
    for (Tensor* t : outs) {
      t->poison();
      t->upload();
    }
    Handle h;
    const fce_status_t st = run(h, p);
    if (msg) *msg = fce_last_error_message();
    std::vector<uint8_t> bytes;
    for (Tensor* t : outs) {
      t->download();
      bytes.insert(bytes.end(), t->bytes().begin(), t->bytes().end());
    }
    return {st, bytes};
  }
};
template <class T, class Run>
GrowthCall<T, Run> growth_call(std::vector<Tensor*> outs, Run run) {
  return GrowthCall<T, Run>{std::move(outs), std::move(run)};
}
}  // namespace

TEST(Contract, GrowingStructsZeroTailAcceptedNonZeroTailRefused) {
  const int64_t N = 7, V = 301, H = 16, K = 4;
  Tensor x(DT::BF16, {N, V}), t2(DT::F32, {N, V}), tg(DT::I64, {N}), hid(DT::F32, {N, H}), w(DT::F32, {V, H});
  Tensor ids(DT::I32, {N, K}), lp(DT::F32, {N, K}), temps(DT::F32, {N}), cw(DT::F32, {V});
  fill_logits(x, 2.0, false);
  fill_logits(t2, 2.0, false);
  fill_logits(hid, 1.0, false);
  fill_logits(w, 0.3, false);
  for (int64_t i = 0; i < N; ++i) {
    tg.set_int(i, (i * 13) % V);
    temps.set(i, 0.5 + 0.25 * double(i));
    for (int64_t k = 0; k < K; ++k) {
      ids.set_int(i * K + k, (i * 17 + k * 31) % V);
      lp.set(i, k, -0.5 * double(k + 1));
    }
  }
  for (int64_t j = 0; j < V; ++j) cw.set(j, 1.0 + double(j % 3));
  for (Tensor* u : {&tg, &ids, &lp, &temps, &cw}) u->upload();
  Tensor loss(DT::F32, {N}), lse(DT::F32, {N}), dl(DT::BF16, {N, V}), probs(DT::F32, {N, V}), dh(DT::F32, {N, H});

  fce_ce_options_t co = FCE_CE_OPTIONS_INIT;
  co.reduction = FCE_REDUCTION_NONE;
  co.label_smoothing = 0.1f;
  co.class_weights = cw.dl();
  fce_ce_outputs_t cout_ = FCE_CE_OUTPUTS_INIT;
  cout_.loss = loss.dl();
  cout_.lse = lse.dl();
  cout_.dlogits = dl.dl();
  // Grown in 0.2.0 by vocab_start and vocab_total: 0.1.0's struct, which ends before them, is still taken.
  check_struct_growth("fce_ce_options_t", co, growth_call<fce_ce_options_t>({&loss, &lse, &dl}, [&](fce_handle_t h, const fce_ce_options_t* p) {
    return fce_cross_entropy_fwd(h, test_stream(), x.dl(), tg.dl(), p, &cout_, nullptr, 0);
  }), offsetof(fce_ce_options_t, vocab_start));
  // Grown in 0.2.0 by grad_entropy.
  check_struct_growth("fce_ce_outputs_t", cout_, growth_call<fce_ce_outputs_t>({&loss, &lse, &dl}, [&](fce_handle_t h, const fce_ce_outputs_t* p) {
    return fce_cross_entropy_fwd(h, test_stream(), x.dl(), tg.dl(), &co, p, nullptr, 0);
  }), offsetof(fce_ce_outputs_t, grad_entropy));
  fce_ce_bwd_inputs_t bin = FCE_CE_BWD_INPUTS_INIT;
  bin.lse = lse.dl();
  check_struct_growth("fce_ce_bwd_inputs_t", bin, growth_call<fce_ce_bwd_inputs_t>({&dl}, [&](fce_handle_t h, const fce_ce_bwd_inputs_t* p) {
    return fce_cross_entropy_bwd_ex(h, test_stream(), x.dl(), tg.dl(), p, &co, dl.dl(), nullptr, 0);
  }));
  fce_lse_options_t lo = FCE_LSE_OPTIONS_INIT;
  lo.scale = 0.5f;
  // Grown in 0.2.0 by vocab_start and vocab_total (fce_logsumexp_partial): 0.1.0's struct is still taken.
  check_struct_growth("fce_lse_options_t", lo, growth_call<fce_lse_options_t>({&lse}, [&](fce_handle_t h, const fce_lse_options_t* p) {
    return fce_logsumexp(h, test_stream(), x.dl(), p, lse.dl(), nullptr, 0);
  }), offsetof(fce_lse_options_t, vocab_start));
  fce_softmax_options_t so = FCE_SOFTMAX_OPTIONS_INIT;
  so.temperatures = temps.dl();
  // Grown in 0.2.0 by vocab_start, vocab_total and lse (a shard's softmax): 0.1.0's struct is still taken.
  check_struct_growth("fce_softmax_options_t", so, growth_call<fce_softmax_options_t>({&probs}, [&](fce_handle_t h, const fce_softmax_options_t* p) {
    return fce_temp_softmax(h, test_stream(), x.dl(), p, probs.dl(), nullptr, nullptr, 0);
  }), offsetof(fce_softmax_options_t, vocab_start));
  fce_kd_options_t ko = FCE_KD_OPTIONS_INIT;
  ko.divergence = FCE_KD_JSD;
  ko.reduction = FCE_REDUCTION_NONE;
  ko.temperature = 2.f;
  fce_kd_teacher_t kt = FCE_KD_TEACHER_INIT;
  kt.logits = t2.dl();
  fce_kd_teacher_t kk = FCE_KD_TEACHER_INIT;
  kk.topk_ids = ids.dl();
  kk.topk_logprobs = lp.dl();
  fce_kd_outputs_t kout = FCE_KD_OUTPUTS_INIT;
  kout.loss = loss.dl();
  kout.dstudent = dl.dl();
  // Grown in 0.2.0 by vocab_start and vocab_total (vocabulary-parallel KD): 0.1.0's struct is still taken.
  check_struct_growth("fce_kd_options_t", ko, growth_call<fce_kd_options_t>({&loss, &dl}, [&](fce_handle_t h, const fce_kd_options_t* p) {
    return fce_kd_loss(h, test_stream(), x.dl(), &kt, nullptr, p, &kout, nullptr, 0);
  }), offsetof(fce_kd_options_t, vocab_start));
  check_struct_growth("fce_kd_teacher_t", kk, growth_call<fce_kd_teacher_t>({&loss, &dl}, [&](fce_handle_t h, const fce_kd_teacher_t* p) {
    return fce_kd_loss(h, test_stream(), x.dl(), p, nullptr, &ko, &kout, nullptr, 0);
  }));
  check_struct_growth("fce_kd_outputs_t", kout, growth_call<fce_kd_outputs_t>({&loss, &dl}, [&](fce_handle_t h, const fce_kd_outputs_t* p) {
    return fce_kd_loss(h, test_stream(), x.dl(), &kt, nullptr, &ko, p, nullptr, 0);
  }));
  fce_linear_ce_outputs_t lce = FCE_LINEAR_CE_OUTPUTS_INIT;
  lce.loss = loss.dl();
  lce.dhidden = dh.dl();
  // Grown in 0.2.0 by `flags`: 0.1.0's struct, which ends before it, is still taken.
  check_struct_growth("fce_linear_ce_outputs_t", lce, growth_call<fce_linear_ce_outputs_t>({&loss, &dh}, [&](fce_handle_t h, const fce_linear_ce_outputs_t* p) {
    return fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), w.dl(), nullptr, tg.dl(), &co, p, nullptr, 0);
  }), offsetof(fce_linear_ce_outputs_t, flags));
}

// fce_build_info fills what it knows and zeroes the rest of a larger struct; refuses a short one.
TEST(Contract, BuildInfo) {
  alignas(16) unsigned char buf[sizeof(fce_build_info_t) + 24];
  std::memset(buf, 0xab, sizeof(buf));
  auto* b = reinterpret_cast<fce_build_info_t*>(buf);
  b->struct_size = sizeof(buf);
  FCE_OK(fce_build_info(b));
  EXPECT_EQ(b->struct_size, sizeof(buf));
  EXPECT_EQ(b->version_number, unsigned(FCE_VERSION_NUMBER));
  EXPECT_EQ(b->abi_version, unsigned(FCE_ABI_VERSION));
  EXPECT_STREQ(b->version_string, fce_version_string());
  ASSERT_NE(b->cuda_architectures, nullptr);
  for (size_t i = sizeof(fce_build_info_t); i < sizeof(buf); ++i) EXPECT_EQ(buf[i], 0) << "byte " << i;
  if (target().cuda()) {
    EXPECT_EQ(b->cuda_backend, 1);
  }
  if (b->cuda_backend) {
    EXPECT_GE(b->cuda_runtime_version, 11000);
    EXPECT_GE(b->cublas_version, 110000);
    EXPECT_NE(std::string(b->cuda_architectures).find("sm_"), std::string::npos) << b->cuda_architectures;
  } else {
    EXPECT_EQ(b->cuda_runtime_version, 0);
    EXPECT_STREQ(b->cuda_architectures, "");
  }
  fce_build_info_t small = FCE_BUILD_INFO_INIT;
  small.struct_size = 8;
  small.version_number = 77;
  EXPECT_EQ(fce_build_info(&small), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(small.version_number, 77u) << "written by a refused call";
  EXPECT_EQ(fce_build_info(nullptr), FCE_STATUS_INVALID_ARGUMENT);
}

// ------------------------------------------------------------------------------------------------------
// 8. A caller's workspace must be aligned to FCE_WORKSPACE_ALIGNMENT (16) bytes: one at a 16-byte offset
// from an aligned buffer gives the results of the handle's own workspace; one at an 8-byte offset is
// INVALID_ARGUMENT with nothing written.

TEST(Contract, WorkspaceAlignment) {
  const int64_t N = 37, V = 4099, H = 32;
  Tensor x(DT::BF16, {N, V}), t2(DT::F32, {N, V}), tg(DT::I64, {N}), hid(DT::BF16, {N, H}), w(DT::BF16, {V, H});
  fill_logits(x, 2.0, true);
  fill_logits(t2, 2.0, false);
  fill_logits(hid, 1.0, false);
  fill_logits(w, 0.3, false);
  for (int64_t i = 0; i < N; ++i) tg.set_int(i, i % 5 == 2 ? -100 : (i * 29) % V);
  tg.upload();
  Tensor loss(DT::F32, {}), lse(DT::F32, {N}), dl(DT::BF16, {N, V}), dh(DT::F32, {N, H}), dw(DT::F32, {V, H});
  fce_ce_options_t co = FCE_CE_OPTIONS_INIT;
  fce_kd_options_t ko = FCE_KD_OPTIONS_INIT;
  fce_kd_teacher_t kt = FCE_KD_TEACHER_INIT;
  kt.logits = t2.dl();
  struct Op {
    const char* name;
    std::vector<Tensor*> outs;
    std::function<fce_status_t(fce_handle_t, size_t*)> size;
    std::function<fce_status_t(fce_handle_t, void*, size_t)> run;
  };
  fce_ce_outputs_t ce = FCE_CE_OUTPUTS_INIT;
  ce.loss = loss.dl();
  ce.lse = lse.dl();
  ce.dlogits = dl.dl();
  fce_kd_outputs_t ko_ = FCE_KD_OUTPUTS_INIT;
  ko_.loss = loss.dl();
  ko_.dstudent = dl.dl();
  fce_linear_ce_outputs_t lo = FCE_LINEAR_CE_OUTPUTS_INIT;
  lo.loss = loss.dl();
  lo.dhidden = dh.dl();
  lo.dweight = dw.dl();
  Tensor probs(DT::F32, {N, V});
  const std::vector<Op> ops = {
      {"cross-entropy", {&loss, &lse, &dl},
       [&](fce_handle_t h, size_t* b) { return fce_cross_entropy_fwd_workspace_size(h, x.dl(), tg.dl(), &co, &ce, b); },
       [&](fce_handle_t h, void* ws, size_t b) { return fce_cross_entropy_fwd(h, test_stream(), x.dl(), tg.dl(), &co, &ce, ws, b); }},
      {"logsumexp", {&lse},
       [&](fce_handle_t h, size_t* b) { return fce_logsumexp_workspace_size(h, x.dl(), nullptr, lse.dl(), b); },
       [&](fce_handle_t h, void* ws, size_t b) { return fce_logsumexp(h, test_stream(), x.dl(), nullptr, lse.dl(), ws, b); }},
      {"softmax", {&probs},
       [&](fce_handle_t h, size_t* b) { return fce_temp_softmax_workspace_size(h, x.dl(), nullptr, probs.dl(), nullptr, b); },
       [&](fce_handle_t h, void* ws, size_t b) { return fce_temp_softmax(h, test_stream(), x.dl(), nullptr, probs.dl(), nullptr, ws, b); }},
      {"KD", {&loss, &dl},
       [&](fce_handle_t h, size_t* b) { return fce_kd_loss_workspace_size(h, x.dl(), &kt, tg.dl(), &ko, &ko_, b); },
       [&](fce_handle_t h, void* ws, size_t b) { return fce_kd_loss(h, test_stream(), x.dl(), &kt, tg.dl(), &ko, &ko_, ws, b); }},
      {"linear cross-entropy", {&loss, &dh, &dw},
       [&](fce_handle_t h, size_t* b) {
         return fce_linear_cross_entropy_fwd_workspace_size(h, hid.dl(), w.dl(), nullptr, tg.dl(), &co, &lo, b);
       },
       [&](fce_handle_t h, void* ws, size_t b) {
         return fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), w.dl(), nullptr, tg.dl(), &co, &lo, ws, b);
       }},
  };
  for (const Op& op : ops) {
    SCOPED_TRACE(op.name);
    Handle h;
    size_t need = 0;
    FCE_OK(op.size(h, &need));
    Tensor buf(DT::I32, {int64_t(need / 4 + 64)});  // device or host memory, at least 16-byte aligned
    char* base = static_cast<char*>(buf.dl()->data);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(base) % 16, 0u);
    auto run = [&](void* ws, size_t bytes, fce_status_t* st, std::string* msg) {
      for (Tensor* t : op.outs) {
        t->poison();
        t->upload();
      }
      *st = op.run(h, ws, bytes);
      *msg = fce_last_error_message();
      std::vector<uint8_t> r;
      for (Tensor* t : op.outs) {
        t->download();
        r.insert(r.end(), t->bytes().begin(), t->bytes().end());
      }
      return r;
    };
    fce_status_t st;
    std::string msg;
    const std::vector<uint8_t> want = run(nullptr, 0, &st, &msg);
    ASSERT_EQ(st, FCE_STATUS_SUCCESS) << msg;
    const std::vector<uint8_t> poisoned = [&] {
      std::vector<uint8_t> r;
      for (Tensor* t : op.outs) {
        Tensor c(t->dtype(), {t->rows(), t->cols()});
        c.poison();
        r.insert(r.end(), c.bytes().begin(), c.bytes().end());
      }
      return r;
    }();
    EXPECT_TRUE(run(base + 16, need, &st, &msg) == want) << "16-byte aligned workspace";
    EXPECT_EQ(st, FCE_STATUS_SUCCESS) << msg;
    for (size_t off : {8, 4, 1}) {
      EXPECT_TRUE(run(base + off, need + 16, &st, &msg) == poisoned) << "offset " << off << ": outputs written";
      EXPECT_EQ(st, FCE_STATUS_INVALID_ARGUMENT) << "offset " << off;
      EXPECT_NE(msg.find("aligned"), std::string::npos) << msg;
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// 10. Device types each handle takes (the header's conventions): a CPU handle reads kDLCPU and kDLCUDAHost
// (pinned host) memory and refuses kDLCUDA and kDLCUDAManaged; the CUDA handle's side is in the gpu suite
// (tests/gpu/test_gpu_extra.cpp, GpuContract.DeviceTypes), with real managed and pinned memory.

TEST(Contract, DeviceTypesOfACpuHandle) {
  if (target().cuda()) GTEST_SKIP() << "the CUDA handle's device types: GpuContract.DeviceTypes";
  Tensor x = matrix(DT::F32, {{1, 2, 3}, {0, -1, 4}});
  Tensor ref = poisoned(DT::F32, {2}), got = poisoned(DT::F32, {2});
  Handle h;
  FCE_OK(fce_logsumexp(h, nullptr, x.dl(), nullptr, ref.dl(), nullptr, 0));
  for (int32_t dt : {int32_t(kDLCUDAHost), int32_t(kDLCUDA), int32_t(kDLCUDAManaged), int32_t(kDLROCM)}) {
    for (bool input : {true, false}) {  // the device type on the input, or on the output
      DLTensor xi = *x.dl(), o = *got.dl();
      (input ? xi : o).device = {DLDeviceType(dt), 0};
      got.poison();
      const fce_status_t st = fce_logsumexp(h, nullptr, &xi, nullptr, &o, nullptr, 0);
      if (dt == kDLCUDAHost) {
        EXPECT_EQ(st, FCE_STATUS_SUCCESS) << fce_last_error_message();
        EXPECT_EQ(got.get(0), ref.get(0));
      } else {
        EXPECT_EQ(st, FCE_STATUS_DEVICE_MISMATCH) << "device type " << dt;
        EXPECT_TRUE(std::isnan(got.get(0)) && std::isnan(got.get(1))) << "written";
      }
    }
  }
}

// ------------------------------------------------------------------------------------------------------
// 11. The init functions give exactly the _INIT macros' values, for callers that cannot expand a macro, in the
// struct size the caller passes (a newer header's larger struct gets zeros past the fields this library knows).

TEST(Contract, InitFunctionsMatchTheMacros) {
  {
    fce_ce_options_t a, b = FCE_CE_OPTIONS_INIT;
    std::memset(&a, 0xcd, sizeof(a));
    FCE_OK(fce_ce_options_init(&a, sizeof(a)));
    EXPECT_EQ(a.struct_size, b.struct_size);
    EXPECT_EQ(a.reduction, b.reduction);
    EXPECT_EQ(a.ignore_index, b.ignore_index);
    EXPECT_EQ(a.label_smoothing, b.label_smoothing);
    EXPECT_EQ(a.z_loss_scale, b.z_loss_scale);
    EXPECT_EQ(a.softcap, b.softcap);
    EXPECT_EQ(a.logit_scale, b.logit_scale);
    EXPECT_EQ(a.class_weights, b.class_weights);
  }
  {
    fce_ce_outputs_t a, b = FCE_CE_OUTPUTS_INIT;
    std::memset(&a, 0xcd, sizeof(a));
    FCE_OK(fce_ce_outputs_init(&a, sizeof(a)));
    EXPECT_EQ(a.struct_size, b.struct_size);
    for (DLTensor* f : {a.loss, a.lse, a.z_loss, a.argmax, a.entropy, a.dlogits}) EXPECT_EQ(f, nullptr);
    EXPECT_EQ(a.grad_loss, nullptr);
    EXPECT_EQ(a.grad_entropy, nullptr);
  }
  {
    fce_ce_bwd_inputs_t a, b = FCE_CE_BWD_INPUTS_INIT;
    std::memset(&a, 0xcd, sizeof(a));
    FCE_OK(fce_ce_bwd_inputs_init(&a, sizeof(a)));
    EXPECT_EQ(a.struct_size, b.struct_size);
    for (const DLTensor* f : {a.lse, a.grad_loss, a.entropy, a.grad_entropy}) EXPECT_EQ(f, nullptr);
  }
  {
    fce_lse_options_t a, b = FCE_LSE_OPTIONS_INIT;
    std::memset(&a, 0xcd, sizeof(a));
    FCE_OK(fce_lse_options_init(&a, sizeof(a)));
    EXPECT_EQ(a.struct_size, b.struct_size);
    EXPECT_EQ(a.scale, b.scale);
  }
  {
    fce_softmax_options_t a, b = FCE_SOFTMAX_OPTIONS_INIT;
    std::memset(&a, 0xcd, sizeof(a));
    FCE_OK(fce_softmax_options_init(&a, sizeof(a)));
    EXPECT_EQ(a.struct_size, b.struct_size);
    EXPECT_EQ(a.temperature, b.temperature);
    EXPECT_EQ(a.temperatures, b.temperatures);
  }
  {
    fce_kd_options_t a, b = FCE_KD_OPTIONS_INIT;
    std::memset(&a, 0xcd, sizeof(a));
    FCE_OK(fce_kd_options_init(&a, sizeof(a)));
    EXPECT_EQ(a.struct_size, b.struct_size);
    EXPECT_EQ(a.divergence, b.divergence);
    EXPECT_EQ(a.beta, b.beta);
    EXPECT_EQ(a.temperature, b.temperature);
    EXPECT_EQ(a.scale_by_t2, b.scale_by_t2);
    EXPECT_EQ(a.topk_norm, b.topk_norm);
    EXPECT_EQ(a.reduction, b.reduction);
    EXPECT_EQ(a.ignore_index, b.ignore_index);
    EXPECT_EQ(a.vocab_start, 0);
    EXPECT_EQ(a.vocab_total, 0);
  }
  {
    fce_kd_teacher_t a, b = FCE_KD_TEACHER_INIT;
    std::memset(&a, 0xcd, sizeof(a));
    FCE_OK(fce_kd_teacher_init(&a, sizeof(a)));
    EXPECT_EQ(a.struct_size, b.struct_size);
    EXPECT_EQ(a.logits, nullptr);
    EXPECT_EQ(a.topk_ids, nullptr);
    EXPECT_EQ(a.topk_logprobs, nullptr);
  }
  {
    fce_kd_outputs_t a, b = FCE_KD_OUTPUTS_INIT;
    std::memset(&a, 0xcd, sizeof(a));
    FCE_OK(fce_kd_outputs_init(&a, sizeof(a)));
    EXPECT_EQ(a.struct_size, b.struct_size);
    EXPECT_EQ(a.loss, nullptr);
    EXPECT_EQ(a.dstudent, nullptr);
    EXPECT_EQ(a.grad_loss, nullptr);
  }
  {
    fce_linear_ce_outputs_t a, b = FCE_LINEAR_CE_OUTPUTS_INIT;
    std::memset(&a, 0xcd, sizeof(a));
    FCE_OK(fce_linear_ce_outputs_init(&a, sizeof(a)));
    EXPECT_EQ(a.struct_size, b.struct_size);
    for (DLTensor* f : {a.loss, a.lse, a.z_loss, a.argmax, a.entropy, a.dhidden, a.dweight, a.dbias})
      EXPECT_EQ(f, nullptr);
    EXPECT_EQ(a.grad_loss, nullptr);
    EXPECT_EQ(a.flags, 0u);
    // 0.1.0's size (before `flags`) is taken and leaves the bytes past it alone; 4 bytes less is refused.
    std::memset(&a, 0xcd, sizeof(a));
    FCE_OK(fce_linear_ce_outputs_init(&a, offsetof(fce_linear_ce_outputs_t, flags)));
    EXPECT_EQ(a.struct_size, offsetof(fce_linear_ce_outputs_t, flags));
    EXPECT_EQ(a.dweight, nullptr);
    EXPECT_EQ(a.flags, 0xcdcdcdcdcdcdcdcdull);
    EXPECT_EQ(fce_linear_ce_outputs_init(&a, offsetof(fce_linear_ce_outputs_t, flags) - 4),
              FCE_STATUS_INVALID_ARGUMENT);
  }
  EXPECT_EQ(fce_ce_options_init(nullptr, sizeof(fce_ce_options_t)), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(fce_linear_ce_outputs_init(nullptr, sizeof(fce_linear_ce_outputs_t)), FCE_STATUS_INVALID_ARGUMENT);
  // A newer header's larger struct: the known fields' defaults, zeros past them, struct_size as given.
  alignas(16) unsigned char buf[sizeof(fce_kd_options_t) + 24];
  std::memset(buf, 0xcd, sizeof(buf));
  auto* k = reinterpret_cast<fce_kd_options_t*>(buf);
  FCE_OK(fce_kd_options_init(k, sizeof(buf)));
  EXPECT_EQ(k->struct_size, sizeof(buf));
  EXPECT_EQ(k->temperature, 1.f);
  EXPECT_EQ(k->ignore_index, -100);
  for (size_t i = sizeof(fce_kd_options_t); i < sizeof(buf); ++i) EXPECT_EQ(buf[i], 0) << "byte " << i;
  // Sizes out of range write nothing.
  std::memset(buf, 0xcd, sizeof(buf));
  for (size_t bad : {offsetof(fce_kd_options_t, vocab_start) - 4, size_t(FCE_MAX_STRUCT_SIZE) + 1}) {
    EXPECT_EQ(fce_kd_options_init(k, bad), FCE_STATUS_INVALID_ARGUMENT) << bad;
    for (unsigned char c : buf) ASSERT_EQ(c, 0xcd) << "written for size " << bad;
  }
}

// ------------------------------------------------------------------------------------------------------
// 12. One handle, several threads (issue 47, item 10). A handle takes one thread at a time (the header's
// Handles paragraph); a call that enters a handle another thread's call is inside returns
// FCE_STATUS_HANDLE_BUSY, writing nothing, instead of racing on the handle's cached workspace (which a
// growing call frees under the other's feet). Threads hammer one handle with linear CE forwards that use the
// cached workspace (NULL workspace), each its own N (the cache grows while they run: a fresh handle each
// round): every call succeeds with the bits of the same call on a private handle, or is refused with
// HANDLE_BUSY and its outputs untouched; after the threads, the handle works. Then a thread polls a query while
// another runs forwards: it sees HANDLE_BUSY (the flag exists, and covers the queries too).

TEST(Contract, HandleSharedByThreadsIsRefusedNotRaced) {
  constexpr int kThreads = 4, kCalls = 20, kRounds = 4;
  const int64_t H = 64, V = 1000;
  Tensor w(DT::BF16, {V, H});
  fill_logits(w, 0.1, false);
  struct Job {
    int64_t N = 0;
    Tensor hid, tg;
    std::vector<uint8_t> loss, lse;  // the bits of a call on a private handle
    int ok = 0, busy = 0, wrong = 0, untouched = 0;
    std::vector<std::string> other;  // other statuses, messages of HANDLE_BUSY without the words
  };
  std::vector<Job> jobs(kThreads);
  fce_ce_options_t o = ce_none();
  auto run = [&](fce_handle_t h, Job& j, Tensor& loss, Tensor& lse) {
    loss.poison(); loss.upload();
    lse.poison(); lse.upload();
    fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
    out.loss = loss.dl();
    out.lse = lse.dl();
    const fce_status_t s =
        fce_linear_cross_entropy_fwd(h, test_stream(), j.hid.dl(), w.dl(), nullptr, j.tg.dl(), &o, &out, nullptr, 0);
    loss.download();
    lse.download();
    return s;
  };
  for (int t = 0; t < kThreads; ++t) {
    Job& j = jobs[size_t(t)];
    j.N = 40 + 37 * t;
    j.hid = Tensor(DT::BF16, {j.N, H});
    fill_logits(j.hid, 1.0, false);
    j.tg = Tensor(DT::I64, {j.N});
    for (int64_t i = 0; i < j.N; ++i) j.tg.set_int(i, (i * 97 + t) % V);
    j.tg.upload();
    Handle own;
    Tensor loss(DT::F32, {j.N}), lse(DT::F32, {j.N});
    FCE_OK(run(own, j, loss, lse));
    j.loss = loss.bytes();
    j.lse = lse.bytes();
  }
  for (int round = 0; round < kRounds; ++round) {
    Handle h;  // an empty cache: it grows while the threads run
    std::atomic<int> ready{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t)
      threads.emplace_back([&, t] {
        Job& j = jobs[size_t(t)];
        Tensor loss(DT::F32, {j.N}), lse(DT::F32, {j.N});
        ready.fetch_add(1);
        while (ready.load() < kThreads) std::this_thread::yield();  // all start together
        // kCalls successful calls each, a refused one retried: the threads' calls interleave, and the
        // cache grows whenever a larger N follows a smaller one.
        for (int done = 0, tries = 0; done < kCalls && tries < 1000000; ++tries) {
          const fce_status_t s = run(h, j, loss, lse);
          if (s == FCE_STATUS_SUCCESS) {
            ++done;
            ++j.ok;
            if (loss.bytes() != j.loss || lse.bytes() != j.lse) ++j.wrong;
          } else if (s == FCE_STATUS_HANDLE_BUSY) {
            ++j.busy;
            const std::string m = fce_last_error_message();
            if (m.find("fce_linear_cross_entropy_fwd: handle") != 0 || m.find("another thread") == std::string::npos)
              j.other.push_back(m);
            bool poisoned = true;
            for (uint8_t b : loss.bytes()) poisoned = poisoned && b == 0xff;
            for (uint8_t b : lse.bytes()) poisoned = poisoned && b == 0xff;
            j.untouched += poisoned;
            std::this_thread::yield();
          } else {
            j.other.push_back(std::string(fce_status_string(s)) + ": " + fce_last_error_message());
            break;
          }
        }
      });
    for (std::thread& th : threads) th.join();
    for (Job& j : jobs) {  // after the others, every call succeeds
      Tensor loss(DT::F32, {j.N}), lse(DT::F32, {j.N});
      FCE_OK(run(h, j, loss, lse));
      EXPECT_TRUE(loss.bytes() == j.loss && lse.bytes() == j.lse) << "N = " << j.N << " after the threads";
    }
  }
  int ok = 0, busy = 0;
  for (const Job& j : jobs) {
    SCOPED_TRACE("N = " + std::to_string(j.N));
    EXPECT_EQ(j.wrong, 0) << "successful calls whose results differ from a private handle's";
    EXPECT_EQ(j.untouched, j.busy) << "refused calls that wrote outputs";
    for (const std::string& m : j.other) ADD_FAILURE() << m;
    ok += j.ok;
    busy += j.busy;
  }
  EXPECT_EQ(ok, kRounds * kThreads * kCalls);
  std::printf("%d calls succeeded, %d were refused (HANDLE_BUSY)\n", ok, busy);

  // A query polled while another thread runs forwards on the handle sees it busy.
  Handle h;
  Job& big = jobs.back();
  std::atomic<bool> seen{false}, done{false};
  std::string msg;
  std::thread worker([&] {
    Tensor loss(DT::F32, {big.N}), lse(DT::F32, {big.N});
    // Until the query has seen it busy, or 500 forwards (refused ones, by the query, do not count).
    for (int ok = 0, c = 0; ok < 500 && c < 1000000 && !seen.load(); ++c) {
      const fce_status_t s = run(h, big, loss, lse);
      if (s != FCE_STATUS_SUCCESS && s != FCE_STATUS_HANDLE_BUSY) break;
      ok += s == FCE_STATUS_SUCCESS;
    }
    done.store(true);
  });
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  Tensor loss(DT::F32, {big.N});
  out.loss = loss.dl();
  while (!done.load() && !seen.load()) {
    size_t bytes = 0;
    const fce_status_t s =
        fce_linear_cross_entropy_fwd_workspace_size(h, big.hid.dl(), w.dl(), nullptr, big.tg.dl(), &o, &out, &bytes);
    if (s == FCE_STATUS_HANDLE_BUSY) {
      msg = fce_last_error_message();
      seen.store(true);
    } else {
      EXPECT_EQ(s, FCE_STATUS_SUCCESS) << fce_last_error_message();
    }
  }
  worker.join();
  EXPECT_TRUE(seen.load()) << "a query never saw the handle busy while another thread ran forwards on it";
  EXPECT_NE(msg.find("fce_linear_cross_entropy_fwd_workspace_size: handle"), std::string::npos) << msg;
  EXPECT_NE(msg.find("another thread"), std::string::npos) << msg;
  std::printf("the query's message: %s\n", msg.c_str());
}
