// Vocabulary-parallel cross-entropy: logits split into shards (even, uneven, padded), a partial call per
// shard, the records concatenated in rank order, combined, and each shard's gradient from the combined lse;
// against the float64 reference written in the tests and against the unsharded call.
#include <algorithm>

#include "common/ce_reference.hpp"

using namespace fct;

namespace {

struct Case {
  CeCase ce;
  std::vector<int64_t> widths;
  int64_t pad = 0;
  bool nan_row = false;  // a NaN in row 1, in the second shard
  bool out_of_range = false;  // row 0's target is V (not ignored): NaN loss and gradient
};

void run(const Case& k) {
  const CeCase& c = k.ce;
  const int64_t N = c.N, V = c.V, K = FCE_CE_RECORD_FIELDS_ALL;
  Handle h;
  Tensor full(c.dt, {N, V});
  fill_logits(full, c.logit_std, c.peaked);
  const std::vector<Shard> shards = split_vocabulary(V, k.widths, k.pad);
  const int64_t W = int64_t(shards.size());
  if (k.nan_row) {
    full.set(1, shards[1].start + 1, NAN);
    full.upload();
  }
  Tensor targets(c.tdt, {N});
  std::uniform_int_distribution<int64_t> col(0, V - 1);
  std::bernoulli_distribution ign(c.ignore_frac);
  std::vector<int64_t> tg(N);
  for (int64_t i = 0; i < N; ++i) {
    tg[i] = ign(rng()) ? -100 : col(rng());
    if (k.out_of_range && i == 0) tg[i] = V;
    targets.set_int(i, tg[i]);
  }
  targets.upload();
  std::vector<double> w;
  Tensor weights = class_weights(c, V, w);
  std::vector<int64_t> tg_ref = tg;
  if (k.out_of_range) tg_ref[0] = -100;  // the reference cannot index it; row 0 is checked apart
  Ref ref = reference(c, values(full), tg_ref, w, {});
  // The library's mean counts an out-of-range target's row (its loss is NaN); the reference skipped it.
  if (k.out_of_range && c.reduction == FCE_REDUCTION_MEAN && ref.denom > 0)
    for (double& g : ref.grad) g *= ref.denom / (ref.denom + 1.0);

  fce_ce_options_t o = options_of(c, weights);
  o.vocab_total = V;
  int64_t fields = 0;
  FCE_OK(fce_cross_entropy_record_fields(&o, &fields));
  ASSERT_EQ(fields, K);

  // Each shard: its columns (padding filled with NaN, which no sum may read), then its records.
  std::vector<Tensor> parts;
  Records rec(W, N, K);
  rec.t.poison();
  for (int64_t r = 0; r < W; ++r) {
    const Shard& s = shards[size_t(r)];
    Tensor part(c.dt, {N, s.cols});
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < s.cols; ++j) part.set(i, j, j < s.width ? full.get(i, s.start + j) : NAN);
    part.upload();
    Tensor one(DT::F32, {N, K});
    one.poison();
    one.upload();
    o.vocab_start = s.start;
    FCE_OK(fce_cross_entropy_partial(h, test_stream(), part.dl(), targets.dl(), &o, one.dl()));
    one.download();
    for (int64_t i = 0; i < N; ++i)
      std::memcpy(rec.t.raw() + 4 * size_t((r * N + i) * K), one.bytes().data() + 4 * size_t(i * K), 4 * size_t(K));
    parts.push_back(std::move(part));
  }
  rec.t.upload();

  const bool none = c.reduction == FCE_REDUCTION_NONE;
  Tensor loss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {}), lse(DT::F32, {N}), ent(DT::F32, {N}),
         amax(DT::I64, {N}), zl = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {});
  for (Tensor* t : {&loss, &lse, &ent, &amax, &zl}) { t->poison(); t->upload(); }
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.lse = lse.dl();
  out.entropy = ent.dl();
  out.argmax = amax.dl();
  out.z_loss = zl.dl();
  FCE_OK(fce_cross_entropy_combine(h, test_stream(), &rec.dl, targets.dl(), &o, &out, nullptr, 0));
  for (Tensor* t : {&loss, &lse, &ent, &amax, &zl}) t->download();

  // The unsharded call on the same logits: argmax and the special rows must match it bitwise.
  fce_ce_options_t u = o;
  u.vocab_start = u.vocab_total = 0;
  Tensor uloss = none ? Tensor(DT::F32, {N}) : Tensor(DT::F32, {}), ulse(DT::F32, {N}), uamax(DT::I64, {N});
  fce_ce_outputs_t uo = FCE_CE_OUTPUTS_INIT;
  uo.loss = uloss.dl();
  uo.lse = ulse.dl();
  uo.argmax = uamax.dl();
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), full.dl(), targets.dl(), &u, &uo, nullptr, 0));
  for (Tensor* t : {&uloss, &ulse, &uamax}) t->download();

  const double rt = 2e-5, at = 2e-5;
  for (int64_t i = 0; i < N; ++i) {
    SCOPED_TRACE(testing::Message() << "row " << i << " target " << tg[i]);
    EXPECT_EQ(amax.get_int(i), uamax.get_int(i));
    if (k.nan_row && i == 1) {
      EXPECT_TRUE(std::isnan(lse.get(i)));
      EXPECT_TRUE(std::isnan(ent.get(i)));
      EXPECT_EQ(amax.get_int(i), shards[1].start + 1);
      if (none && tg[i] != -100) {
        EXPECT_TRUE(std::isnan(loss.get(i)));
      }
      continue;
    }
    EXPECT_TRUE(close(lse.get(i), ref.lse[size_t(i)], rt, at));
    EXPECT_TRUE(close(ent.get(i), ref.ent[size_t(i)], 1e-4, 1e-4));
    EXPECT_EQ(amax.get_int(i), ref.amax[size_t(i)]);
    if (!none) continue;
    if (k.out_of_range && i == 0) {
      EXPECT_TRUE(std::isnan(loss.get(i)));
      continue;
    }
    EXPECT_TRUE(close(loss.get(i), ref.loss[size_t(i)], rt, at));
    EXPECT_TRUE(close(zl.get(i), ref.zl[size_t(i)], rt, 1e-9));
    if (tg[i] == -100) {
      EXPECT_EQ(loss.get(i), 0.0);
    }
  }
  if (!none && !k.nan_row && !k.out_of_range) {
    EXPECT_TRUE(close(loss.get(0), ref.total, rt, at));
    EXPECT_TRUE(close(loss.get(0), uloss.get(0), rt, at));
  }
  if ((k.nan_row && !none) || (k.out_of_range && !none)) {
    EXPECT_TRUE(std::isnan(loss.get(0)));
  }

  // Each shard's gradient from the combined lse: its columns of the reference gradient, padding 0.
  for (int64_t r = 0; r < W; ++r) {
    const Shard& s = shards[size_t(r)];
    Tensor dl(c.dt, {N, s.cols});
    dl.poison();
    dl.upload();
    o.vocab_start = s.start;
    FCE_OK(fce_cross_entropy_bwd(h, test_stream(), parts[size_t(r)].dl(), targets.dl(), lse.dl(), nullptr, &o,
                                 dl.dl(), nullptr, 0));
    dl.download();
    const double gt = dtype_rtol(c.dt);
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t j = 0; j < s.cols; ++j) {
        SCOPED_TRACE(testing::Message() << "shard " << r << " row " << i << " column " << j);
        if (j >= s.width) {
          if (!(k.out_of_range && i == 0)) {
            EXPECT_EQ(dl.get(i, j), 0.0);
          }
          continue;
        }
        if ((k.out_of_range && i == 0) || (k.nan_row && i == 1 && tg[i] != -100)) {
          EXPECT_TRUE(std::isnan(dl.get(i, j)));
          continue;
        }
        if (k.nan_row && i == 1) continue;
        EXPECT_TRUE(close(dl.get(i, j), ref.grad[size_t(i * V + s.start + j)], gt, 1e-6));
      }
    }
  }
}

}  // namespace

TEST(VocabParallel, ShardsDtypesOptions) {
  struct S {
    std::vector<int64_t> widths;
    int64_t pad;
  };
  const S layouts[] = {{{500}, 0}, {{300, 400}, 0}, {{1, 517}, 7}, {{64, 64, 64}, 3}};
  for (const S& l : layouts) {
    for (DT dt : {DT::F32, DT::BF16, DT::F16}) {
      for (int red : {FCE_REDUCTION_NONE, FCE_REDUCTION_SUM, FCE_REDUCTION_MEAN}) {
        Case k;
        k.ce.N = 37;
        k.ce.V = 1031;  // prime
        k.ce.dt = dt;
        k.ce.reduction = red;
        k.widths = l.widths;
        k.pad = l.pad;
        SCOPED_TRACE(testing::Message() << dt_name(dt) << " reduction " << red << " shards " << l.widths.size()
                                        << " pad " << l.pad);
        run(k);
      }
    }
  }
}

TEST(VocabParallel, EveryOption) {
  Case k;
  k.ce.N = 19;
  k.ce.V = 777;
  k.ce.reduction = FCE_REDUCTION_NONE;
  k.ce.eps = 0.1;
  k.ce.zq = 1e-3;
  k.ce.cap = 3.0;
  k.ce.scale = 0.7;
  k.ce.weights = true;
  k.ce.peaked = true;
  k.widths = {200, 300};
  k.pad = 5;
  run(k);
  k.ce.reduction = FCE_REDUCTION_MEAN;
  k.ce.tdt = DT::I32;
  run(k);
}

// Qwen's V = 151936 over 3 and 7 ranks, Megatron's split (issue 29's uneven shards, checked here on one device).
TEST(VocabParallel, ManyRanksMegatronSplit) {
  for (int64_t W : {3, 7}) {
    for (DT dt : {DT::BF16, DT::F32}) {
      Case k;
      k.ce.N = 5;
      k.ce.V = 151936;
      k.ce.dt = dt;
      k.ce.reduction = dt == DT::BF16 ? FCE_REDUCTION_NONE : FCE_REDUCTION_MEAN;
      k.ce.eps = 0.1;
      k.ce.zq = 1e-4;
      const EvenSplit e = megatron_split(k.ce.V, W);
      k.widths = e.widths;
      k.pad = e.pad;
      k.nan_row = dt == DT::BF16;
      SCOPED_TRACE(testing::Message() << dt_name(dt) << " over " << W << " ranks, pad " << e.pad);
      run(k);
    }
  }
}

TEST(VocabParallel, NaNOutOfRangeAndAllIgnored) {
  Case k;
  k.ce.N = 6;
  k.ce.V = 300;
  k.ce.reduction = FCE_REDUCTION_NONE;
  k.widths = {100, 100};
  k.nan_row = true;
  run(k);
  k.nan_row = false;
  k.out_of_range = true;
  run(k);
  k.ce.reduction = FCE_REDUCTION_MEAN;
  run(k);
  k.out_of_range = false;
  k.ce.ignore_frac = 1.0;  // every row ignored: the mean is 0, as unsharded
  run(k);
}

// Narrow records (4 and 5 fields) are the full record's prefix, bit for bit, and combine to the same bits as
// the full width; the combine refuses outputs a width does not hold.
void run_narrow(const CeCase& c, const std::vector<int64_t>& widths, int64_t pad) {
  const int64_t N = c.N, V = c.V;
  Handle h;
  Tensor full(c.dt, {N, V});
  fill_logits(full, c.logit_std, c.peaked);
  const std::vector<Shard> shards = split_vocabulary(V, widths, pad);
  const int64_t W = int64_t(shards.size());
  Tensor targets(c.tdt, {N});
  for (int64_t i = 0; i < N; ++i) targets.set_int(i, i % 5 == 3 ? -100 : (i * 7919) % V);
  targets.upload();
  Tensor weights;
  if (c.weights) {
    weights = Tensor(DT::F32, {V});
    for (int64_t j = 0; j < V; ++j) weights.set(j, 0.5 + double(j % 7) / 4);
    weights.upload();
  }
  fce_ce_options_t o = options_of(c, weights);
  o.vocab_total = V;
  const int64_t widths_k[] = {FCE_CE_RECORD_FIELDS_LOSS, FCE_CE_RECORD_FIELDS_ENTROPY, FCE_CE_RECORD_FIELDS_ALL};
  std::vector<Records> recs;
  for (int64_t K : widths_k) recs.emplace_back(W, N, K);
  for (int64_t r = 0; r < W; ++r) {
    const Shard& s = shards[size_t(r)];
    Tensor part(c.dt, {N, s.cols});
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < s.cols; ++j) part.set(i, j, j < s.width ? full.get(i, s.start + j) : NAN);
    part.upload();
    o.vocab_start = s.start;
    for (size_t q = 0; q < 3; ++q) {
      const int64_t K = widths_k[q];
      Tensor one(DT::F32, {N, K});
      one.poison();
      one.upload();
      FCE_OK(fce_cross_entropy_partial(h, test_stream(), part.dl(), targets.dl(), &o, one.dl()));
      one.download();
      std::memcpy(recs[q].t.raw() + 4 * size_t(r * N * K), one.bytes().data(), 4 * size_t(N * K));
    }
  }
  for (int64_t i = 0; i < W * N; ++i)
    for (size_t q = 0; q < 2; ++q)
      for (int64_t f = 0; f < widths_k[q]; ++f) {
        SCOPED_TRACE(testing::Message() << "record " << i << " field " << f << " width " << widths_k[q]);
        const float a = recs[q].t.get(i, f), b = recs[2].t.get(i, f);
        EXPECT_EQ(std::memcmp(&a, &b, 4), 0) << a << " vs " << b;
      }
  // Combine each width: loss, lse and z-loss (all widths), entropy (5 and 7).
  const bool none = c.reduction == FCE_REDUCTION_NONE;
  std::vector<std::vector<Tensor>> got;
  for (size_t q = 0; q < 3; ++q) {
    recs[q].t.upload();
    std::vector<Tensor> t;
    t.emplace_back(DT::F32, none ? std::vector<int64_t>{N} : std::vector<int64_t>{});
    t.emplace_back(DT::F32, std::vector<int64_t>{N});
    t.emplace_back(DT::F32, none ? std::vector<int64_t>{N} : std::vector<int64_t>{});
    t.emplace_back(DT::F32, std::vector<int64_t>{N});
    for (Tensor& x : t) { x.poison(); x.upload(); }
    fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
    out.loss = t[0].dl();
    out.lse = t[1].dl();
    out.z_loss = t[2].dl();
    Tensor amax(DT::I64, {N});
    out.argmax = q < 2 ? amax.dl() : nullptr;
    if (q < 2) {  // argmax needs the full width
      EXPECT_EQ(fce_cross_entropy_combine(h, test_stream(), &recs[q].dl, targets.dl(), &o, &out, nullptr, 0),
                FCE_STATUS_INVALID_ARGUMENT);
      EXPECT_NE(std::string(fce_last_error_message()).find("argmax"), std::string::npos);
      out.argmax = nullptr;
    }
    out.entropy = t[3].dl();
    if (q == 0) {  // the entropy needs 5 fields
      EXPECT_EQ(fce_cross_entropy_combine(h, test_stream(), &recs[q].dl, targets.dl(), &o, &out, nullptr, 0),
                FCE_STATUS_INVALID_ARGUMENT);
      EXPECT_NE(std::string(fce_last_error_message()).find("entropy"), std::string::npos);
      out.entropy = nullptr;
    }
    for (Tensor& x : t) x.download();
    for (uint8_t b : t[0].bytes()) ASSERT_EQ(b, 0xff) << "written on a failed call";
    FCE_OK(fce_cross_entropy_combine(h, test_stream(), &recs[q].dl, targets.dl(), &o, &out, nullptr, 0));
    for (Tensor& x : t) x.download();
    got.push_back(std::move(t));
  }
  for (size_t q = 0; q < 2; ++q)
    for (size_t k = 0; k < 4; ++k) {
      if (k == 3 && q == 0) continue;
      SCOPED_TRACE(testing::Message() << "width " << widths_k[q] << " output " << k);
      EXPECT_EQ(got[q][k].bytes(), got[2][k].bytes());
    }
}

TEST(VocabParallel, NarrowRecords) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16}) {
    CeCase c;
    c.N = 23;
    c.V = 1031;
    c.dt = dt;
    c.reduction = FCE_REDUCTION_NONE;
    SCOPED_TRACE(dt_name(dt));
    run_narrow(c, {400, 300}, 5);
    c.reduction = FCE_REDUCTION_MEAN;
    c.eps = 0.1;
    c.zq = 1e-3;
    c.cap = 3.0;
    c.weights = true;
    run_narrow(c, {1, 600}, 0);
  }
}

TEST(VocabParallel, Validation) {
  Handle h;
  Tensor x(DT::F32, {3, 10}), t(DT::I64, {3}), rec(DT::F32, {3, FCE_CE_RECORD_FIELDS_ALL}), bad(DT::F32, {3, 8});
  fill_logits(x, 1.0, false);
  for (int64_t i = 0; i < 3; ++i) t.set_int(i, i);
  t.upload();
  rec.poison();
  rec.upload();
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  // Not a shard: partial refuses, and nothing is written.
  EXPECT_EQ(fce_cross_entropy_partial(h, test_stream(), x.dl(), t.dl(), &o, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_last_error_message()).find("vocab_total"), std::string::npos);
  EXPECT_EQ(fce_cross_entropy_partial(h, test_stream(), x.dl(), t.dl(), nullptr, rec.dl()),
            FCE_STATUS_INVALID_ARGUMENT);
  o.vocab_total = 20;
  o.vocab_start = 21;  // outside [0, vocab_total] (vocab_total itself: a shard of padding alone)
  EXPECT_EQ(fce_cross_entropy_partial(h, test_stream(), x.dl(), t.dl(), &o, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);
  o.vocab_total = int64_t(INT32_MAX) + 1;  // the records hold int32 columns
  o.vocab_start = 0;
  EXPECT_EQ(fce_cross_entropy_partial(h, test_stream(), x.dl(), t.dl(), &o, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);
  o.vocab_total = 20;
  o.vocab_start = -1;
  EXPECT_EQ(fce_cross_entropy_partial(h, test_stream(), x.dl(), t.dl(), &o, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);
  o.vocab_start = 10;
  EXPECT_EQ(fce_cross_entropy_partial(h, test_stream(), x.dl(), t.dl(), &o, bad.dl()), FCE_STATUS_SHAPE_MISMATCH);
  rec.download();
  for (uint8_t b : rec.bytes()) ASSERT_EQ(b, 0xff) << "written on a failed call";
  // A vocab_start without a vocab_total.
  fce_ce_options_t s = FCE_CE_OPTIONS_INIT;
  s.vocab_start = 3;
  EXPECT_EQ(fce_cross_entropy_partial(h, test_stream(), x.dl(), t.dl(), &s, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);
  // The unsharded forward refuses a shard; the combine refuses dlogits and records of the wrong K.
  Tensor loss(DT::F32, {});
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  EXPECT_EQ(fce_cross_entropy_fwd(h, test_stream(), x.dl(), t.dl(), &o, &out, nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  Records r(2, 3, FCE_CE_RECORD_FIELDS_ALL);
  out.dlogits = x.dl();
  EXPECT_EQ(fce_cross_entropy_combine(h, test_stream(), &r.dl, t.dl(), &o, &out, nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  out.dlogits = nullptr;
  for (int64_t k : {4, 5, 8}) {  // 4: the library's own records without a range, never a caller's
    r.shape[2] = k;
    EXPECT_EQ(fce_cross_entropy_combine(h, test_stream(), &r.dl, t.dl(), &o, &out, nullptr, 0),
              FCE_STATUS_SHAPE_MISMATCH);
  }
  r.shape[2] = FCE_CE_RECORD_FIELDS_ALL;
  size_t bytes = 1;
  FCE_OK(fce_cross_entropy_combine_workspace_size(h, &r.dl, t.dl(), &o, &out, &bytes));
  if (target().cuda()) {
    EXPECT_GE(bytes, 2 * sizeof(double) + 2 * 3 * sizeof(float));  // prep, and the rows of the mean
  } else {
    EXPECT_EQ(bytes, 0u);
  }
  // Class weights cover the whole vocabulary.
  Tensor wshard(DT::F32, {10});
  o.class_weights = wshard.dl();
  EXPECT_EQ(fce_cross_entropy_partial(h, test_stream(), x.dl(), t.dl(), &o, rec.dl()), FCE_STATUS_SHAPE_MISMATCH);
  // The unsharded linear cross-entropy forward refuses a shard (its partial is another call).
  o.class_weights = nullptr;
  Tensor hid(DT::F32, {3, 4}), wt(DT::F32, {10, 4});
  fce_linear_ce_outputs_t lo = FCE_LINEAR_CE_OUTPUTS_INIT;
  lo.loss = loss.dl();
  EXPECT_EQ(fce_linear_cross_entropy_fwd(h, test_stream(), hid.dl(), wt.dl(), nullptr, t.dl(), &o, &lo, nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
}

namespace {

// Logsumexp over shards (fce_logsumexp_partial, _combine), then each shard's temperature softmax from the
// whole rows' lse, against float64 and the unsharded fce_logsumexp / fce_temp_softmax. Rows 0-2 (with
// `special`): a NaN in the last shard, a +inf, all -inf.
void run_lse_softmax(DT dt, DT out_dt, double T, const std::vector<int64_t>& widths, int64_t pad, bool special) {
  SCOPED_TRACE(testing::Message() << dt_name(dt) << " -> " << dt_name(out_dt) << " T " << T << " shards "
                                  << widths.size() << " pad " << pad << (special ? " special" : ""));
  const int64_t N = 11, V = 1031;
  Handle h;
  Tensor x(dt, {N, V});
  fill_logits(x, 3.0, true, 12.0);
  const std::vector<Shard> shards = split_vocabulary(V, widths, pad);
  const int64_t W = int64_t(shards.size());
  if (special) {
    x.set(0, shards.back().start, NAN);
    x.set(1, 5, INFINITY);
    for (int64_t j = 0; j < V; ++j) x.set(2, j, -INFINITY);
    x.upload();
  }
  const double s = 1.0 / T;
  fce_lse_options_t lo = FCE_LSE_OPTIONS_INIT;
  lo.scale = float(s);
  lo.vocab_total = V;
  Records rec(W, N, FCE_LSE_RECORD_FIELDS);
  std::vector<Tensor> parts;
  for (int64_t r = 0; r < W; ++r) {
    const Shard& sh = shards[size_t(r)];
    Tensor part(dt, {N, sh.cols});
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < sh.cols; ++j) part.set(i, j, j < sh.width ? x.get(i, sh.start + j) : NAN);
    part.upload();
    Tensor one(DT::F32, {N, FCE_LSE_RECORD_FIELDS});
    one.poison();
    one.upload();
    lo.vocab_start = sh.start;
    FCE_OK(fce_logsumexp_partial(h, test_stream(), part.dl(), &lo, one.dl()));
    one.download();
    std::memcpy(rec.t.raw() + 4 * size_t(r * N * FCE_LSE_RECORD_FIELDS), one.bytes().data(),
                4 * size_t(N * FCE_LSE_RECORD_FIELDS));
    parts.push_back(std::move(part));
  }
  rec.t.upload();
  Tensor lse(DT::F32, {N}), ulse(DT::F32, {N});
  lse.poison();
  lse.upload();
  FCE_OK(fce_logsumexp_combine(h, test_stream(), &rec.dl, lse.dl()));
  lse.download();
  fce_lse_options_t uo = FCE_LSE_OPTIONS_INIT;
  uo.scale = float(s);
  FCE_OK(fce_logsumexp(h, test_stream(), x.dl(), &uo, ulse.dl(), nullptr, 0));
  ulse.download();
  for (int64_t i = 0; i < N; ++i) {
    SCOPED_TRACE(testing::Message() << "row " << i);
    if (special && i < 3) {
      EXPECT_TRUE(i == 0 ? std::isnan(lse.get(i)) : lse.get(i) == (i == 1 ? INFINITY : -INFINITY)) << lse.get(i);
      EXPECT_TRUE(close(lse.get(i), ulse.get(i), 0, 0)) << "unsharded";
      continue;
    }
    double m = -INFINITY, d = 0;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, double(float(x.get(i, j) * float(s))));
    for (int64_t j = 0; j < V; ++j) d += std::exp(double(float(x.get(i, j) * float(s))) - m);
    EXPECT_TRUE(close(lse.get(i), m + std::log(d), 4e-7, 1e-6));
    EXPECT_TRUE(close(lse.get(i), ulse.get(i), 4e-7, 1e-6)) << "unsharded";
  }
  // Each shard's probabilities and log-probabilities from the combined lse.
  Tensor up(out_dt, {N, V}), ulp(out_dt, {N, V});
  fce_softmax_options_t so = FCE_SOFTMAX_OPTIONS_INIT;
  so.temperature = float(T);
  FCE_OK(fce_temp_softmax(h, test_stream(), x.dl(), &so, up.dl(), ulp.dl(), nullptr, 0));
  up.download();
  ulp.download();
  so.vocab_total = V;
  so.lse = lse.dl();
  const double rt = dtype_rtol(out_dt) + 1e-5;
  for (int64_t r = 0; r < W; ++r) {
    const Shard& sh = shards[size_t(r)];
    Tensor pr(out_dt, {N, sh.cols}), lp(out_dt, {N, sh.cols});
    for (Tensor* t : {&pr, &lp}) { t->poison(); t->upload(); }
    so.vocab_start = sh.start;
    FCE_OK(fce_temp_softmax(h, test_stream(), parts[size_t(r)].dl(), &so, pr.dl(), lp.dl(), nullptr, 0));
    pr.download();
    lp.download();
    for (int64_t i = special ? 3 : 0; i < N; ++i)
      for (int64_t j = 0; j < sh.cols; ++j) {
        SCOPED_TRACE(testing::Message() << "shard " << r << " row " << i << " column " << j);
        if (j >= sh.width) {
          ASSERT_EQ(pr.get(i, j), 0.0);
          ASSERT_EQ(lp.get(i, j), -INFINITY);
          continue;
        }
        const double want = double(float(x.get(i, sh.start + j) * float(s))) - lse.get(i);
        ASSERT_TRUE(close(lp.get(i, j), want, rt, rt * (1 + std::fabs(lse.get(i)))));
        ASSERT_TRUE(close(pr.get(i, j), std::exp(want), rt, 1e-7));
        ASSERT_TRUE(close(pr.get(i, j), up.get(i, sh.start + j), rt, 1e-7)) << "unsharded";
      }
  }
}

}  // namespace

TEST(VocabParallel, LogsumexpAndSoftmaxShards) {
  for (DT dt : {DT::F32, DT::BF16, DT::F16})
    for (double T : {0.7, 1.0, 2.0}) run_lse_softmax(dt, DT::F32, T, {400, 300}, 5, false);
  run_lse_softmax(DT::BF16, DT::BF16, 1.0, {1, 700}, 0, false);
  run_lse_softmax(DT::F32, DT::F32, 1.0, {64, 64, 64}, 3, true);
  run_lse_softmax(DT::F32, DT::F32, 1.0, {1031}, 0, true);
}

TEST(VocabParallel, LogsumexpAndSoftmaxValidation) {
  Handle h;
  Tensor x(DT::F32, {3, 10}), rec(DT::F32, {3, FCE_LSE_RECORD_FIELDS}), bad(DT::F32, {3, 3}), lse(DT::F32, {3});
  fill_logits(x, 1.0, false);
  rec.poison();
  rec.upload();
  fce_lse_options_t lo = FCE_LSE_OPTIONS_INIT;
  EXPECT_EQ(fce_logsumexp_partial(h, test_stream(), x.dl(), &lo, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);  // no shard
  EXPECT_EQ(fce_logsumexp_partial(h, test_stream(), x.dl(), nullptr, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);
  lo.vocab_total = 20;
  lo.vocab_start = 21;
  EXPECT_EQ(fce_logsumexp_partial(h, test_stream(), x.dl(), &lo, rec.dl()), FCE_STATUS_INVALID_ARGUMENT);
  lo.vocab_start = 10;
  EXPECT_EQ(fce_logsumexp_partial(h, test_stream(), x.dl(), &lo, bad.dl()), FCE_STATUS_SHAPE_MISMATCH);
  rec.download();
  for (uint8_t b : rec.bytes()) ASSERT_EQ(b, 0xff) << "written on a failed call";
  EXPECT_EQ(fce_logsumexp(h, test_stream(), x.dl(), &lo, lse.dl(), nullptr, 0), FCE_STATUS_INVALID_ARGUMENT);
  fce_lse_options_t old = FCE_LSE_OPTIONS_INIT;  // 0.1.0's struct is still taken
  old.struct_size = uint32_t(offsetof(fce_lse_options_t, vocab_start));
  FCE_OK(fce_logsumexp(h, test_stream(), x.dl(), &old, lse.dl(), nullptr, 0));
  Records r(2, 3, 3);
  EXPECT_EQ(fce_logsumexp_combine(h, test_stream(), &r.dl, lse.dl()), FCE_STATUS_SHAPE_MISMATCH);
  // The softmax of a shard: one finite temperature > 0, and the whole rows' lse.
  Tensor pr(DT::F32, {3, 10}), temps(DT::F32, {3});
  pr.poison();
  pr.upload();
  fce_softmax_options_t so = FCE_SOFTMAX_OPTIONS_INIT;
  so.vocab_total = 20;
  so.vocab_start = 10;
  EXPECT_EQ(fce_temp_softmax(h, test_stream(), x.dl(), &so, pr.dl(), nullptr, nullptr, 0), FCE_STATUS_INVALID_ARGUMENT);
  so.lse = lse.dl();
  so.temperature = 0.f;
  EXPECT_EQ(fce_temp_softmax(h, test_stream(), x.dl(), &so, pr.dl(), nullptr, nullptr, 0), FCE_STATUS_NOT_IMPLEMENTED);
  so.temperature = 1.f;
  so.temperatures = temps.dl();
  EXPECT_EQ(fce_temp_softmax(h, test_stream(), x.dl(), &so, pr.dl(), nullptr, nullptr, 0), FCE_STATUS_NOT_IMPLEMENTED);
  // NCCL mode needs a communicator (fce_comm_create refuses a CPU handle); nothing written.
  so.temperatures = nullptr;
  so.lse = nullptr;
  lse.poison();
  lse.upload();
  size_t bytes = 77;
  EXPECT_EQ(fce_logsumexp_vp(h, nullptr, test_stream(), x.dl(), &lo, lse.dl(), nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fce_last_error_message()).find("comm"), std::string::npos);
  EXPECT_EQ(fce_logsumexp_vp_workspace_size(h, nullptr, x.dl(), &lo, lse.dl(), &bytes), FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(fce_temp_softmax_vp(h, nullptr, test_stream(), x.dl(), &so, pr.dl(), nullptr, lse.dl(), nullptr, 0),
            FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(fce_temp_softmax_vp_workspace_size(h, nullptr, x.dl(), &so, pr.dl(), nullptr, lse.dl(), &bytes),
            FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_EQ(bytes, 77u);
  pr.download();
  for (uint8_t b : pr.bytes()) ASSERT_EQ(b, 0xff) << "written on a failed call";
  lse.download();
  for (uint8_t b : lse.bytes()) ASSERT_EQ(b, 0xff) << "written on a failed call";
  fce_softmax_options_t sold = FCE_SOFTMAX_OPTIONS_INIT;  // 0.1.0's struct is still taken
  sold.struct_size = uint32_t(offsetof(fce_softmax_options_t, vocab_start));
  FCE_OK(fce_temp_softmax(h, test_stream(), x.dl(), &sold, pr.dl(), nullptr, nullptr, 0));
}
