// Linear cross-entropy: loss, lse and every gradient against float64 (matmul + the CE reference).
#include <tuple>

#include "../common/ce_reference.hpp"

using namespace fct;

namespace {

struct LceCase {
  CeCase ce;   // N, V, dt, options (pad ignored)
  int64_t H;
  bool bias = false;
  int ws_rows = 0;  // 0: NULL workspace (default chunk); 1: the one-token minimum; k: k * minimum;
                    // -1: a caller's workspace of the size the query reports for this very call
  DT grad_dt = DT::F32;
  bool forward_only = false;  // no gradient asked for: loss, lse and z-loss only
};

void run_case(const LceCase& lc) {
  const CeCase& c = lc.ce;
  SCOPED_TRACE(::testing::Message() << "N=" << c.N << " H=" << lc.H << " V=" << c.V << " " << dt_name(c.dt)
                                    << " bias=" << lc.bias << " ws_rows=" << lc.ws_rows << " red=" << c.reduction
                                    << " eps=" << c.eps << " zq=" << c.zq << " cap=" << c.cap << " grad_dt="
                                    << dt_name(lc.grad_dt) << " weights=" << c.weights
                                    << " forward_only=" << lc.forward_only);
  Handle h;
  const int64_t N = c.N, V = c.V, H = lc.H;
  Tensor hidden(c.dt, {N, H}), weight(c.dt, {V, H}), bias(c.dt, {V});
  fill_logits(hidden, 1.0, false);
  fill_logits(weight, 0.5, false);
  std::normal_distribution<double> nd(0, 1);
  for (int64_t v = 0; v < V; ++v) bias.set(v, lc.bias ? nd(rng()) : 0.0);
  bias.upload();
  Tensor targets(c.tdt, {N});
  std::vector<int64_t> tg(N);
  for (int64_t i = 0; i < N; ++i) {
    tg[i] = i % 5 == 3 ? -100 : int64_t(rng()() % uint64_t(V));
    targets.set_int(i, tg[i]);
  }
  targets.upload();
  const std::vector<double> hv = values(hidden), wv = values(weight);
  std::vector<double> x(size_t(N * V));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t v = 0; v < V; ++v) {
      double acc = lc.bias ? bias.get(v) : 0.0;
      for (int64_t k = 0; k < H; ++k) acc += hv[size_t(i * H + k)] * wv[size_t(v * H + k)];
      x[size_t(i * V + v)] = acc;
    }
  std::vector<double> wts;
  Tensor weights = class_weights(c, V, wts);
  const Ref ref = reference(c, x, tg, wts, {});

  fce_ce_options_t o = options_of(c, weights);
  const bool none = c.reduction == FCE_REDUCTION_NONE;
  Tensor loss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
  Tensor zl = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
  Tensor lse(DT::F32, {N}), dh(lc.grad_dt, {N, H}), dw(lc.grad_dt, {V, H}), db(lc.grad_dt, {V});
  for (Tensor* t : {&loss, &zl, &lse, &dh, &dw, &db}) { t->poison(); t->upload(); }
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  out.loss = loss.dl(); out.lse = lse.dl();
  if (lc.forward_only) out.z_loss = zl.dl();
  else { out.dhidden = dh.dl(); out.dweight = dw.dl(); }
  if (lc.bias && !lc.forward_only) out.dbias = db.dl();
  const DLTensor* b = lc.bias ? bias.dl() : nullptr;

  Tensor ws;
  size_t ws_bytes = 0;
  if (lc.ws_rows > 0) {
    // The minimum workspace is what the query reports for N = 1 with the same options.
    Tensor h1(c.dt, {1, H}), t1(DT::I64, {1}), l1(DT::F32, {1}), dh1(lc.grad_dt, {1, H});
    fce_linear_ce_outputs_t o1 = out;
    o1.loss = none ? l1.dl() : loss.dl(); o1.lse = nullptr; o1.dhidden = lc.forward_only ? nullptr : dh1.dl();
    o1.z_loss = nullptr;
    size_t one = 0;
    FCE_OK(fce_linear_cross_entropy_fwd_workspace_size(h, h1.dl(), weight.dl(), b, t1.dl(), &o, &o1, &one));
    ws_bytes = one * size_t(lc.ws_rows);
    ws = Tensor(DT::F32, {int64_t(ws_bytes / 4 + 64)});
  }
  if (lc.ws_rows < 0) {
    FCE_OK(fce_linear_cross_entropy_fwd_workspace_size(h, hidden.dl(), weight.dl(), b, targets.dl(), &o, &out,
                                                       &ws_bytes));
    ws = Tensor(DT::F32, {int64_t(ws_bytes / 4 + 64)});
  }
  FCE_OK(fce_linear_cross_entropy_fwd(h, test_stream(), hidden.dl(), weight.dl(), b, targets.dl(), &o, &out,
                                      lc.ws_rows ? ws.dl()->data : nullptr, ws_bytes));
  for (Tensor* t : {&loss, &zl, &lse, &dh, &dw, &db}) t->download();
  // The logits rounded to the inputs' dtype: the bounds of ce_reference.hpp's linear_ce_grads.
  const double u = logit_roundoff(c.dt);
  const std::vector<double> zabs = scaled_row_max(c, x, N, V);
  auto row_tol = [&](int64_t i) { return linear_row_tol(c, ref, u, zabs, i); };
  // A mean's error is at most the largest row's; a sum's the rows' weighted sum.
  double mean_tol = 0, sum_tol = 0;
  for (int64_t i = 0; i < N; ++i) {
    mean_tol = std::max(mean_tol, row_tol(i));
    sum_tol += row_tol(i) * (wts.empty() || tg[i] < 0 || tg[i] >= V ? 1.0 : wts[size_t(tg[i])]);
  }
  for (int64_t i = 0; i < N; ++i) ASSERT_TRUE(close(lse.get(i), ref.lse[i], 1e-5, row_tol(i))) << "lse " << i;
  if (none) for (int64_t i = 0; i < N; ++i) ASSERT_TRUE(close(loss.get(i), ref.loss[i], 1e-4, row_tol(i))) << "loss " << i;
  else ASSERT_TRUE(close(loss.get(0), ref.total, 1e-4, c.reduction == FCE_REDUCTION_SUM ? sum_tol : mean_tol));
  if (lc.forward_only) {
    // z-loss = zq * lse^2 per row (ignored rows 0): its error is 2 zq |lse| times lse's.
    if (none) {
      for (int64_t i = 0; i < N; ++i)
        ASSERT_TRUE(close(zl.get(i), ref.zl[i], 1e-4, 2 * c.zq * std::fabs(ref.lse[i]) * row_tol(i) + 1e-7))
            << "z_loss " << i;
    }
    // The same call again gives the same bits.
    Tensor loss2 = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {}), lse2(DT::F32, {N});
    for (Tensor* t : {&loss2, &lse2}) { t->poison(); t->upload(); }
    fce_linear_ce_outputs_t again = FCE_LINEAR_CE_OUTPUTS_INIT;
    again.loss = loss2.dl(); again.lse = lse2.dl();
    FCE_OK(fce_linear_cross_entropy_fwd(h, test_stream(), hidden.dl(), weight.dl(), b, targets.dl(), &o, &again,
                                        lc.ws_rows ? ws.dl()->data : nullptr, ws_bytes));
    for (Tensor* t : {&loss2, &lse2}) t->download();
    EXPECT_TRUE(loss2.bytes() == loss.bytes() && lse2.bytes() == lse.bytes()) << "a second call changed the bits";
    return;
  }

  // Reference gradients, and the sums of |terms| that bound the error.
  const LinearCeGrads rg = linear_ce_grads(c, ref, x, tg, hv, wv, zabs, N, V, H, 0, V);
  const std::vector<double> &rdh = rg.dh, &adh = rg.adh, &rdw = rg.dw, &adw = rg.adw, &rdb = rg.db, &adb = rg.adb;
  auto check = [&](const Tensor& t, const std::vector<double>& want, const std::vector<double>& abs_sum, int64_t rows,
                   int64_t cols, const char* what, double per_chunk = 0) {
    double mx = 0;
    for (double w : want) mx = std::max(mx, std::fabs(w));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t k = 0; k < cols; ++k)
        ASSERT_TRUE(close(t.get(r, cols == 1 && t.cols() != 1 ? -1 : k), want[size_t(r * cols + k)],
                          dtype_rtol(lc.grad_dt) + 1e-3,
                          1e-5 * mx + (u + per_chunk) * abs_sum[size_t(r * cols + k)]))
            << what << " (" << r << "," << k << ")";
  };
  check(dh, rdh, adh, N, H, "dhidden");
  // On CUDA a bf16/fp16 dweight is summed over the token chunks in its own dtype (the header): each chunk
  // after the first rounds a partial sum, by at most its unit roundoff times the sum of |terms| so far.
  // Chunks: the workspace's (ws_rows tokens), or one for the default workspace at these sizes.
  const int64_t chunks = lc.ws_rows > 0 ? (N + lc.ws_rows - 1) / lc.ws_rows : 1;
  const double uo = lc.grad_dt == DT::BF16 ? 1.0 / 256 : lc.grad_dt == DT::F16 ? 1.0 / 2048 : 0.0;
  check(dw, rdw, adw, V, H, "dweight", double(chunks - 1) * uo);
  if (lc.bias) {
    for (int64_t v = 0; v < V; ++v)
      ASSERT_TRUE(close(db.get(v), rdb[v], dtype_rtol(lc.grad_dt) + 1e-3, 1e-6 + u * adb[v])) << "dbias " << v;
  }

  // The backward from the saved lse writes the same gradients.
  Tensor dh2(lc.grad_dt, {N, H});
  dh2.poison(); dh2.upload();
  fce_linear_ce_outputs_t ob = FCE_LINEAR_CE_OUTPUTS_INIT;
  ob.dhidden = dh2.dl();
  FCE_OK(fce_linear_cross_entropy_bwd(h, test_stream(), hidden.dl(), weight.dl(), b, targets.dl(), lse.dl(), &o, &ob,
                                      nullptr, 0));
  dh2.download();
  check(dh2, rdh, adh, N, H, "bwd dhidden");
}

}  // namespace

TEST(LinearCrossEntropy, DtypesOptionsAndBias) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16})
    for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_MEAN}) {
      LceCase lc{CeCase{37, 1031, dt}, 64};
      lc.ce.reduction = red;
      lc.bias = red == FCE_REDUCTION_MEAN;
      lc.grad_dt = dt == DT::F16 ? DT::F16 : DT::F32;
      run_case(lc);
      lc.ce.eps = 0.1; lc.ce.zq = 1e-3; lc.ce.cap = 10; lc.ce.scale = 0.8;
      run_case(lc);
    }
}

TEST(LinearCrossEntropy, ChunkSizesAgree) {
  // One chunk (the default workspace), one-token chunks, chunks of 7 tokens; a bf16 dweight summed over
  // the chunks in its own dtype on CUDA, an fp32 one exactly.
  for (DT gdt : {DT::BF16, DT::F32})
    for (int ws_rows : {0, 1, 7}) {
      LceCase lc{CeCase{29, 257, DT::BF16}, 48};
      lc.ws_rows = ws_rows;
      lc.grad_dt = gdt;
      lc.bias = true;
      run_case(lc);
    }
  // A hundred one-token chunks summed into a bf16 dweight. Reduction NONE: a reduced loss keeps N per-row
  // values in the workspace, which the one-token query (made at N = 1) does not count for N = 100.
  for (int ws_rows : {0, 1}) {
    LceCase lc{CeCase{100, 257, DT::BF16}, 48};
    lc.ce.reduction = FCE_REDUCTION_NONE;
    lc.ws_rows = ws_rows;
    lc.grad_dt = DT::BF16;
    run_case(lc);
  }
}

// The forward alone, no gradient asked for. On an sm_90 GPU bf16 without a bias takes the fused GEMM (records
// per 256-column tile, never logits: src/cuda/linear_ce_fused.cu) and everything else the chunked path; under
// FCE_FORCE_PATH=linear_ce:chunked (the gpu-paths suite) all of it is chunked. Vocabularies within, at and
// across a tile (prime, 256, 4099, 129920), rows across the GEMM's 128-row tile, H a multiple of 8 (the fused
// kernel's 16-byte rows) and not, every reduction, label smoothing, z-loss, class weights, int32 targets,
// and one- and 7-token workspaces (the fused path's records in chunks of rows).
TEST(LinearCrossEntropy, ForwardOnly) {
  struct Shape {
    int64_t N, V, H;
  };
  for (Shape sh : {Shape{1, 1031, 64}, Shape{37, 256, 64}, Shape{130, 4099, 72}, Shape{45, 777, 36},
                   Shape{8, 129920, 16}})
    for (DT dt : {DT::BF16, DT::F16, DT::F32}) {
      LceCase lc{CeCase{sh.N, sh.V, dt}, sh.H};
      lc.forward_only = true;
      lc.ce.reduction = FCE_REDUCTION_NONE;
      lc.ce.zq = 1e-3;
      run_case(lc);
      lc.ce.reduction = FCE_REDUCTION_MEAN;
      lc.ce.eps = 0.1;
      run_case(lc);
      lc.ce.reduction = FCE_REDUCTION_SUM;
      lc.ce.eps = 0;
      lc.ce.weights = true;
      lc.ce.tdt = DT::I32;
      run_case(lc);
      lc.ce.eps = 0.1;  // smoothing with class weights: the chunked path on every device
      run_case(lc);
    }
  for (int ws_rows : {1, 7}) {
    LceCase lc{CeCase{130, 4099, DT::BF16}, 72};
    lc.forward_only = true;
    lc.ce.reduction = FCE_REDUCTION_NONE;
    lc.ws_rows = ws_rows;
    run_case(lc);
  }
}

TEST(LinearCrossEntropy, SingleToken) {
  LceCase lc{CeCase{1, 130, DT::F32}, 16};
  lc.ce.ignore_frac = 0;
  run_case(lc);
}

// A chunk of several hundred rows: on the GPU the CE rows run one block per row (no split).
TEST(LinearCrossEntropy, ManyRows) {
  LceCase lc{CeCase{400, 3001, DT::BF16}, 32};
  lc.grad_dt = DT::BF16;
  run_case(lc);
}

// Chunks of ~280 rows and a last one of a few rows, with a vocabulary long enough for the GPU to split
// those few rows across blocks: the split's scratch must fit the last chunk too.
TEST(LinearCrossEntropy, ShortLastChunkSplits) {
  LceCase lc{CeCase{300, 9001, DT::BF16}, 16};
  lc.ws_rows = 280;
  lc.grad_dt = DT::F32;
  run_case(lc);
}

// The caller passes exactly the size the query reports (one chunk of all 300 rows, no split-row scratch on
// the GPU): accepted, and the same gradients.
TEST(LinearCrossEntropy, QueriedWorkspace) {
  LceCase lc{CeCase{300, 9001, DT::BF16}, 320};
  lc.ws_rows = -1;
  lc.grad_dt = DT::BF16;
  run_case(lc);
}

// The token chunks decide the bits of dweight's sum over them, so they must not depend on the workspace's
// size: a NULL workspace on a fresh handle, a caller's workspace eight times the query, and a NULL workspace
// after a larger call has grown the handle's cached one give the same bits (300 rows: one chunk on CUDA
// where the size-dependent plan used to cut 256 + 44, two on the CPU where it used to take all 300).
TEST(LinearCrossEntropy, BitsDoNotDependOnTheWorkspaceSize) {
  const int64_t N = 300, H = 64, V = 9001, big = 2000;
  Tensor hidden(DT::BF16, {big, H}), weight(DT::BF16, {V, H}), targets(DT::I64, {big});
  fill_logits(hidden, 1.0, false);
  fill_logits(weight, 0.5, false);
  for (int64_t i = 0; i < big; ++i) targets.set_int(i, int64_t(rng()() % uint64_t(V)));
  targets.upload();
  DLTensor h300 = *hidden.dl(), t300 = *targets.dl();
  int64_t hs[2] = {N, H}, ts[1] = {N};
  h300.shape = hs;
  t300.shape = ts;
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  auto call = [&](fce_handle_t h, DLTensor* hid, DLTensor* tg, int64_t rows, size_t ws_factor) -> std::vector<uint8_t> {
    Tensor loss(DT::F32, {}), dh(DT::BF16, {rows, H}), dw(DT::BF16, {V, H});
    for (Tensor* t : {&loss, &dh, &dw}) { t->poison(); t->upload(); }
    fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
    out.loss = loss.dl(); out.dhidden = dh.dl(); out.dweight = dw.dl();
    Tensor ws;
    size_t bytes = 0;
    if (ws_factor) {
      EXPECT_EQ(fce_linear_cross_entropy_fwd_workspace_size(h, hid, weight.dl(), nullptr, tg, &o, &out, &bytes),
                FCE_STATUS_SUCCESS);
      bytes *= ws_factor;
      ws = Tensor(DT::F32, {int64_t(bytes / 4 + 64)});
    }
    EXPECT_EQ(fce_linear_cross_entropy_fwd(h, test_stream(), hid, weight.dl(), nullptr, tg, &o, &out,
                                           ws_factor ? ws.dl()->data : nullptr, bytes),
              FCE_STATUS_SUCCESS)
        << fce_last_error_message();
    std::vector<uint8_t> all;
    for (Tensor* t : {&loss, &dh, &dw}) {
      t->download();
      all.insert(all.end(), t->bytes().begin(), t->bytes().end());
    }
    return all;
  };
  Handle fresh, caller, grown;
  const std::vector<uint8_t> want = call(fresh, &h300, &t300, N, 0);
  EXPECT_TRUE(call(caller, &h300, &t300, N, 8) == want) << "a caller's larger workspace changed the bits";
  call(grown, hidden.dl(), targets.dl(), big, 0);
  EXPECT_TRUE(call(grown, &h300, &t300, N, 0) == want) << "the grown cached workspace changed the bits";
}

// FCE_LINEAR_CE_ACCUMULATE adds the gradients into dhidden, dweight and dbias: the forward (fused) and the
// backward from the saved lse, fp32 and bf16 gradients, one chunk and many (the bf16 dweight then sums
// chunk by chunk into the current values). Expected: the current values plus the same call's gradients
// without the flag, within the roundings of both (per chunk for a bf16 dweight). Unknown flag bits are
// refused with nothing written.
TEST(LinearCrossEntropy, AccumulateAddsIntoGradients) {
  const int64_t N = 37, V = 1031, H = 64;
  Tensor hidden(DT::BF16, {N, H}), weight(DT::BF16, {V, H}), bias(DT::BF16, {V}), targets(DT::I64, {N});
  fill_logits(hidden, 1.0, false);
  fill_logits(weight, 0.5, false);
  fill_logits(bias, 1.0, false);
  for (int64_t i = 0; i < N; ++i) targets.set_int(i, i % 5 == 3 ? -100 : int64_t(rng()() % uint64_t(V)));
  targets.upload();
  std::normal_distribution<double> nd(0, 1);
  // A[v][k] = sum_i |dlogits_iv| |hidden_ik| in float64: what a partial sum of dweight over some of the
  // tokens can reach beyond its start (the mean's dlogits: (softmax - onehot) / non-ignored rows).
  std::vector<double> A(size_t(V * H), 0.0);
  {
    const std::vector<double> hv = values(hidden), wv = values(weight), bv = values(bias);
    int64_t valid = 0;
    for (int64_t i = 0; i < N; ++i) valid += targets.get_int(i) != -100;
    std::vector<double> x(static_cast<size_t>(V));
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = targets.get_int(i);
      if (t == -100) continue;
      double mx = -1e300, sum = 0;
      for (int64_t v = 0; v < V; ++v) {
        double acc = bv[size_t(v)];
        for (int64_t k = 0; k < H; ++k) acc += hv[size_t(i * H + k)] * wv[size_t(v * H + k)];
        x[size_t(v)] = acc;
        mx = std::max(mx, acc);
      }
      for (int64_t v = 0; v < V; ++v) sum += std::exp(x[size_t(v)] - mx);
      for (int64_t v = 0; v < V; ++v) {
        const double d = std::fabs(std::exp(x[size_t(v)] - mx) / sum - (v == t ? 1.0 : 0.0)) / double(valid);
        for (int64_t k = 0; k < H; ++k) A[size_t(v * H + k)] += d * std::fabs(hv[size_t(i * H + k)]);
      }
    }
  }
  for (DT gdt : {DT::F32, DT::BF16})
    for (int ws_rows : {0, 5})
      for (bool bwd : {false, true}) {
        SCOPED_TRACE(::testing::Message() << dt_name(gdt) << " ws_rows=" << ws_rows << " bwd=" << bwd);
        Handle h;
        Tensor loss(DT::F32, {}), lse(DT::F32, {N}), dh(gdt, {N, H}), dw(gdt, {V, H}), db(gdt, {V});
        fce_linear_ce_outputs_t fo = FCE_LINEAR_CE_OUTPUTS_INIT;
        fo.loss = loss.dl();
        fo.lse = lse.dl();
        FCE_OK(fce_linear_cross_entropy_fwd(h, test_stream(), hidden.dl(), weight.dl(), bias.dl(), targets.dl(), nullptr,
                                            &fo, nullptr, 0));
        // Workspace of ws_rows one-token minimums (0: the default).
        size_t one = 0;
        {
          Tensor h1(DT::BF16, {1, H}), t1(DT::I64, {1});
          fce_linear_ce_outputs_t o1 = FCE_LINEAR_CE_OUTPUTS_INIT;
          Tensor l1(DT::F32, {}), dh1(gdt, {1, H}), dw1(gdt, {V, H}), db1(gdt, {V});
          o1.loss = l1.dl(); o1.dhidden = dh1.dl(); o1.dweight = dw1.dl(); o1.dbias = db1.dl();
          FCE_OK(fce_linear_cross_entropy_fwd_workspace_size(h, h1.dl(), weight.dl(), bias.dl(), t1.dl(), nullptr, &o1,
                                                             &one));
        }
        Tensor ws(DT::F32, {int64_t((one * std::max(ws_rows, 1) + 2 * N * 4) / 4 + 64)});
        auto run = [&](uint64_t flags) {
          fce_linear_ce_outputs_t o = FCE_LINEAR_CE_OUTPUTS_INIT;
          o.dhidden = dh.dl(); o.dweight = dw.dl(); o.dbias = db.dl();
          o.flags = flags;
          void* w = ws_rows ? ws.dl()->data : nullptr;
          const size_t wb = ws_rows ? size_t(ws.size()) * 4 : 0;
          if (bwd)
            return fce_linear_cross_entropy_bwd(h, test_stream(), hidden.dl(), weight.dl(), bias.dl(), targets.dl(),
                                                lse.dl(), nullptr, &o, w, wb);
          o.loss = loss.dl();
          return fce_linear_cross_entropy_fwd(h, test_stream(), hidden.dl(), weight.dl(), bias.dl(), targets.dl(),
                                              nullptr, &o, w, wb);
        };
        for (Tensor* t : {&dh, &dw, &db}) { t->poison(); t->upload(); }
        FCE_OK(run(0));
        for (Tensor* t : {&dh, &dw, &db}) t->download();
        const std::vector<double> g[3] = {values(dh), values(dw), values(db)};
        std::vector<double> g0[3];
        int k = 0;
        for (Tensor* t : {&dh, &dw, &db}) {
          for (int64_t r = 0; r < t->rows(); ++r)
            for (int64_t c = 0; c < t->cols(); ++c) t->set(t->dl()->ndim == 1 ? c : r, t->dl()->ndim == 1 ? -1 : c,
                                                          1e-3 * nd(rng()));
          t->upload();
          g0[k++] = values(*t);
        }
        EXPECT_EQ(run(2), FCE_STATUS_INVALID_ARGUMENT);
        EXPECT_NE(std::string(fce_last_error_message()).find("flags"), std::string::npos);
        for (Tensor* t : {&dh, &dw, &db}) t->download();
        for (int j = 0; j < 3; ++j) EXPECT_TRUE(values(j == 0 ? dh : j == 1 ? dw : db) == g0[j]) << "written by a refused call";
        FCE_OK(run(FCE_LINEAR_CE_ACCUMULATE));
        for (Tensor* t : {&dh, &dw, &db}) t->download();
        const double u = gdt == DT::BF16 ? 1.0 / 256 : 1e-6;
        const int64_t chunks = ws_rows ? (N + ws_rows - 1) / ws_rows : 1;
        // Roundings: this call's and the one without the flag (2u of the result), and for a dweight in its
        // own dtype one per chunk, each of a partial sum no larger than its start plus A.
        k = 0;
        for (Tensor* t : {&dh, &dw, &db}) {
          const std::vector<double> got = values(*t);
          for (size_t i = 0; i < got.size(); ++i) {
            const double want = g0[k][i] + g[k][i];
            double tol = 2 * u * (std::fabs(g0[k][i]) + std::fabs(g[k][i])) + 1e-7;
            if (k == 1 && gdt != DT::F32) tol += double(chunks) * u * (std::fabs(g0[k][i]) + A[i]);
            ASSERT_NEAR(got[i], want, tol) << (k == 0 ? "dhidden" : k == 1 ? "dweight" : "dbias") << " " << i;
          }
          ++k;
        }
      }
}

// On CUDA the handle keeps a cuBLASLt plan per GEMM shape, a bounded number of them: more shapes than it
// keeps, each call's outputs the same bits as on a fresh handle (a plan dropped and made again picks the
// same algorithm). And rows with an odd stride (2-byte aligned, which cuBLASLt's algorithms may refuse: the
// call then takes cublasGemmEx) give the contiguous rows' results within a rounding of the bf16 outputs.
TEST(LinearCrossEntropy, ManyShapesOneHandleAndOddStrides) {
  const int64_t H = 32, V = 257, maxN = 70;
  Tensor hidden(DT::BF16, {maxN, H}), weight(DT::BF16, {V, H}), targets(DT::I64, {maxN});
  Tensor wide(DT::BF16, {maxN, H + 1});  // the same rows at a stride of H + 1 elements
  fill_logits(hidden, 1.0, false);
  fill_logits(weight, 0.5, false);
  for (int64_t i = 0; i < maxN; ++i) {
    targets.set_int(i, int64_t(rng()() % uint64_t(V)));
    for (int64_t k = 0; k <= H; ++k) wide.set(i, k, k < H ? hidden.get(i, k) : 0.0);
  }
  targets.upload();
  wide.upload();
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  struct Out {
    std::vector<uint8_t> bits;
    std::vector<double> dh, dw;
  };
  auto call = [&](fce_handle_t h, int64_t N, bool strided) {
    DLTensor hid = *(strided ? wide : hidden).dl(), tg = *targets.dl();
    int64_t hs[2] = {N, H}, hst[2] = {H + 1, 1}, ts[1] = {N};
    hid.shape = hs;
    hid.strides = strided ? hst : nullptr;
    tg.shape = ts;
    Tensor loss(DT::F32, {}), dh(DT::BF16, {N, H}), dw(DT::BF16, {V, H});
    for (Tensor* t : {&loss, &dh, &dw}) { t->poison(); t->upload(); }
    fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
    out.loss = loss.dl(); out.dhidden = dh.dl(); out.dweight = dw.dl();
    EXPECT_EQ(fce_linear_cross_entropy_fwd(h, test_stream(), &hid, weight.dl(), nullptr, &tg, &o, &out, nullptr, 0),
              FCE_STATUS_SUCCESS)
        << fce_last_error_message();
    Out r;
    for (Tensor* t : {&loss, &dh, &dw}) {
      t->download();
      r.bits.insert(r.bits.end(), t->bytes().begin(), t->bytes().end());
    }
    r.dh = values(dh);
    r.dw = values(dw);
    return r;
  };
  Handle shared;
  for (int64_t N = 1; N <= maxN; ++N) call(shared, N, false);
  for (int64_t N : {int64_t(1), int64_t(2), int64_t(37), maxN}) {
    SCOPED_TRACE(::testing::Message() << "N=" << N);
    Handle fresh;
    const Out want = call(fresh, N, false);
    EXPECT_TRUE(call(shared, N, false).bits == want.bits) << "a plan made again changed the bits";
    const Out odd = call(shared, N, true);
    for (auto [got, ref, what] : {std::tuple{&odd.dh, &want.dh, "dhidden"}, std::tuple{&odd.dw, &want.dw, "dweight"}}) {
      double mx = 0;
      for (double v : *ref) mx = std::max(mx, std::fabs(v));
      ASSERT_GT(mx, 0.0);
      for (size_t i = 0; i < ref->size(); ++i)
        ASSERT_NEAR((*got)[i], (*ref)[i], std::fabs((*ref)[i]) / 128 + mx * 1e-3) << what << " " << i;
    }
  }
}
