// Knowledge-distillation kernels of the rows path (plan_rows: resident, streaming or phased blocks of a row):
// the full teacher and the top-K teacher, and the top-K kernels of the onepass and renorm paths.
#pragma once
#include "cuda/kd_common.cuh"

namespace fce::cuda {
namespace {

// ---- full teacher ----------------------------------------------------------------------------------

template <class Ts, class Tt, int DIV, bool kResident>
__device__ __forceinline__ void kd_full_row(const KdArgs& a, int64_t row, int rank) {
  constexpr int G = kGroup<Ts, Tt>;
  int64_t begin, end;
  split_range(a.V, a.C, rank, &begin, &end);
  const int64_t n = end - begin;
  const Ts* s = static_cast<const Ts*>(a.s) + row * a.lds + begin;
  const Tt* t = static_cast<const Tt*>(a.t) + row * a.ldt + begin;
  Ts* ds = a.ds ? static_cast<Ts*>(a.ds) + row * a.ldd + begin : nullptr;
  Ts* ss = reinterpret_cast<Ts*>(g_smem);
  Tt* st = reinterpret_cast<Tt*>(reinterpret_cast<char*>(g_smem) + a.t_off);
  const RowCtx c{row, a.C, rank, a.p0, a.p1};
  if (target_masked(a, row)) {
    kd_fixed_row<Ts>(a, row, rank, ds, n, 0.f, 0.f, 0);
    return;
  }
  const float inv_t = 1.f / a.temperature;

  // Phase 0: raw maxima (the slices go to shared memory on the way).
  Max2 mx;
  if (a.p0 == 0) {
    RawMax<Ts> rs;
    RawMax<Tt> rt;
    if constexpr (kResident) {
      load_slice<Ts>(
          s, int(n), ss, [&](const uint4& raw, int) { rs.vec(raw); }, [&](float x, int) { rs.one(x); });
      load_slice<Tt>(
          t, int(n), st, [&](const uint4& raw, int) { rt.vec(raw); }, [&](float x, int) { rt.one(x); });
    } else {
      row_visit<Ts>(s, 0, n, [&](const float(&v)[kVec<Ts>], int64_t, int cnt) {
#pragma unroll
        for (int k = 0; k < kVec<Ts>; ++k)
          if (k < cnt) rs.one(v[k]);
      });
      row_visit<Tt>(t, 0, n, [&](const float(&v)[kVec<Tt>], int64_t, int cnt) {
#pragma unroll
        for (int k = 0; k < kVec<Tt>; ++k)
          if (k < cnt) rt.one(v[k]);
      });
    }
    mx.a = rs.get();
    mx.b = rt.get();
    mx = block_reduce(mx);
  }
  if (!exchange<0>(c, 0, mx, static_cast<Max2*>(a.ws0))) return;
  // Max of z = x/T is (max x)/T: rounding is monotonic and T > 0.
  const float ms = mx.a * inv_t, mt = mx.b * inv_t;

  // Phase 1: sums of exp(z - max z) -> log d_s, log d_t.
  Sum2 sum;
  if (a.p0 <= 1) {
    const bool live_s = ms != -INFINITY, live_t = mt != -INFINITY;
    visit2<Ts, Tt, kResident>(s, t, ss, st, n, [&](const float(&vs)[G], const float(&vt)[G], int64_t, int cnt) {
#pragma unroll
      for (int k = 0; k < G; ++k) {
        if (k < cnt) {
          if (live_s) sum.a += fexp(zdiff(vs[k], inv_t, ms));
          if (live_t) sum.b += fexp(zdiff(vt[k], inv_t, mt));
        }
      }
    });
    sum = block_reduce(sum);
  }
  if (!exchange<1>(c, 1, sum, static_cast<Sum2*>(a.ws1))) return;
  const LogProb lq{inv_t, ms, logf(sum.a)}, lp{inv_t, mt, logf(sum.b)};  // NaN rows without a finite logit
  const KdTerm term(DIV >= 0 ? DIV : a.div, a.beta);

  // Phase 2: the loss and A = sum_j a_j.
  LossA la;
  if (a.p0 <= 2) {
    visit2<Ts, Tt, kResident>(s, t, ss, st, n, [&](const float(&vs)[G], const float(&vt)[G], int64_t, int cnt) {
#pragma unroll
      for (int k = 0; k < G; ++k) {
        if (k < cnt) {
          float aj;
          la.loss += term(lp(vt[k]), lq(vs[k]), &aj);
          la.A += aj;
        }
      }
    });
    la = block_reduce(la);
  }
  if (!exchange<2>(c, 2, la, static_cast<LossA*>(a.ws2))) return;
  if (rank == 0 && threadIdx.x == 0) {
    a.row_loss[row] = la.loss * a.t2;
    if (a.row_used) a.row_used[row] = 1;
  }
  if (!ds) return;

  // Phase 3: dstudent = scale * (a - q*A) (kd_grad), a recomputed (in place allowed: every element is read
  // before its store, from shared memory or by the thread that stores it).
  const float scale = kd_grad_scale(a, row), A = la.A;
  constexpr bool kMayInf = DIV < 0 || DIV == FCE_KD_REVERSE_KL;  // A = +inf only for reverse KL
  visit2<Ts, Tt, kResident>(s, t, ss, st, n, [&](const float(&vs)[G], const float(&vt)[G], int64_t e0, int cnt) {
    float g[G];
#pragma unroll
    for (int k = 0; k < G; ++k) {
      g[k] = 0.f;
      if (k < cnt) {
        float aj;
        const float lqk = lq(vs[k]);
        (void)term(lp(vt[k]), lqk, &aj);
        const float q = fexp(lqk);
        g[k] = kMayInf ? kd_grad(aj, q, A, scale) : (q == 0.f ? aj : aj - q * A) * scale;
      }
    }
    store_vals<Ts, G>(ds + e0, g, cnt);
  });
}

template <class Ts, class Tt, int DIV, bool kResident>
__global__ void __launch_bounds__(kKdThreads, 3) kd_full_kernel(const KdArgs a) {
  const int rank = int(blockIdx.x % unsigned(a.C));
  const int64_t stride = int64_t(gridDim.x / unsigned(a.C));
  for (int64_t row = blockIdx.x / unsigned(a.C); row < a.N; row += stride) {
    kd_full_row<Ts, Tt, DIV, kResident>(a, row, rank);
    if (a.cluster) cluster_sync_all();  // shared memory reusable: every thread and peer is done with it
    else __syncthreads();
  }
}

// ---- top-K teacher ---------------------------------------------------------------------------------

// Used slots (id >= 0) and ids out of range (id >= V) of a row, the same in every thread.
__device__ __forceinline__ void topk_status(const KdArgs& a, int64_t ib, bool* any_used, bool* any_oob) {
  int used = 0, oob = 0;
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
    const int64_t id = load_index(a.ids, a.ids64, ib + k);
    used |= id >= 0;
    oob |= id >= a.V;
  }
  *any_used = __syncthreads_or(used) != 0;
  *any_oob = __syncthreads_or(oob) != 0;
}

// The teacher's log-probabilities over its used slots of logprobs/T (every block of the row computes the same).
__device__ __forceinline__ LogProb topk_teacher_logp(const KdArgs& a, int64_t ib, const float* lp) {
  MaxF m;
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x)
    if (load_index(a.ids, a.ids64, ib + k) >= 0) m.m = fmaxf(m.m, lp[k] * a.inv_t);
  m = block_reduce(m);
  SumF sum;
  if (m.m != -INFINITY)
    for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x)
      if (load_index(a.ids, a.ids64, ib + k) >= 0) sum.s += fexp(zdiff(lp[k], a.inv_t, m.m));
  sum = block_reduce(sum);
  return LogProb{a.inv_t, m.m, logf(sum.s)};
}

// The divergence terms at the used top-K slots of a row (a block-wide sum, loss and A), from the teacher's
// and the student's log-probabilities (LogProb or LogProb2); student logits gathered from srow.
template <class Ts, class LQ>
__device__ __forceinline__ LossA topk_terms(const KdArgs& a, int64_t ib, const float* lp, const Ts* srow,
                                            const LogProb& logp, const LQ& logq) {
  const KdTerm term(a.div, a.beta);
  LossA la;
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
    const int64_t id = load_index(a.ids, a.ids64, ib + k);
    if (id >= 0) {
      float ak;
      la.loss += term(logp(lp[k]), logq(to_float(srow[id])), &ak);
      la.A += ak;
    }
  }
  return block_reduce(la);
}

// Full-vocabulary normalization of the student.
template <class Ts, bool kResident>
__device__ __forceinline__ void kd_topk_row(const KdArgs& a, int64_t row, int rank) {
  constexpr int KV = kVec<Ts>;  // values per 16-byte vector (a.K is the number of top-K slots)
  int64_t begin, end;
  split_range(a.V, a.C, rank, &begin, &end);
  const int64_t n = end - begin;
  const Ts* srow = static_cast<const Ts*>(a.s) + row * a.lds;
  const Ts* s = srow + begin;
  Ts* ds = a.ds ? static_cast<Ts*>(a.ds) + row * a.ldd + begin : nullptr;
  Ts* ss = reinterpret_cast<Ts*>(g_smem);
  const int64_t ib = row * a.ldi;
  const float* lp = a.lp + row * a.ldlp;
  const RowCtx c{row, a.C, rank, a.p0, a.p1};
  bool any_used, any_oob;
  topk_status(a, ib, &any_used, &any_oob);
  const bool masked = !any_used || target_masked(a, row);
  if (masked || any_oob) {
    kd_fixed_row<Ts>(a, row, rank, ds, n, masked ? 0.f : NAN, masked ? 0.f : NAN, masked ? 0 : 1);
    return;
  }
  const float inv_t = 1.f / a.temperature;

  // Phase 0: raw max of the student (its slice goes to shared memory on the way).
  MaxF mx;
  if (a.p0 == 0) {
    RawMax<Ts> rs;
    if constexpr (kResident) {
      load_slice<Ts>(
          s, int(n), ss, [&](const uint4& raw, int) { rs.vec(raw); }, [&](float x, int) { rs.one(x); });
    } else {
      row_visit<Ts>(s, 0, n, [&](const float(&v)[KV], int64_t, int cnt) {
#pragma unroll
        for (int k = 0; k < KV; ++k)
          if (k < cnt) rs.one(v[k]);
      });
    }
    mx.m = rs.get();
    mx = block_reduce(mx);
  }
  if (!exchange<0>(c, 0, mx, static_cast<MaxF*>(a.ws0))) return;
  const float ms = mx.m * inv_t;

  // Phase 1: the student's lse over the full vocabulary.
  SumF sum;
  if (a.p0 <= 1) {
    if (ms != -INFINITY)
      visit1<Ts, kResident>(s, ss, n, [&](const float(&v)[KV], int64_t, int cnt) {
#pragma unroll
        for (int k = 0; k < KV; ++k)
          if (k < cnt) sum.s += fexp(zdiff(v[k], inv_t, ms));
      });
    sum = block_reduce(sum);
  }
  if (!exchange<1>(c, 1, sum, static_cast<SumF*>(a.ws1))) return;
  const LogProb logq{inv_t, ms, logf(sum.s)}, logp = topk_teacher_logp(a, ib, lp);
  const KdTerm term(a.div, a.beta);
  // Student logit at a column of this block's slice (shared memory or global memory).
  auto s_at = [&](int64_t id) -> float {
    if constexpr (kResident) return to_float(ss[id - begin]);
    else return to_float(srow[id]);
  };

  // Phase 2: the terms at the ids inside this block's columns.
  LossA la;
  if (a.p0 <= 2) {
    for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
      const int64_t id = load_index(a.ids, a.ids64, ib + k);
      if (id >= begin && id < end) {
        float ak;
        la.loss += term(logp(lp[k]), logq(s_at(id)), &ak);
        la.A += ak;
      }
    }
    la = block_reduce(la);
  }
  if (!exchange<2>(c, 2, la, static_cast<LossA*>(a.ws2))) return;
  if (rank == 0 && threadIdx.x == 0) {
    a.row_loss[row] = la.loss * a.t2;
    if (a.row_used) a.row_used[row] = 1;
  }
  if (!ds) return;

  // Phase 3: -q_j A everywhere, then a_k - q_k A at the ids (as the CPU), times scale (kd_grad).
  const float scale = kd_grad_scale(a, row), A = la.A;
  auto id_value = [&](int64_t k, int64_t id) {
    const float lq = logq(s_at(id));
    float ak;
    (void)term(logp(lp[k]), lq, &ak);
    return kd_grad(ak, fexp(lq), A, scale);
  };
  if constexpr (!kResident) {  // in place, the dense pass overwrites the student: take the ids first
    for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
      const int64_t id = load_index(a.ids, a.ids64, ib + k);
      if (id >= begin && id < end) a.slot_val[row * a.K + k] = id_value(k, id);
    }
    __syncthreads();
  }
  visit1<Ts, kResident>(s, ss, n, [&](const float(&v)[KV], int64_t e0, int cnt) {
    float g[KV];
#pragma unroll
    for (int k = 0; k < KV; ++k) g[k] = k < cnt ? kd_grad(0.f, fexp(logq(v[k])), A, scale) : 0.f;
    store_vals<Ts, KV>(ds + e0, g, cnt);
  });
  __syncthreads();  // the dense stores are done before the id values replace them
  for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
    const int64_t id = load_index(a.ids, a.ids64, ib + k);
    if (id >= begin && id < end) {
      float val;
      if constexpr (kResident) val = id_value(k, id);
      else val = a.slot_val[row * a.K + k];
      ds[id - begin] = from_float<Ts>(val);
    }
  }
}

template <class Ts, bool kResident>
__global__ void __launch_bounds__(kKdThreads, 3) kd_topk_kernel(const KdArgs a) {
  const int rank = int(blockIdx.x % unsigned(a.C));
  const int64_t stride = int64_t(gridDim.x / unsigned(a.C));
  for (int64_t row = blockIdx.x / unsigned(a.C); row < a.N; row += stride) {
    kd_topk_row<Ts, kResident>(a, row, rank);
    if (a.cluster) cluster_sync_all();
    else __syncthreads();
  }
}

// Forward only with full-vocabulary normalization (many rows): one block per row streams the student row once
// for its lse (online softmax in base 2), then takes the K terms at the ids (the row is still in L2).
template <class Ts>
__global__ void __launch_bounds__(kKdThreads) kd_topk_onepass_kernel(const KdArgs a) {
  constexpr int KV = kVec<Ts>;
  const float inv_t = 1.f / a.temperature, c = kLog2e * inv_t;
  for (int64_t row = blockIdx.x; row < a.N; row += gridDim.x) {
    const Ts* srow = static_cast<const Ts*>(a.s) + row * a.lds;
    const int64_t ib = row * a.ldi;
    const float* lp = a.lp + row * a.ldlp;
    bool any_used, any_oob;
    topk_status(a, ib, &any_used, &any_oob);
    const bool masked = !any_used || target_masked(a, row);
    if (masked || any_oob) {
      if (threadIdx.x == 0) {
        a.row_loss[row] = masked ? 0.f : NAN;
        if (a.row_used) a.row_used[row] = masked ? 0 : 1;
      }
      continue;
    }
    OnlineSoftmax acc;  // fused form
    row_visit<Ts>(srow, 0, a.V, [&](const float(&v)[KV], int64_t, int cnt) { acc.add_fused_group<KV>(v, cnt, c); });
    acc = block_reduce(acc);
    const LossA la = topk_terms<Ts>(a, ib, lp, srow, topk_teacher_logp(a, ib, lp), LogProb2{c, acc.m, log2f(acc.d)});
    if (threadIdx.x == 0) {
      a.row_loss[row] = la.loss * a.t2;
      if (a.row_used) a.row_used[row] = 1;
    }
  }
}

// Renormalized over the K: one block per row; only the student logits at the ids are read.
template <class Ts>
__global__ void __launch_bounds__(128) kd_topk_renorm_kernel(const KdArgs a) {
  for (int64_t row = blockIdx.x; row < a.N; row += gridDim.x) {
    const Ts* srow = static_cast<const Ts*>(a.s) + row * a.lds;
    Ts* ds = a.ds ? static_cast<Ts*>(a.ds) + row * a.ldd : nullptr;
    const int64_t ib = row * a.ldi;
    const float* lp = a.lp + row * a.ldlp;
    const float inv_t = 1.f / a.temperature;
    bool any_used, any_oob;
    topk_status(a, ib, &any_used, &any_oob);
    const bool masked = !any_used || target_masked(a, row);
    if (masked || any_oob) {
      if (ds) fill_slice<Ts>(ds, a.V, masked ? 0.f : NAN);
      if (threadIdx.x == 0) {
        a.row_loss[row] = masked ? 0.f : NAN;
        if (a.row_used) a.row_used[row] = masked ? 0 : 1;
      }
      __syncthreads();
      continue;
    }
    const LogProb logp = topk_teacher_logp(a, ib, lp);
    // The student's log-probabilities over the used slots.
    MaxF m;
    for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
      const int64_t id = load_index(a.ids, a.ids64, ib + k);
      if (id >= 0) m.m = fmaxf(m.m, to_float(srow[id]) * inv_t);
    }
    m = block_reduce(m);
    SumF sum;
    if (m.m != -INFINITY)
      for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
        const int64_t id = load_index(a.ids, a.ids64, ib + k);
        if (id >= 0) sum.s += fexp(zdiff(to_float(srow[id]), inv_t, m.m));
      }
    sum = block_reduce(sum);
    const LogProb logq{inv_t, m.m, logf(sum.s)};
    const KdTerm term(a.div, a.beta);
    const LossA la = topk_terms<Ts>(a, ib, lp, srow, logp, logq);
    if (threadIdx.x == 0) {
      a.row_loss[row] = la.loss * a.t2;
      if (a.row_used) a.row_used[row] = 1;
    }
    if (ds) {
      // a_k - q_k A at the ids, 0 elsewhere; the ids' values are taken before the zeros go in (in place).
      const float scale = kd_grad_scale(a, row), A = la.A;
      for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
        const int64_t id = load_index(a.ids, a.ids64, ib + k);
        if (id >= 0) {
          const float lq = logq(to_float(srow[id]));
          float ak;
          (void)term(logp(lp[k]), lq, &ak);
          a.slot_val[row * a.K + k] = kd_grad(ak, fexp(lq), A, scale);
        }
      }
      __syncthreads();
      fill_slice<Ts>(ds, a.V, 0.f);
      __syncthreads();
      for (int64_t k = threadIdx.x; k < a.K; k += blockDim.x) {
        const int64_t id = load_index(a.ids, a.ids64, ib + k);
        if (id >= 0) ds[id] = from_float<Ts>(a.slot_val[row * a.K + k]);
      }
    }
    __syncthreads();
  }
}

}  // namespace
}  // namespace fce::cuda
