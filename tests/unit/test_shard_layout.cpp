// Vocabulary shards laid out wrongly give NaN, never a plausible number (issue 47, item 6), and a shard of
// padding alone is neutral (item 7): the records carry their column ranges and every combine (cross-entropy,
// logsumexp, KD and its terms) checks that they tile [0, vocab_total) in rank order.
#include <algorithm>

#include "common/calls.hpp"
#include "common/ce_reference.hpp"

using namespace fct;

namespace {

// A shard as a caller may (mis)describe it: vocab_start, and the global columns [begin, begin + cols) whose
// logits it holds (the last `pad` of them padding past vocab_total).
struct Piece {
  int64_t start, cols;
};

// The cross-entropy records of each piece of `full`'s columns, combined; loss [N], lse, argmax.
struct CeOut {
  Tensor loss, lse, amax;
};
CeOut ce_pieces(Tensor& full, Tensor& targets, const std::vector<Piece>& pieces, int64_t vocab_total, bool ignored_rows) {
  const int64_t N = full.rows(), W = int64_t(pieces.size()), K = FCE_CE_RECORD_FIELDS_ALL;
  Handle h;
  fce_ce_options_t o = ce_none();
  o.vocab_total = vocab_total;
  (void)ignored_rows;
  Records rec(W, N, K);
  for (int64_t r = 0; r < W; ++r) {
    const Piece& p = pieces[size_t(r)];
    Tensor part(full.dtype(), {N, std::max<int64_t>(p.cols, 1)});
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < part.cols(); ++j)
        part.set(i, j, p.start + j < full.cols() ? full.get(i, p.start + j) : NAN);  // past V: padding
    part.upload();
    Tensor one = poisoned(DT::F32, {N, K});
    o.vocab_start = p.start;
    const fce_status_t s = fce_cross_entropy_partial(h, test_stream(), part.dl(), targets.dl(), &o, one.dl());
    EXPECT_EQ(s, FCE_STATUS_SUCCESS) << fce_last_error_message();
    one.download();
    std::memcpy(rec.t.raw() + 4 * size_t(r * N * K), one.bytes().data(), 4 * size_t(N * K));
  }
  rec.t.upload();
  CeOut r{poisoned(DT::F32, {N}), poisoned(DT::F32, {N}), poisoned(DT::I64, {N})};
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = r.loss.dl();
  out.lse = r.lse.dl();
  out.argmax = r.amax.dl();
  EXPECT_EQ(fce_cross_entropy_combine(h, test_stream(), &rec.dl, targets.dl(), &o, &out, nullptr, 0),
            FCE_STATUS_SUCCESS)
      << fce_last_error_message();
  for (Tensor* t : {&r.loss, &r.lse, &r.amax}) t->download();
  return r;
}

void expect_nan_rows(const CeOut& r, int64_t N, const char* what) {
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_TRUE(std::isnan(r.loss.get(i))) << what << ": loss row " << i << " = " << r.loss.get(i);
    EXPECT_TRUE(std::isnan(r.lse.get(i))) << what << ": lse row " << i;
    EXPECT_EQ(r.amax.get_int(i), -1) << what << ": argmax row " << i;
  }
}

}  // namespace

// The layouts over V = 60: overlapping shards ([0,20), [15,40), [40,60)) combined with SUCCESS and a
// loss off by 0.045; a gap (columns 20-24 in no shard) with target 22 gave a finite loss as if z_t were 0.
// Also shards out of vocabulary order, a missing last shard, a vocab_total of another vocabulary. Every row
// NaN (an ignored row too: the whole layout is wrong), argmax -1.
TEST(ShardLayout, CrossEntropyPartitionMistakesGiveNaN) {
  const int64_t N = 3, V = 60;
  Tensor full(DT::F32, {N, V});
  fill_logits(full, 2.0, false);
  Tensor targets = ints(DT::I64, {22, 5, -100});
  const CeOut good = ce_pieces(full, targets, {{0, 20}, {20, 20}, {40, 20}}, V, true);
  for (int64_t i = 0; i < 2; ++i) EXPECT_FALSE(std::isnan(good.loss.get(i)));
  expect_nan_rows(ce_pieces(full, targets, {{0, 20}, {15, 25}, {40, 20}}, V, true), N, "overlap");
  expect_nan_rows(ce_pieces(full, targets, {{0, 20}, {25, 35}}, V, true), N, "gap holding the target");
  expect_nan_rows(ce_pieces(full, targets, {{20, 40}, {0, 20}}, V, true), N, "out of order");
  expect_nan_rows(ce_pieces(full, targets, {{0, 20}, {20, 20}}, V, true), N, "the last shard missing");
  expect_nan_rows(ce_pieces(full, targets, {{0, 20}, {20, 20}, {40, 20}}, V + 1, true), N, "another vocab_total");
}

// A shard of padding alone (vocab_start = vocab_total, as Megatron's padding of a small vocabulary gives) was
// INVALID_ARGUMENT: now a neutral record; loss, lse and argmax those of the unsharded call, its gradient 0.
TEST(ShardLayout, PaddingOnlyShardIsNeutral) {
  const int64_t N = 4, V = 50;
  for (DT dt : {DT::F32, DT::BF16}) {
    Tensor full(dt, {N, V});
    fill_logits(full, 2.0, false);
    Tensor targets = ints(DT::I64, {3, 49, -100, 0});
    CeOut sharded = ce_pieces(full, targets, {{0, 30}, {30, 20}, {50, 10}}, V, true);
    const Ce whole = ce_fwd(full, targets, ce_none());
    ASSERT_EQ(whole.status, FCE_STATUS_SUCCESS);
    for (int64_t i = 0; i < N; ++i) {
      EXPECT_TRUE(close(sharded.lse.get(i), whole.lse.get(i), 2e-6, 1e-6)) << "row " << i;
      EXPECT_TRUE(close(sharded.loss.get(i), whole.loss.get(i), 2e-6, 1e-6)) << "row " << i;
      EXPECT_EQ(sharded.amax.get_int(i), whole.amax.get_int(i)) << "row " << i;
    }
    // Its gradient from the combined lse: all 0 (padding columns), and nothing else written.
    Handle h;
    fce_ce_options_t o = ce_none();
    o.vocab_total = V;
    o.vocab_start = V;
    Tensor pad(dt, {N, 10});
    fill_logits(pad, 1.0, false);
    Tensor dl = poisoned(dt, {N, 10});
    FCE_OK(fce_cross_entropy_bwd(h, test_stream(), pad.dl(), targets.dl(), sharded.lse.dl(), nullptr, &o, dl.dl(),
                                 nullptr, 0));
    dl.download();
    for (int64_t i = 0; i < N; ++i)
      for (int64_t j = 0; j < 10; ++j) EXPECT_EQ(dl.get(i, j), 0.0) << "(" << i << "," << j << ")";
  }
}

// Logsumexp's records: the same checks (and the records' scales and vocab_total must agree): NaN.
TEST(ShardLayout, LogsumexpPartitionMistakesGiveNaN) {
  const int64_t N = 2, V = 40;
  Tensor full(DT::F32, {N, V});
  fill_logits(full, 2.0, false);
  const std::vector<double> xv = values(full);
  Handle h;
  auto lse_of_pieces = [&](const std::vector<Piece>& pieces, std::vector<float> scales, int64_t vt) {
    const int64_t W = int64_t(pieces.size()), K = FCE_LSE_RECORD_FIELDS;
    Records rec(W, N, K);
    for (int64_t r = 0; r < W; ++r) {
      const Piece& p = pieces[size_t(r)];
      Tensor part(DT::F32, {N, std::max<int64_t>(p.cols, 1)});
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < part.cols(); ++j) part.set(i, j, p.start + j < V ? full.get(i, p.start + j) : NAN);
      part.upload();
      fce_lse_options_t lo = FCE_LSE_OPTIONS_INIT;
      lo.scale = scales[size_t(r)];
      lo.vocab_start = p.start;
      lo.vocab_total = vt;
      Tensor one = poisoned(DT::F32, {N, K});
      EXPECT_EQ(fce_logsumexp_partial(h, test_stream(), part.dl(), &lo, one.dl()), FCE_STATUS_SUCCESS);
      one.download();
      std::memcpy(rec.t.raw() + 4 * size_t(r * N * K), one.bytes().data(), 4 * size_t(N * K));
    }
    rec.t.upload();
    Tensor lse = poisoned(DT::F32, {N});
    EXPECT_EQ(fce_logsumexp_combine(h, test_stream(), &rec.dl, lse.dl()), FCE_STATUS_SUCCESS);
    lse.download();
    return std::vector<double>{lse.get(0), lse.get(1)};
  };
  const std::vector<double> good = lse_of_pieces({{0, 25}, {25, 15}, {40, 5}}, {1.f, 1.f, 1.f}, V);  // last: padding
  for (int64_t i = 0; i < N; ++i) {
    std::vector<double> z(xv.begin() + i * V, xv.begin() + (i + 1) * V);
    EXPECT_TRUE(close(good[size_t(i)], lse_of(z), 2e-6, 1e-6));
  }
  for (double v : lse_of_pieces({{0, 25}, {20, 20}}, {1.f, 1.f}, V)) EXPECT_TRUE(std::isnan(v)) << "overlap";
  for (double v : lse_of_pieces({{0, 20}, {25, 15}}, {1.f, 1.f}, V)) EXPECT_TRUE(std::isnan(v)) << "gap";
  for (double v : lse_of_pieces({{0, 25}, {25, 15}}, {1.f, 0.5f}, V)) EXPECT_TRUE(std::isnan(v)) << "two scales";
  for (double v : lse_of_pieces({{0, 25}}, {1.f}, V)) EXPECT_TRUE(std::isnan(v)) << "the last shard missing";
}

// KD's records (one exchange) and its terms' records (JSD's second): overlapping or missing shards give NaN
// in every row's loss and statistics, masked rows too; a shard of padding alone is neutral.
TEST(ShardLayout, KdPartitionMistakesGiveNaN) {
  const int64_t N = 3, V = 40;
  Tensor s(DT::F32, {N, V}), t(DT::F32, {N, V});
  fill_logits(s, 1.0, false);
  fill_logits(t, 1.0, false);
  Tensor targets = ints(DT::I64, {0, -100, 2});
  Handle h;
  auto kd_of_pieces = [&](const std::vector<Piece>& pieces, int div) {
    const int64_t W = int64_t(pieces.size());
    fce_kd_options_t o = kd_opts(div);
    o.vocab_total = V;
    Records rec(W, N, FCE_KD_RECORD_FIELDS), terms(W, N, FCE_KD_TERMS_RECORD_FIELDS);
    std::vector<Tensor> ss, ts;
    for (int64_t r = 0; r < W; ++r) {
      const Piece& p = pieces[size_t(r)];
      Tensor a(DT::F32, {N, p.cols}), b(DT::F32, {N, p.cols});
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < p.cols; ++j) {
          a.set(i, j, p.start + j < V ? s.get(i, p.start + j) : NAN);
          b.set(i, j, p.start + j < V ? t.get(i, p.start + j) : NAN);
        }
      a.upload();
      b.upload();
      fce_kd_teacher_t tt = full(b);
      o.vocab_start = p.start;
      Tensor one = poisoned(DT::F32, {N, FCE_KD_RECORD_FIELDS});
      EXPECT_EQ(fce_kd_partial(h, test_stream(), a.dl(), &tt, &o, one.dl()), FCE_STATUS_SUCCESS)
          << fce_last_error_message();
      one.download();
      std::memcpy(rec.t.raw() + 4 * size_t(r * N * FCE_KD_RECORD_FIELDS), one.bytes().data(),
                  4 * size_t(N * FCE_KD_RECORD_FIELDS));
      ss.push_back(std::move(a));
      ts.push_back(std::move(b));
    }
    rec.t.upload();
    Tensor loss = poisoned(DT::F32, {N}), stats = poisoned(DT::F32, {N, FCE_KD_ROW_STATS_FIELDS});
    const bool jsd = div == FCE_KD_JSD;
    EXPECT_EQ(fce_kd_combine(h, test_stream(), &rec.dl, targets.dl(), &o, jsd ? nullptr : loss.dl(), stats.dl(),
                             nullptr, 0),
              FCE_STATUS_SUCCESS)
        << fce_last_error_message();
    if (jsd) {
      for (int64_t r = 0; r < W; ++r) {
        fce_kd_teacher_t tt = full(ts[size_t(r)]);
        o.vocab_start = pieces[size_t(r)].start;
        Tensor one = poisoned(DT::F32, {N, FCE_KD_TERMS_RECORD_FIELDS});
        EXPECT_EQ(fce_kd_terms_partial(h, test_stream(), ss[size_t(r)].dl(), &tt, stats.dl(), &o, one.dl()),
                  FCE_STATUS_SUCCESS);
        one.download();
        std::memcpy(terms.t.raw() + 4 * size_t(r * N * FCE_KD_TERMS_RECORD_FIELDS), one.bytes().data(),
                    4 * size_t(N * FCE_KD_TERMS_RECORD_FIELDS));
      }
      terms.t.upload();
      EXPECT_EQ(fce_kd_terms_combine(h, test_stream(), &terms.dl, targets.dl(), &o, loss.dl(), stats.dl(), nullptr, 0),
                FCE_STATUS_SUCCESS);
    }
    loss.download();
    return std::vector<double>{loss.get(0), loss.get(1), loss.get(2)};
  };
  for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
    SCOPED_TRACE(testing::Message() << "divergence " << div);
    const std::vector<double> good = kd_of_pieces({{0, 25}, {25, 15}, {40, 6}}, div);  // the last: padding alone
    const Kd whole = kd(s, full(t), kd_opts(div), &targets);
    ASSERT_EQ(whole.status, FCE_STATUS_SUCCESS);
    for (int64_t i = 0; i < N; ++i) EXPECT_TRUE(close(good[size_t(i)], whole.loss.get(i), 2e-5, 2e-6)) << "row " << i;
    for (double v : kd_of_pieces({{0, 25}, {20, 20}}, div)) EXPECT_TRUE(std::isnan(v)) << "overlap";
    for (double v : kd_of_pieces({{0, 25}}, div)) EXPECT_TRUE(std::isnan(v)) << "the last shard missing";
  }
}

// Linear CE's LM head split by rows with a shard of padding alone (no weight row below vocab_total): its
// records are neutral, and its backward writes zero parts of dhidden (the ranks sum them) and zero dweight.
TEST(ShardLayout, LinearCrossEntropyPaddingOnlyShard) {
  const int64_t N = 3, H = 8, V = 40;
  Tensor hid(DT::F32, {N, H}), wt(DT::F32, {6, H});
  fill_logits(hid, 1.0, false);
  fill_logits(wt, 1.0, false);
  Tensor t = ints(DT::I64, {1, 39, -100});
  Handle h;
  fce_ce_options_t o = ce_none();
  o.vocab_total = V;
  o.vocab_start = V;
  Tensor rec = poisoned(DT::F32, {N, FCE_CE_RECORD_FIELDS_ALL});
  FCE_OK(fce_linear_cross_entropy_partial(h, test_stream(), hid.dl(), wt.dl(), nullptr, t.dl(), &o, rec.dl(), nullptr, 0));
  rec.download();
  for (int64_t i = 0; i < N; ++i) {
    EXPECT_EQ(rec.get(i, 0), -INFINITY) << "row " << i;  // the max of no column
    EXPECT_EQ(rec.get(i, 1), 0.0);
  }
  Tensor lse(DT::F32, {N, 2});
  for (int64_t i = 0; i < N; ++i) {
    lse.set(i, 0, 1.0);
    lse.set(i, 1, 2.0);
  }
  lse.upload();
  Tensor dh = poisoned(DT::F32, {N, H}), dw = poisoned(DT::F32, {6, H});
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  out.dhidden = dh.dl();
  out.dweight = dw.dl();
  FCE_OK(fce_linear_cross_entropy_bwd(h, test_stream(), hid.dl(), wt.dl(), nullptr, t.dl(), lse.dl(), &o, &out, nullptr, 0));
  dh.download();
  dw.download();
  for (int64_t e = 0; e < N * H; ++e) EXPECT_EQ(dh.get(e / H, e % H), 0.0) << "dhidden " << e;
  for (int64_t e = 0; e < 6 * H; ++e) EXPECT_EQ(dw.get(e / H, e % H), 0.0) << "dweight " << e;
}
