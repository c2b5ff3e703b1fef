// Vocabulary-parallel linear cross-entropy: the weight split by rows into 1-3 uneven shards (the last padded
// with NaN rows, which nothing may read), each shard's fce_linear_cross_entropy_partial, the records combined
// by fce_cross_entropy_combine, then each shard's fce_linear_cross_entropy_bwd from the combined lse; the
// loss, lse, entropy, argmax and every shard's dweight, dbias and fp32 part of dhidden against float64.
#include "../common/ce_reference.hpp"

using namespace fct;

namespace {

struct Case {
  CeCase ce;  // N, V, dt and options
  int64_t H;
  std::vector<int64_t> widths;  // split_vocabulary's: one entry per shard, the last taking the rest
  int64_t pad = 3;              // padding rows of the last shard
  bool bias = true;
  int64_t ws_rows = 0;  // > 0: a workspace of that many one-token minimums (several chunks); -1: the query's size
};

void run(const Case& k) {
  const CeCase& c = k.ce;
  SCOPED_TRACE(::testing::Message() << "N=" << c.N << " H=" << k.H << " V=" << c.V << " " << dt_name(c.dt)
                                    << " shards=" << k.widths.size() << " red=" << c.reduction << " eps=" << c.eps
                                    << " zq=" << c.zq << " cap=" << c.cap << " weights=" << c.weights
                                    << " ws_rows=" << k.ws_rows);
  Handle h;
  const int64_t N = c.N, V = c.V, H = k.H, K = FCE_CE_RECORD_FIELDS_ALL;
  Tensor hidden(c.dt, {N, H}), weight(c.dt, {V, H}), bias(c.dt, {V});
  fill_logits(hidden, 1.0, false);
  fill_logits(weight, 0.5, c.peaked);
  std::normal_distribution<double> nd(0, 1);
  for (int64_t v = 0; v < V; ++v) bias.set(v, k.bias ? nd(rng()) : 0.0);
  Tensor targets(DT::I64, {N});
  std::vector<int64_t> tg(size_t(N), 0);
  for (int64_t i = 0; i < N; ++i) {
    tg[size_t(i)] = i % 5 == 3 ? -100 : int64_t(rng()() % uint64_t(V));
    targets.set_int(i, tg[size_t(i)]);
  }
  targets.upload();
  std::vector<double> w;
  Tensor weights = class_weights(c, V, w);
  const std::vector<double> hv = values(hidden), wv = values(weight);
  std::vector<double> x(size_t(N * V));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t v = 0; v < V; ++v) {
      double acc = k.bias ? bias.get(v) : 0.0;
      for (int64_t j = 0; j < H; ++j) acc += hv[size_t(i * H + j)] * wv[size_t(v * H + j)];
      x[size_t(i * V + v)] = acc;
    }
  const Ref ref = reference(c, x, tg, w, {});

  const std::vector<Shard> shards = split_vocabulary(V, k.widths, k.pad);
  const int64_t W = int64_t(shards.size());
  fce_ce_options_t o = options_of(c, weights);
  o.vocab_total = V;
  const DLTensor* no_bias = nullptr;

  // Each shard's weight rows (padding rows NaN) and records.
  std::vector<Tensor> ws, bs;
  Records rec(W, N, K);
  for (int64_t r = 0; r < W; ++r) {
    const Shard& s = shards[size_t(r)];
    Tensor wr(c.dt, {s.cols, H}), br(c.dt, {s.cols});
    for (int64_t v = 0; v < s.cols; ++v) {
      br.set(v, v < s.width ? bias.get(s.start + v) : NAN);
      for (int64_t j = 0; j < H; ++j) wr.set(v, j, v < s.width ? weight.get(s.start + v, j) : NAN);
    }
    wr.upload();
    br.upload();
    Tensor one(DT::F32, {N, K});
    one.poison();
    one.upload();
    o.vocab_start = s.start;
    Tensor wsp;
    size_t wsb = 0;
    if (k.ws_rows != 0) {  // a caller's workspace, poisoned (NaN): every logit the records read is written
      Tensor h1(c.dt, {1, H}), t1(DT::I64, {1}), r1(DT::F32, {1, K});
      if (k.ws_rows > 0) {
        FCE_OK(fce_linear_cross_entropy_partial_workspace_size(h, h1.dl(), wr.dl(), k.bias ? br.dl() : no_bias,
                                                               t1.dl(), &o, r1.dl(), &wsb));
        wsb *= size_t(k.ws_rows);
      } else {
        FCE_OK(fce_linear_cross_entropy_partial_workspace_size(h, hidden.dl(), wr.dl(), k.bias ? br.dl() : no_bias,
                                                               targets.dl(), &o, one.dl(), &wsb));
      }
      wsp = Tensor(DT::F32, {int64_t(wsb / 4 + 64)});
      wsp.poison();
      wsp.upload();
    }
    FCE_OK(fce_linear_cross_entropy_partial(h, test_stream(), hidden.dl(), wr.dl(), k.bias ? br.dl() : no_bias,
                                            targets.dl(), &o, one.dl(), k.ws_rows ? wsp.dl()->data : nullptr, wsb));
    one.download();
    for (int64_t i = 0; i < N; ++i)
      std::memcpy(rec.t.raw() + 4 * size_t((r * N + i) * K), one.bytes().data() + 4 * size_t(i * K), 4 * size_t(K));
    ws.push_back(std::move(wr));
    bs.push_back(std::move(br));
  }
  rec.t.upload();

  const bool none = c.reduction == FCE_REDUCTION_NONE;
  Tensor loss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {}), lse(DT::F32, {N}), ent(DT::F32, {N}),
         amax(DT::I64, {N});
  for (Tensor* t : {&loss, &lse, &ent, &amax}) { t->poison(); t->upload(); }
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.lse = lse.dl();
  out.entropy = ent.dl();
  out.argmax = amax.dl();
  FCE_OK(fce_cross_entropy_combine(h, test_stream(), &rec.dl, targets.dl(), &o, &out, nullptr, 0));
  for (Tensor* t : {&loss, &lse, &ent, &amax}) t->download();

  // The logits rounded to the inputs' dtype: the bounds of ce_reference.hpp's linear_ce_grads.
  const double u = logit_roundoff(c.dt);
  const std::vector<double> zabs = scaled_row_max(c, x, N, V);
  auto row_tol = [&](int64_t i) { return linear_row_tol(c, ref, u, zabs, i); };
  double mean_tol = 0;
  for (int64_t i = 0; i < N; ++i) mean_tol = std::max(mean_tol, row_tol(i));
  for (int64_t i = 0; i < N; ++i) {
    ASSERT_TRUE(close(lse.get(i), ref.lse[size_t(i)], 1e-5, row_tol(i))) << "lse " << i;
    ASSERT_TRUE(close(ent.get(i), ref.ent[size_t(i)], 1e-4, 4 * row_tol(i))) << "entropy " << i;
    // The argmax: a column whose exact logit is within the rounding of the row's largest.
    const int64_t a = amax.get_int(i);
    ASSERT_TRUE(a >= 0 && a < V) << "argmax " << i;
    ASSERT_LE(x[size_t(i * V + ref.amax[size_t(i)])] - x[size_t(i * V + a)], 2 * u * zabs[size_t(i)] / c.scale + 1e-9)
        << "argmax " << i;
    if (none) {
      ASSERT_TRUE(close(loss.get(i), ref.loss[size_t(i)], 1e-4, row_tol(i))) << "loss " << i;
    }
  }
  if (!none) {
    ASSERT_TRUE(close(loss.get(0), ref.total, 1e-4, mean_tol));
  }

  // Each shard's gradients from the combined lse against the float64 ones of its rows (linear_ce_grads'
  // bounds, as test_linear_ce).
  for (int64_t r = 0; r < W; ++r) {
    const Shard& s = shards[size_t(r)];
    SCOPED_TRACE(::testing::Message() << "shard " << r);
    Tensor dh(DT::F32, {N, H}), dw(c.dt, {s.cols, H}), db(c.dt, {s.cols});
    for (Tensor* t : {&dh, &dw, &db}) { t->poison(); t->upload(); }
    fce_linear_ce_outputs_t ob = FCE_LINEAR_CE_OUTPUTS_INIT;
    ob.dhidden = dh.dl();
    ob.dweight = dw.dl();
    if (k.bias) ob.dbias = db.dl();
    o.vocab_start = s.start;
    FCE_OK(fce_linear_cross_entropy_bwd(h, test_stream(), hidden.dl(), ws[size_t(r)].dl(),
                                        k.bias ? bs[size_t(r)].dl() : no_bias, targets.dl(), lse.dl(), &o, &ob,
                                        nullptr, 0));
    for (Tensor* t : {&dh, &dw, &db}) t->download();
    const LinearCeGrads rg = linear_ce_grads(c, ref, x, tg, hv, wv, zabs, N, V, H, s.start, s.width);
    const std::vector<double> &rdh = rg.dh, &adh = rg.adh, &rdw = rg.dw, &adw = rg.adw, &rdb = rg.db, &adb = rg.adb;
    const double uo = c.dt == DT::BF16 ? 1.0 / 256 : c.dt == DT::F16 ? 1.0 / 2048 : 0.0;  // dweight's rounding
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < H; ++j)
        ASSERT_TRUE(close(dh.get(i, j), rdh[size_t(i * H + j)], 1e-3, 1e-6 + u * adh[size_t(i * H + j)]))
            << "dhidden (" << i << "," << j << ")";
    for (int64_t v = 0; v < s.cols; ++v)
      for (int64_t j = 0; j < H; ++j) {
        if (v >= s.width) {
          ASSERT_EQ(dw.get(v, j), 0.0) << "dweight padding row " << v;
          continue;
        }
        ASSERT_TRUE(close(dw.get(v, j), rdw[size_t(v * H + j)], dtype_rtol(c.dt) + 1e-3,
                          1e-6 + (u + uo) * adw[size_t(v * H + j)]))
            << "dweight (" << v << "," << j << ")";
      }
    if (k.bias)
      for (int64_t v = 0; v < s.cols; ++v) {
        if (v >= s.width) {
          ASSERT_EQ(db.get(v), 0.0) << "dbias padding " << v;
          continue;
        }
        ASSERT_TRUE(close(db.get(v), rdb[size_t(v)], dtype_rtol(c.dt) + 1e-3, 1e-6 + (u + uo) * adb[size_t(v)]))
            << "dbias " << v;
      }
  }
}

}  // namespace

TEST(LinearCeVocabParallel, ShardsDtypesOptions) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16})
    for (int red : {FCE_REDUCTION_MEAN, FCE_REDUCTION_NONE}) {
      Case k{CeCase{23, 331, dt}, 40, {150, 0}};  // two shards
      k.ce.reduction = red;
      run(k);
      k.widths = {100, 7, 0};  // three uneven shards
      k.ce.eps = 0.1;
      k.ce.zq = 1e-3;
      k.ce.cap = 10;
      k.ce.scale = 0.8;
      k.ce.weights = red == FCE_REDUCTION_MEAN;
      k.bias = red == FCE_REDUCTION_NONE;
      run(k);
      k.ws_rows = -1;
      run(k);
    }
}

TEST(LinearCeVocabParallel, OneShardAndChunks) {
  Case k{CeCase{37, 257, DT::BF16}, 32, {0}};  // one shard: the whole vocabulary, padded
  k.ce.reduction = FCE_REDUCTION_SUM;
  run(k);
  k.widths = {128, 0};
  k.ws_rows = 5;  // several token chunks
  run(k);
}

// Validation: the unsharded forward refuses a shard; the partial needs one and records of a record width; a
// shard's dhidden must be fp32; nothing is written when a call is refused.
TEST(LinearCeVocabParallel, Validation) {
  Handle h;
  const int64_t N = 4, H = 8, V = 10;
  Tensor hidden(DT::BF16, {N, H}), weight(DT::BF16, {V, H}), targets(DT::I64, {N}), lse(DT::F32, {N});
  fill_logits(hidden, 1.0, false);
  fill_logits(weight, 1.0, false);
  for (int64_t i = 0; i < N; ++i) targets.set_int(i, i);
  targets.upload();
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.vocab_start = 10;
  o.vocab_total = 25;
  Tensor loss(DT::F32, {});
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  EXPECT_EQ(fce_linear_cross_entropy_fwd(h, test_stream(), hidden.dl(), weight.dl(), nullptr, targets.dl(), &o, &out,
                                         nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_last_error_message()).find("fce_linear_cross_entropy_partial"), std::string::npos);

  Tensor rec(DT::F32, {N, 5});
  rec.poison();
  rec.upload();
  EXPECT_EQ(fce_linear_cross_entropy_partial(h, test_stream(), hidden.dl(), weight.dl(), nullptr, targets.dl(), &o,
                                             rec.dl(), nullptr, 0),
            FCE_STATUS_SHAPE_MISMATCH);
  Tensor rec4(DT::F32, {N, 4});
  rec4.poison();
  rec4.upload();
  fce_ce_options_t plain = FCE_CE_OPTIONS_INIT;
  EXPECT_EQ(fce_linear_cross_entropy_partial(h, test_stream(), hidden.dl(), weight.dl(), nullptr, targets.dl(),
                                             &plain, rec4.dl(), nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  rec4.download();
  for (uint8_t b : rec4.bytes()) ASSERT_EQ(b, 0xff);

  Tensor dh(DT::BF16, {N, H});
  dh.poison();
  dh.upload();
  fce_linear_ce_outputs_t ob = FCE_LINEAR_CE_OUTPUTS_INIT;
  ob.dhidden = dh.dl();
  EXPECT_EQ(fce_linear_cross_entropy_bwd(h, test_stream(), hidden.dl(), weight.dl(), nullptr, targets.dl(), lse.dl(),
                                         &o, &ob, nullptr, 0),
            FCE_STATUS_UNSUPPORTED_DTYPE);
  dh.download();
  for (uint8_t b : dh.bytes()) ASSERT_EQ(b, 0xff);
  // NCCL mode needs a communicator.
  EXPECT_EQ(fce_linear_cross_entropy_fwd_vp(h, nullptr, test_stream(), hidden.dl(), weight.dl(), nullptr,
                                            targets.dl(), &o, &out, nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
}
