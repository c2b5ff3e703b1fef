// Vocabulary-parallel cross-entropy on the CPU: a shard's records, their combine into whole rows, and a
// shard's gradient from the combined lse; logsumexp's records and combine, and a shard's temperature softmax
// from the whole rows' lse. The same row arithmetic as ce_row.hpp, over the shard's real
// columns (padding past vocab_total is never read into a sum).
#include <cmath>
#include <cstring>
#include <vector>

#include "cpu/ce_row.hpp"

namespace fce::cpu {

namespace {

// Columns of the shard inside the vocabulary (the rest is padding).
int64_t real_cols(const CeOpts& o, int64_t V) {
  const int64_t left = o.vocab_total - o.vocab_start;
  return left < V ? left : V;
}

// The shard's transformed logits: x itself for the identity transform, else zbuf.
const float* shard_z(const CeContext& c, const float* x, int64_t n, float* zbuf) {
  if (c.identity()) return x;
  simd::transform(c.tf, x, n, zbuf);
  return zbuf;
}

// The target's column in the shard, or -1 when another shard (or nobody) holds it.
int64_t local_target(const CeOpts& o, int64_t t, int64_t n) {
  return t >= o.vocab_start && t < o.vocab_start + n ? t - o.vocab_start : -1;
}

}  // namespace

void ce_partial(const CePartialProblem& p) {
  const int64_t N = p.logits.rows, V = p.logits.cols, n = real_cols(p.o, V);
  const CeContext c(p.o, p.o.vocab_total);
  const float* w = c.weights() ? c.weights() + p.o.vocab_start : nullptr;
  const bool smooth = p.o.label_smoothing > 0.f;
#pragma omp parallel
  {
    simd::Row xbuf(V), zbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      float* rec = reinterpret_cast<float*>(p.records.data) + size_t(i) * size_t(p.records.ld);
      const int64_t t = load_index(p.targets.data, p.targets.dtype, i);
      const float* x = row_in(p.logits, i, xbuf.data());
      float m = -INFINITY, d = 0.f, zt = 0.f, swz = 0.f, se = 0.f, av = -INFINITY;
      int32_t ai = kNoRecordIndex;
      if (n > 0) {
        const simd::MaxNan mx = simd::max_nan(x, n);
        av = mx.nan ? NAN : mx.max;
        ai = int32_t(p.o.vocab_start + simd::find_first(x, n, av));
        const float* z = shard_z(c, x, n, zbuf.data());
        m = mx.nan ? NAN : simd::transform1(c.tf, mx.max);
        if (!mx.nan) {
          const simd::CeSums s = simd::ce_sums(z, n, m, w, smooth);
          swz = float(s.swz);
          if (m != -INFINITY) {
            d = float(s.s);
            se = float(s.sz);  // shifted: sum e (z - m)
          }
        }
        const int64_t tl = local_target(p.o, t, n);
        if (tl >= 0) zt = z[tl];
      }
      float r[kCeRecordFields] = {m, d, zt, swz, 0.f, 0.f, se, av, index_as_float(ai)};
      put_range(r, CeRecordLayout(kCeRecordFields).range, p.o.vocab_start, p.o.vocab_start + n);
      std::memcpy(rec, r, size_t(p.records.cols) * sizeof(float));  // the record's width: a prefix
    }
  }
}

void ce_combine(const CeCombineProblem& p) {
  const int64_t N = p.targets.n, W = p.W;
  const CeContext c(p.o, p.o.vocab_total);
  const double denom = p.o.reduction == FCE_REDUCTION_MEAN ? c.mean_denominator(p.targets) : 0.0;
  std::vector<double> row_loss(size_t(N), 0.0), row_zl(size_t(N), 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    auto rec = [&](int64_t r) {
      return reinterpret_cast<const float*>(p.records.data) + size_t(r * N + i) * size_t(p.records.ld);
    };
    const CeCombined m = ce_combine_records(rec(0), W, int64_t(p.records.ld) * N, p.records.cols, p.o.vocab_total);
    CeRow row;
    row.lse = m.lse;
    row.entropy = m.entropy;
    const int64_t t = load_index(p.targets.data, p.targets.dtype, i);
    if (!c.ignored(t) || m.bad) {  // shards that do not tile the vocabulary: NaN even for an ignored row
      if (!c.valid(t) || m.bad) row.loss = row.z_loss = NAN;
      else ce_combined_loss(m, c.weight(t), p.o.label_smoothing, double(c.V), c.W, p.o.z_loss_scale, &row.loss,
                            &row.z_loss);
    }
    row_loss[size_t(i)] = row.loss;
    row_zl[size_t(i)] = row.z_loss;
    if (p.lse) store_lse(p.lse, i, m.pair, row.lse);
    if (p.pair) store_lse(p.pair, i, m.pair, row.lse);
    if (p.entropy) store_f32(p.entropy, i, row.entropy);
    if (p.argmax)
      store_index(p.argmax.data, p.argmax.dtype, i, m.bad ? -1 : m.argmax == kNoRecordIndex ? 0 : m.argmax);
    if (p.o.reduction == FCE_REDUCTION_NONE) {
      store_f32(p.loss, i, row.loss);
      if (p.z_loss) store_f32(p.z_loss, i, row.z_loss);
    }
  }
  reduce_losses(p.o.reduction, row_loss, row_zl, denom, p.loss, p.z_loss);
}

// A shard's dlogits from the combined lse (cpu::ce routes a sharded backward here).
void ce_shard_backward(const CeProblem& p) {
  const int64_t N = p.logits.rows, V = p.logits.cols, n = real_cols(p.o, V);
  const CeContext c(p.o, p.o.vocab_total);
  const float* w = c.weights() ? c.weights() + p.o.vocab_start : nullptr;
  const double denom = c.mean_denominator(p.targets);
#pragma omp parallel
  {
    simd::Row xbuf(V), zbuf(V), gbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = load_index(p.targets.data, p.targets.dtype, i);
      const float* x = row_in(p.logits, i, xbuf.data());
      const float* z = n > 0 ? shard_z(c, x, n, zbuf.data()) : x;  // read whole before dx is written
      float* dx = row_out(p.dlogits, i, gbuf.data());
      const float g = c.grad_scale(p.grad_loss, i, denom);
      const EntropyGrad eg = entropy_grad(p.grad_entropy, i, p.grad_entropy ? load_f32(p.saved_entropy, i) : 0.f);
      ce_row_grad(c, z, n, w, load_lse(p.saved_lse, i), t, local_target(p.o, t, n), g, eg, dx);
      std::fill(dx + n, dx + V, !c.ignored(t) && !c.valid(t) ? NAN : 0.f);  // padding
      row_out_done(p.dlogits, i, dx);
    }
  }
}

void lse_partial(const LsePartialProblem& p) {
  const int64_t N = p.x.rows, V = p.x.cols;
  const int64_t n = p.vocab_total - p.vocab_start < V ? p.vocab_total - p.vocab_start : V;
#pragma omp parallel
  {
    simd::Row xbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* x = row_in(p.x, i, xbuf.data());
      // The raw max first, then exp((x - m) s) in float64 (x s itself may overflow fp32 at a small T).
      const simd::MaxNan mx = simd::max_nan(x, n);
      const float m = mx.max;
      double d = 0;
      if (m == INFINITY) d = 1;  // +inf: the lse is +inf (the GPU's convention)
      else if (m != -INFINITY)
        for (int64_t j = 0; j < n; ++j) d += std::exp((double(x[j]) - double(m)) * double(p.scale));
      float* r = reinterpret_cast<float*>(row_ptr_mut(p.records, i));
      r[0] = mx.nan ? NAN : m;
      r[1] = mx.nan ? NAN : float(d);
      put_range(r, kLseRange, p.vocab_start, p.vocab_start + n);
      r[kLseScale] = p.scale;
      r[kLseTotal] = index_as_float(int32_t(p.vocab_total));
    }
  }
}

void lse_combine(const LseCombineProblem& p) {
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < p.N; ++i) {
    const float* rec = reinterpret_cast<const float*>(p.records.data) + size_t(i) * size_t(p.records.ld);
    const LseCombined c = lse_combine_records(rec, p.W, int64_t(p.records.ld) * p.N);
    if (p.lse) store_lse(p.lse, i, c.pair, c.lse);
    if (p.pair) store_lse(p.pair, i, c.pair, c.lse);
  }
}

void softmax_shard(const SoftmaxProblem& p) {
  const int64_t N = p.logits.rows, V = p.logits.cols;
  const int64_t n = p.vocab_total - p.vocab_start < V ? p.vocab_total - p.vocab_start : V;
  const float inv_t = 1.f / p.temperature;
#pragma omp parallel
  {
    simd::Row xbuf(V), pbuf(V), lbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* x = row_in(p.logits, i, xbuf.data());  // read whole: an output may be the logits
      const ShardLogProb lpf(load_lse(p.lse, i), p.lse.pair, inv_t);
      float* pr = p.probs ? row_out(p.probs, i, pbuf.data()) : nullptr;
      float* lp = p.logprobs ? row_out(p.logprobs, i, lbuf.data()) : nullptr;
      for (int64_t j = 0; j < V; ++j) {
        const float l = j < n ? lpf(x[j]) : -INFINITY;
        if (pr) pr[j] = j < n ? std::exp(l) : 0.f;
        if (lp) lp[j] = l;
      }
      if (pr) row_out_done(p.probs, i, pr);
      if (lp) row_out_done(p.logprobs, i, lp);
    }
  }
}

}  // namespace fce::cpu
