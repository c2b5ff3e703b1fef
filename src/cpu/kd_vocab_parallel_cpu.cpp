// Vocabulary-parallel knowledge distillation on the CPU: a shard's records (the cross statistics of
// KL(P || Q) over its real columns, sums in fp64; a top-K teacher: the student's and its selected columns'
// max and sum), their combine into whole rows (math.hpp's kd_combine_records, the CUDA combine's code), the
// terms' records and combine (the second exchange), and a shard's dstudent from the rows' statistics (KdTerm
// and kd_grad, the element terms of fce_kd_loss).
#include <cmath>
#include <vector>

#include "common/math.hpp"
#include "common/ops.hpp"
#include "cpu/cpu_util.hpp"

namespace fce::cpu {

namespace {

bool reverse(const KdOpts& o) { return o.divergence == FCE_KD_REVERSE_KL; }

bool masked(const Vec& targets, const KdOpts& o, int64_t i) {
  return targets && load_index(targets.data, targets.dtype, i) == o.ignore_index;
}

// Rows the mean divides by.
int64_t unmasked_rows(const Vec& targets, const KdOpts& o, int64_t N) {
  int64_t used = 0;
  for (int64_t i = 0; i < N; ++i) used += !masked(targets, o, i);
  return used;
}

// Row i of a top-K teacher over shards: its slots' global ids (negative: unused), whether any is used and
// whether one is out of the vocabulary (the row's loss is then NaN), and the teacher's log-probabilities
// softmax_K(logprobs / T) over the used slots.
struct TopkRow {
  std::vector<int64_t> ids;
  simd::Row raw, logp;
  bool any = false, bad = false;
  explicit TopkRow(int64_t K) : ids(size_t(K)), raw(K), logp(K) {}
  void read(const KdShardTeacher& t, const KdOpts& o, int64_t i, float inv_t) {
    const int64_t K = t.topk_ids.cols;
    const char* idrow = row_ptr(t.topk_ids, i);
    const char* lprow = row_ptr(t.topk_lp, i);
    any = bad = false;
    for (int64_t k = 0; k < K; ++k) {
      ids[size_t(k)] = load_index(idrow, t.topk_ids.dtype, k);
      any |= ids[size_t(k)] >= 0;
      bad |= ids[size_t(k)] >= o.vocab_total;
      raw[k] = ids[size_t(k)] >= 0 ? load(lprow + 4 * size_t(k), DType::F32) : -INFINITY;
    }
    if (any && !simd::log_softmax(raw.data(), K, inv_t, logp.data())) std::fill(logp.data(), logp.data() + K, NAN);
  }
  // The shard's column of slot k, or -1 outside [vocab_start, vocab_start + n).
  int64_t column(int64_t k, const KdOpts& o, int64_t n) const {
    const int64_t c = ids[size_t(k)] - o.vocab_start;
    return ids[size_t(k)] >= 0 && c >= 0 && c < n ? c : -1;
  }
};

// A top-K row without a used slot is masked, as fce_kd_loss masks it.
int64_t unmasked_rows(const Vec& targets, const KdOpts& o, const KdShardTeacher& t, int64_t N) {
  if (!t.topk()) return unmasked_rows(targets, o, N);
  int64_t used = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (masked(targets, o, i)) continue;
    const char* idrow = row_ptr(t.topk_ids, i);
    for (int64_t k = 0; k < t.topk_ids.cols; ++k)
      if (load_index(idrow, t.topk_ids.dtype, k) >= 0) {
        ++used;
        break;
      }
  }
  return used;
}

// The max of z = x/T (raw max, then scaled, as the GPU forms it) and sum e^(z - max) of a row's values.
void shifted_sum(const float* x, int64_t n, float inv_t, float* m, double* d) {
  float r = -INFINITY;
  for (int64_t j = 0; j < n; ++j) r = std::fmax(r, x[j]);
  *m = r * inv_t;
  *d = 0;
  if (*m == -INFINITY) return;
  for (int64_t j = 0; j < n; ++j) *d += std::exp(double(std::fma(x[j], inv_t, -*m)));
}

// A top-K teacher's records: the student's max and sum over the shard's real columns (Q for forward KL and
// JSD, P for reverse KL) and those of the student's columns at the teacher's ids in the shard (the other
// pair: the normalizer of FCE_KD_TOPK_RENORMALIZE); the cross sum NaN (the loss comes from the terms).
void topk_partial(const KdPartialProblem& p) {
  const int64_t N = p.student.rows, V = p.student.cols, n = p.o.real_cols(V), K = p.teacher.topk_ids.cols;
  const float inv_t = 1.f / p.o.temperature;
  const bool rev = reverse(p.o);
#pragma omp parallel
  {
    simd::Row sbuf(V), sel(K);
    std::vector<int64_t> ids;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* xs = row_in(p.student, i, sbuf.data());
      const char* idrow = row_ptr(p.teacher.topk_ids, i);
      int64_t m = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t c = load_index(idrow, p.teacher.topk_ids.dtype, k) - p.o.vocab_start;
        if (load_index(idrow, p.teacher.topk_ids.dtype, k) >= 0 && c >= 0 && c < n) sel[m++] = xs[c];
      }
      float ms, mk;
      double ds, dk;
      shifted_sum(xs, n, inv_t, &ms, &ds);
      shifted_sum(sel.data(), m, inv_t, &mk, &dk);
      float* r = reinterpret_cast<float*>(row_ptr_mut(p.records, i));
      r[0] = rev ? ms : mk;
      r[1] = float(rev ? ds : dk);
      r[2] = rev ? mk : ms;
      r[3] = float(rev ? dk : ds);
      r[4] = NAN;
      put_range(r, kKdRange, p.o.vocab_start, p.o.vocab_start + n);
    }
  }
}

}  // namespace

void kd_partial(const KdPartialProblem& p) {
  if (p.teacher.topk()) return topk_partial(p);
  const int64_t N = p.student.rows, V = p.student.cols, n = p.o.real_cols(V);
  const float inv_t = 1.f / p.o.temperature;
  const bool rev = reverse(p.o);
#pragma omp parallel
  {
    simd::Row sbuf(V), tbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* xs = row_in(p.student, i, sbuf.data());
      const float* xt = row_in(p.teacher.logits, i, tbuf.data());
      const float* xp = rev ? xs : xt;  // P weights the divergence: the teacher for forward KL
      const float* xq = rev ? xt : xs;
      float rp = -INFINITY, rq = -INFINITY;  // raw maxima (NaN ignored, as fmaxf)
      for (int64_t j = 0; j < n; ++j) {
        rp = std::fmax(rp, xp[j]);
        rq = std::fmax(rq, xq[j]);
      }
      const float mp = rp * inv_t, mq = rq * inv_t;  // the max of z, as the GPU forms it
      double dp = 0, dq = 0, x = 0;
      for (int64_t j = 0; j < n; ++j) {
        const float zp = mp == -INFINITY ? -INFINITY : std::fma(xp[j], inv_t, -mp);
        const float zq = mq == -INFINITY ? -INFINITY : std::fma(xq[j], inv_t, -mq);
        const double ep = std::exp(double(zp)), eq = std::exp(double(zq));
        dp += ep;
        dq += eq;
        if (ep > 0) x += ep * (double(zp) - double(zq));
      }
      float* r = reinterpret_cast<float*>(row_ptr_mut(p.records, i));
      r[0] = mp;
      r[1] = float(dp);
      r[2] = mq;
      r[3] = float(dq);
      r[4] = float(x);
      put_range(r, kKdRange, p.o.vocab_start, p.o.vocab_start + n);
    }
  }
}

void kd_combine(const KdCombineProblem& p) {
  const int64_t N = p.N, W = p.W;
  const bool rev = reverse(p.o);
  const float t2 = p.o.scale_by_t2 ? p.o.temperature * p.o.temperature : 1.f;
  const int64_t stride = int64_t(p.records.ld) * N;
  std::vector<double> row_loss(size_t(N), 0.0);
  std::vector<char> row_used(size_t(N), 0);
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const float* rec = reinterpret_cast<const float*>(p.records.data) + size_t(i) * size_t(p.records.ld);
    float* s = p.row_stats ? reinterpret_cast<float*>(row_ptr_mut(p.row_stats, i)) : nullptr;
    double kl = 0, asum = 0;
    bool no_slot = false, bad = false;
    if (p.terms) {  // the terms' records: the loss and A summed in rank order
      double slots = 0;
      bad = !ranges_tile(rec, W, stride, kKdTermsRange, p.o.vocab_total);
      for (int64_t r = 0; r < W; ++r) {
        kl += double(rec[r * stride]);
        asum += double(rec[r * stride + 1]);
        slots += double(rec[r * stride + 2]);
      }
      const bool dense = rec[2] < 0.f;  // full teacher logits
      no_slot = !dense && slots == 0;   // a top-K row without a used slot: masked
      // A dense KL's A as the one-exchange combine forms it (sum q = 1 exactly: identical rows keep a 0
      // gradient); a top-K teacher's sums its slots' a_k, as fce_kd_loss does.
      s[4] = bad ? NAN : p.o.mixture() || !dense ? float(asum) : rev ? float(kl + 1.0) : -1.f;
    } else {
      const KdCombined k = kd_combine_records(rec, W, stride, p.o.vocab_total);
      kl = k.kl;
      bad = k.bad;
      if (s) {
        s[0] = rev ? k.mp : k.mq;  // the student's shift
        s[1] = rev ? k.logdp : k.logdq;
        s[2] = rev ? k.mq : k.mp;  // the teacher's
        s[3] = rev ? k.logdq : k.logdp;
        // A = sum_j a_j (KdTerm): KL + sum q, or -sum p; JSD's comes from the terms' combine.
        s[4] = p.o.mixture() || k.bad ? NAN : rev ? float(k.kl + 1.0) : -1.f;
      }
    }
    if (!p.loss) continue;  // JSD's first combine
    const bool skip = !bad && (masked(p.targets, p.o, i) || no_slot);  // bad shards: NaN, masked or not
    const float loss = bad ? NAN : skip ? 0.f : float(kl) * t2;
    row_loss[size_t(i)] = loss;
    row_used[size_t(i)] = !skip;
    if (p.o.reduction == FCE_REDUCTION_NONE) store_f32(p.loss, i, loss);
  }
  if (p.loss && p.o.reduction != FCE_REDUCTION_NONE) {
    double sum = 0;
    for (int64_t i = 0; i < N; ++i) sum += row_loss[size_t(i)];
    if (p.o.reduction == FCE_REDUCTION_MEAN) {
      int64_t used = 0;
      for (char u : row_used) used += u;
      sum = used > 0 ? sum / double(used) : 0.0;
    }
    store_f32(p.loss, 0, float(sum));
  }
}

void kd_terms_partial(const KdTermsPartialProblem& p) {
  const int64_t N = p.student.rows, V = p.student.cols, n = p.o.real_cols(V);
  const float inv_t = 1.f / p.o.temperature;
  const KdTerm term(p.o.divergence, p.o.beta);
  if (p.teacher.topk()) {  // the slots whose ids fall in this shard; every rank sees a bad id
    const int64_t K = p.teacher.topk_ids.cols;
    const bool renorm = p.o.topk_norm == FCE_KD_TOPK_RENORMALIZE;
#pragma omp parallel
    {
      simd::Row sbuf(V);
      TopkRow t(K);
#pragma omp for schedule(static)
      for (int64_t i = 0; i < N; ++i) {
        const float* xs = row_in(p.student, i, sbuf.data());
        const float* st = reinterpret_cast<const float*>(row_ptr(p.row_stats, i));
        t.read(p.teacher, p.o, i, inv_t);
        double loss = 0, asum = 0;
        int64_t slots = 0;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t c = t.column(k, p.o, n);
          if (c < 0) continue;
          ++slots;
          const float logq = renorm ? std::fma(xs[c], inv_t, -st[2]) - st[3] : std::fma(xs[c], inv_t, -st[0]) - st[1];
          float a = 0.f;
          loss += double(term(t.logp[k], logq, &a));
          asum += double(a);
        }
        float* r = reinterpret_cast<float*>(row_ptr_mut(p.records, i));
        r[0] = t.bad ? NAN : float(loss);
        r[1] = t.bad ? NAN : float(asum);
        r[2] = float(slots);
        put_range(r, kKdTermsRange, p.o.vocab_start, p.o.vocab_start + n);
      }
    }
    return;
  }
#pragma omp parallel
  {
    simd::Row sbuf(V), tbuf(V);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* xs = row_in(p.student, i, sbuf.data());
      const float* xt = row_in(p.teacher.logits, i, tbuf.data());
      const float* st = reinterpret_cast<const float*>(row_ptr(p.row_stats, i));
      double loss = 0, asum = 0;
      for (int64_t j = 0; j < n; ++j) {
        const float logq = std::fma(xs[j], inv_t, -st[0]) - st[1];
        const float logp = std::fma(xt[j], inv_t, -st[2]) - st[3];
        float a = 0.f;
        loss += double(term(logp, logq, &a));
        asum += double(a);
      }
      float* r = reinterpret_cast<float*>(row_ptr_mut(p.records, i));
      r[0] = float(loss);
      r[1] = float(asum);
      r[2] = -1.f;  // dense
      put_range(r, kKdTermsRange, p.o.vocab_start, p.o.vocab_start + n);
    }
  }
}

void kd_bwd(const KdBwdProblem& p) {
  const int64_t N = p.student.rows, V = p.student.cols, n = p.o.real_cols(V);
  const float inv_t = 1.f / p.o.temperature;
  const float t2 = p.o.scale_by_t2 ? p.o.temperature * p.o.temperature : 1.f;
  const KdTerm term(p.o.divergence, p.o.beta);
  const int64_t used = p.o.reduction == FCE_REDUCTION_MEAN ? unmasked_rows(p.targets, p.o, p.teacher, N) : 0;
  const bool topk = p.teacher.topk(), renorm = topk && p.o.topk_norm == FCE_KD_TOPK_RENORMALIZE;
  const int64_t K = topk ? p.teacher.topk_ids.cols : 0;
#pragma omp parallel
  {
    simd::Row sbuf(V), tbuf(topk ? 1 : V), gbuf(V);
    TopkRow t(K);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < N; ++i) {
      const float* xs = row_in(p.student, i, sbuf.data());  // read whole: dstudent may be the student
      float* grad = row_out(p.dstudent, i, gbuf.data());
      std::fill(grad + n, grad + V, 0.f);  // padding
      if (topk) t.read(p.teacher, p.o, i, inv_t);
      if (masked(p.targets, p.o, i) || (topk && !t.any)) {
        std::fill(grad, grad + n, 0.f);
        row_out_done(p.dstudent, i, grad);
        continue;
      }
      const float* st = reinterpret_cast<const float*>(row_ptr(p.row_stats, i));
      float g = p.grad_loss ? load_f32(p.grad_loss, i) : 1.f;
      if (p.o.reduction == FCE_REDUCTION_MEAN) g = float(double(g) / double(used));
      const float scale = g * t2 * inv_t;
      if (!topk) {
        const float* xt = row_in(p.teacher.logits, i, tbuf.data());
        for (int64_t j = 0; j < n; ++j) {
          const float logq = std::fma(xs[j], inv_t, -st[0]) - st[1];
          const float logp = std::fma(xt[j], inv_t, -st[2]) - st[3];
          float a = 0.f;
          term(logp, logq, &a);
          grad[j] = kd_grad(a, fast_exp(logq), st[4], scale);
        }
      } else if (t.bad) {
        std::fill(grad, grad + n, NAN);
      } else {
        // a_k - q_k A at the shard's ids (formed first: dstudent may be the student), -q_j A elsewhere over
        // the full vocabulary (0 with renormalization), as fce_kd_loss forms them.
        auto scaled = [scale](float v) { return (scale == 0.f && std::isinf(v)) ? 0.f : v * scale; };
        for (int64_t k = 0; k < K; ++k) {
          const int64_t c = t.column(k, p.o, n);
          if (c < 0) continue;
          const float logq = renorm ? std::fma(xs[c], inv_t, -st[2]) - st[3] : std::fma(xs[c], inv_t, -st[0]) - st[1];
          float a = 0.f;
          term(t.logp[k], logq, &a);
          t.raw[k] = scaled(kd_grad(a, std::exp(logq), st[4], 1.f));
        }
        for (int64_t j = 0; j < n; ++j)
          grad[j] = renorm ? 0.f : kd_grad(0.f, fast_exp(std::fma(xs[j], inv_t, -st[0]) - st[1]), st[4], scale);
        for (int64_t k = 0; k < K; ++k)
          if (t.column(k, p.o, n) >= 0) grad[t.column(k, p.o, n)] = t.raw[k];
      }
      row_out_done(p.dstudent, i, grad);
    }
  }
}

}  // namespace fce::cpu
