// Knowledge-distillation kernels of the onepass path (forward only, one streaming pass per row) and the
// pipe path (forward or reverse KL with dstudent, persistent blocks pipelining the rows).
#pragma once
#include "cuda/kd_common.cuh"

namespace fce::cuda {
namespace {

// ---- forward only, one pass (forward or reverse KL, many rows) --------------------------------------
// KL(P || Q) = sum_j p_j (z^P_j - z^Q_j) - lse_P + lse_Q (z = logits / T, sum p = 1), so forward and reverse
// KL need no normalized probability per element: one online-softmax pass (Milakov & Gimelshein 2018) over
// both rows keeps (max, sum of e^(z - max)) of each and W = sum_j e^(z^P_j - max P) (z^P_j - z^Q_j), rescaled
// with the P sum. Each row is read once from DRAM, as for a cross-entropy forward. Elements with p_j = 0 add
// nothing (no 0 * inf); identical inputs give W = 0 and equal lse's: exactly 0.
struct KlAcc {  // P and Q states (fused form, c = log2(e)/T), and W = sum 2^(zP - mP) (zP - zQ) at P's max
  OnlineSoftmax p, q;
  float w;  // while a thread adds values: in raw units (xP - xQ); times c before any merge
  __device__ KlAcc() : w(0.f) {}
  __device__ void merge(const KlAcc& o) {
    const OnlineSoftmax::Factors f = p.merge(o.p, 1.f);
    w = __fadd_rn(__fmul_rn(w, f.a), __fmul_rn(o.w, f.b));
    q.merge(o.q, 1.f);
  }
  template <int G>
  __device__ __forceinline__ void add(const float (&xp)[G], const float (&xq)[G], int n, float c) {
    float wk = 0.f, r = 1.f;  // this group's part, at the new max
    p.add_fused_group<G>(xp, n, c, [&](float f) { r = f; }, [&](int k, float e) {
      if (e != 0.f) wk = fmaf(e, xp[k] - xq[k], wk);
    });
    w = __fadd_rn(__fmul_rn(w, r), wk);
    q.add_fused_group<G>(xq, n, c);
  }
  // KL(P || Q) / ln 2 = W/d_P + lse_Q - lse_P, the lse difference taken as (m_Q - m_P) + (log2 d_Q - log2 d_P):
  // each max is the reference its own sum was taken against, so their rounding cancels exactly, where
  // m + log2 d rounded would leave ulp(m), an error that grows with an offset of the logits.
  __device__ float kl2() const {
    return w / p.d + __fadd_rn(__fsub_rn(q.m, p.m), __fsub_rn(log2f(q.d), log2f(p.d)));
  }
};

// Warp merge of KlAcc partials, the result bitwise the same in every lane: the maxima first (exact), then
// each lane's sums rescaled once and added by butterflies, P and Q by the same explicitly rounded steps
// (equal rows give equal states). Shorter than five pairwise merges, whose exponentials sit on the chain.
__device__ __forceinline__ KlAcc kl_warp_all(const KlAcc& v) {
  float pm = v.p.m, qm = v.q.m;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    pm = fmaxf(pm, __shfl_xor_sync(0xffffffffu, pm, o));
    qm = fmaxf(qm, __shfl_xor_sync(0xffffffffu, qm, o));
  }
  const float rp = OnlineSoftmax::rescale(v.p.m, pm), rq = OnlineSoftmax::rescale(v.q.m, qm);  // a NaN sum stays NaN
  float pd = __fmul_rn(v.p.d, rp), qd = __fmul_rn(v.q.d, rq), w = __fmul_rn(v.w, rp);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    pd = __fadd_rn(pd, __shfl_xor_sync(0xffffffffu, pd, o));
    qd = __fadd_rn(qd, __shfl_xor_sync(0xffffffffu, qd, o));
    w = __fadd_rn(w, __shfl_xor_sync(0xffffffffu, w, o));
  }
  KlAcc r;
  r.p.m = pm;
  r.p.d = pd;
  r.q.m = qm;
  r.q.d = qd;
  r.w = w;
  return r;
}

// Block merge with kl_warp_all, in every thread; the block reduction of every KlAcc (the shared scratch is
// free again on return, as with block_reduce).
__device__ __forceinline__ KlAcc kl_block_all(const KlAcc& v) {
  __shared__ float sh[5][32];
  const KlAcc t = kl_warp_all(v);
  const int lane = int(threadIdx.x & 31u), warp = int(threadIdx.x >> 5);
  if (lane == 0) {
    sh[0][warp] = t.p.m;
    sh[1][warp] = t.p.d;
    sh[2][warp] = t.q.m;
    sh[3][warp] = t.q.d;
    sh[4][warp] = t.w;
  }
  __syncthreads();
  KlAcc u;  // -inf maxima and zero sums past the last warp
  if (lane < int(blockDim.x >> 5)) {
    u.p.m = sh[0][lane];
    u.p.d = sh[1][lane];
    u.q.m = sh[2][lane];
    u.q.d = sh[3][lane];
    u.w = sh[4][lane];
  }
  u = kl_warp_all(u);
  __syncthreads();  // every warp has read sh
  return u;
}

// One block per row; DIV is forward KL (P = teacher) or reverse KL (P = student).
template <class Ts, class Tt, int DIV>
__global__ void __launch_bounds__(kKdThreads) kd_kl_onepass_kernel(const KdArgs a) {
  constexpr int G = kGroup<Ts, Tt>;
  const float c = kLog2e / a.temperature;  // z2 = x * log2(e) / T
  for (int64_t row = blockIdx.x; row < a.N; row += gridDim.x) {
    if (target_masked(a, row)) {
      if (threadIdx.x == 0) {
        a.row_loss[row] = 0.f;
        if (a.row_used) a.row_used[row] = 0;
      }
      continue;
    }
    const Ts* s = static_cast<const Ts*>(a.s) + row * a.lds;
    const Tt* t = static_cast<const Tt*>(a.t) + row * a.ldt;
    KlAcc acc;
    visit2<Ts, Tt, false>(s, t, nullptr, nullptr, a.V, [&](const float(&vs)[G], const float(&vt)[G], int64_t, int cnt) {
      if constexpr (DIV == FCE_KD_FORWARD_KL) acc.add<G>(vt, vs, cnt, c);
      else acc.add<G>(vs, vt, cnt, c);
    });
    acc.w = __fmul_rn(acc.w, c);
    acc = kl_block_all(acc);
    if (threadIdx.x == 0) {
      // Every P and Q step mirrors the other, so equal rows give exactly 0.
      const float loss = acc.kl2() * kLn2;
      a.row_loss[row] = loss * a.t2;
      if (a.row_used) a.row_used[row] = 1;
    }
  }
}


// ---- with the gradient, forward or reverse KL (many rows, one dtype, 16-byte aligned rows) -------------
// Two passes per row: the statistics (KlAcc), then dstudent. With P = teacher for forward KL and P = student
// for reverse KL, a_j sums in closed form (A = -1, and A = KL + 1), so the gradient needs no third pass:
//   forward KL  dL/dz_j = q_j - p_j                        reverse KL  dL/dz_j = q_j (log q_j - log p_j - KL)
// Persistent clusters of C = 1 or 2 blocks (one block per SM), block `rank` owning a C-th of every row
// pair (16-byte vectors; the last rank also the scalar tail): the first cache_vecs vectors of its slice of
// both rows sit in shared memory, brought there by asynchronous copies issued as the previous row's gradient
// pass frees each slot, so the loads of row r + 1 overlap the stores of row r; the rest of the slice is
// re-read from L2. Splitting a row pair over C SMs keeps most of it in shared memory (bf16, V = 128256: 45%
// of a row pair fits one SM, 88% of a half), instead of re-reading it through an L2 that keeps only part of
// it. The C blocks swap their row statistics through distributed shared memory (double-buffered slots: one
// cluster barrier per row) and merge them in rank order, so every block holds bitwise the same statistics.
template <class T, int DIV, int C>
__global__ void __launch_bounds__(1024, 1) kd_kl_grad_pipe_kernel(const KdArgs a, int64_t cache_vecs) {
  extern __shared__ uint4 cache[];  // [0, cache_vecs) student, [cache_vecs, 2 cache_vecs) teacher
  constexpr int K = kVec<T>;
  const float c = kLog2e / a.temperature;
  const int64_t nvec = a.V / K;
  const int rank = C > 1 ? int(blockIdx.x % unsigned(C)) : 0;
  const int64_t per = (nvec + C - 1) / C;
  const int v0 = int(per * rank < nvec ? per * rank : nvec);  // this block's vectors [v0, v1) of each row
  const int v1 = int(per * (rank + 1) < nvec ? per * (rank + 1) : nvec);
  const bool tail = rank == C - 1;  // the scalar tail past the last full vector
  const int cv = int(cache_vecs < v1 - v0 ? cache_vecs : v1 - v0);
  auto srow = [&](int64_t r) { return static_cast<const T*>(a.s) + r * a.lds; };
  auto trow = [&](int64_t r) { return static_cast<const T*>(a.t) + r * a.ldt; };
  const unsigned long long once = l2_policy_evict_first(), keep = l2_policy_evict_last();
  auto fetch = [&](int64_t r, int i) {  // slot i of row r into shared memory (read once: evict first)
    cp_async16_first(cache + i, reinterpret_cast<const uint4*>(srow(r)) + v0 + i, once);
    cp_async16_first(cache + cache_vecs + i, reinterpret_cast<const uint4*>(trow(r)) + v0 + i, once);
  };
  const int64_t stride = int64_t(gridDim.x / unsigned(C));
  int64_t row = int64_t(blockIdx.x / unsigned(C));
  if (row >= a.N) return;  // every block of the cluster alike
  for (int i = int(threadIdx.x); i < cv; i += int(blockDim.x)) fetch(row, i);
  cp_async_commit();
  for (int it = 0; row < a.N; row += stride, ++it) {
    const bool masked = target_masked(a, row);
    const T* s = srow(row);
    const T* t = trow(row);
    const uint4* sv = reinterpret_cast<const uint4*>(s);
    const uint4* tv = reinterpret_cast<const uint4*>(t);
    // Per thread: P and Q states in base 2 (max of x c, sum of 2^(x c - max)) and W in raw units, each
    // side updated by the same explicitly rounded steps (equal rows give bitwise-equal states).
    OnlineSoftmax ps, qs;  // fused form
    float w = 0.f;
    auto add = [&](const float* xp, const float* xq, int n, float vmp, float vmq) {
      ps.add_fused(xp, n, vmp, c, [&](float r) { w = __fmul_rn(w, r); }, [&](int k, float e) {
        if (e != 0.f) w = fmaf(e, xp[k] - xq[k], w);
      });
      qs.add_fused(xq, n, vmq, c);
    };
    auto add_vec = [&](const uint4& rs, const uint4& rt) {
      float vs[K], vt[K];
      unpack_words<T>(rs, vs);
      unpack_words<T>(rt, vt);
      const float ms = vec_max<T>(rs), mt = vec_max<T>(rt);
      if constexpr (DIV == FCE_KD_FORWARD_KL) add(vt, vs, K, mt, ms);
      else add(vs, vt, K, ms, mt);
    };
    // The uncached part first: its loads need no wait, and the slots' copies issued at the end of the
    // previous row land meanwhile.
    if (!masked) {
      for (int base = v0 + cv + int(threadIdx.x); base < v1; base += 2 * int(blockDim.x)) {
        uint4 rs[2], rt[2];
#pragma unroll
        for (int u = 0; u < 2; ++u)
          if (base + u * int(blockDim.x) < v1) {
            rs[u] = ld_hint_nc(sv + base + u * blockDim.x, keep);  // read again by the gradient pass
            rt[u] = ld_hint_nc(tv + base + u * blockDim.x, keep);
          }
#pragma unroll
        for (int u = 0; u < 2; ++u)
          if (base + u * int(blockDim.x) < v1) add_vec(rs[u], rt[u]);
      }
      if (tail)
        for (int64_t j = nvec * K + threadIdx.x; j < a.V; j += blockDim.x) {
          const float xs = to_float(s[j]), xt = to_float(t[j]);
          if constexpr (DIV == FCE_KD_FORWARD_KL) add(&xt, &xs, 1, xt, xs);
          else add(&xs, &xt, 1, xs, xt);
        }
    }
    cp_async_wait_all();  // this thread's slots (only it reads them); a masked row's too, before refilling
    if (!masked)
      for (int i = int(threadIdx.x); i < cv; i += int(blockDim.x)) add_vec(cache[i], cache[cache_vecs + i]);
    KlAcc acc;
    acc.p = ps;
    acc.q = qs;
    acc.w = w * c;
    acc = kl_block_all(acc);
    if constexpr (C > 1) {  // the row's C partials, merged in rank order in every block
      KlAcc* slot = exchange_slot<KlAcc[2], 0>()[0];
      KlAcc* merged = exchange_slot<KlAcc, 1>();
      if (threadIdx.x == 0) slot[it & 1] = acc;
      cluster_sync_all();
      if (threadIdx.x == 0) {
        KlAcc m = cluster_peer(slot + (it & 1), 0);
        for (int r = 1; r < C; ++r) m.merge(cluster_peer(slot + (it & 1), r));
        *merged = m;
      }
      __syncthreads();
      acc = *merged;
    }
    const float kl2 = acc.kl2();  // KL / ln 2
    if (rank == 0 && threadIdx.x == 0) {
      a.row_loss[row] = masked ? 0.f : kl2 * kLn2 * a.t2;
      if (a.row_used) a.row_used[row] = masked ? 0 : 1;
    }
    const float scale = masked ? 0.f : kd_grad_scale(a, row);
    // Student (s) and teacher (t) from max-shifted values, as KlAcc::kl2: u_j = x_j c - m (one fused
    // multiply-add), q_j = 2^(u_j) / d. Forward KL: (q_j - p_j) scale, the 1/d folded into the scale.
    // Reverse KL: q_j (log2 q_j - log2 p_j - KL/ln2) ln2 scale = q_j ((us_j - ut_j) - K2) ln2 scale, with
    // K2 = (log2 d_s - log2 d_t) + KL/ln2 (no max in it: nothing grows with an offset of the logits). Few
    // live values: the kernel has 64 registers.
    const OnlineSoftmax& st = DIV == FCE_KD_FORWARD_KL ? acc.q : acc.p;
    const OnlineSoftmax& tt = DIV == FCE_KD_FORWARD_KL ? acc.p : acc.q;
    const float ms = st.m, mt = tt.m;
    const float qscale = scale / st.d, pscale = scale / tt.d;  // forward KL
    // A reverse-KL row whose KL is +inf (the teacher has probability 0 where the student has mass) takes
    // kd_grad's limit through the same arithmetic: K2 = FLT_MAX and rscale = +-inf (the scale's sign) make
    // e ((us - ut) - K2) rscale +inf at ut = -inf and -inf elsewhere; a zero scale writes zeros.
    const bool inf_row = DIV == FCE_KD_REVERSE_KL && kl2 == INFINITY;
    const bool zero = masked || (inf_row && scale == 0.f);
    const float K2 = inf_row ? FLT_MAX : __fadd_rn(__fsub_rn(log2f(st.d), log2f(tt.d)), kl2);  // reverse KL
    const float rscale = inf_row ? INFINITY * scale : kLn2 * scale / st.d;
    auto grad = [&](float xs, float xt) {
      const float us = fmaf(xs, c, -ms), ut = fmaf(xt, c, -mt);
      if (DIV == FCE_KD_FORWARD_KL) return ex2(us) * qscale - ex2(ut) * pscale;
      const float e = ex2(us);  // q_j d_s
      if (e == 0.f) return 0.f;  // a -inf student logit: exactly 0
      return e * ((us - ut) - K2) * rscale;
    };
    T* ds = static_cast<T*>(a.ds) + row * a.ldd;
    uint4* dv = reinterpret_cast<uint4*>(ds);
    const int64_t next = row + stride;
    auto grad_vec = [&](const uint4& rs, const uint4& rt) {
      float vs[K], vt[K], g[K];
      unpack_words<T>(rs, vs);
      unpack_words<T>(rt, vt);
#pragma unroll
      for (int k = 0; k < K; ++k) g[k] = zero ? 0.f : grad(vs[k], vt[k]);
      return pack<T>(g);
    };
    // The uncached part first and backwards, the most recently read (still in L2) first; then the cached
    // slots, each refilled with the next row as soon as it is used. dstudent is stored evict-first, so
    // that it does not push the rows out of L2.
    const int nu = v1 - v0 - cv;
    for (int base = int(threadIdx.x); base < nu; base += 2 * int(blockDim.x)) {
      uint4 rs[2], rt[2];
#pragma unroll
      for (int u = 0; u < 2; ++u)
        if (base + u * int(blockDim.x) < nu) {
          const int i = v1 - 1 - (base + u * int(blockDim.x));
          rs[u] = ld_hint(sv + i, once);  // coherent loads (dstudent may be the student), last use
          rt[u] = ld_hint(tv + i, once);
        }
#pragma unroll
      for (int u = 0; u < 2; ++u)
        if (base + u * int(blockDim.x) < nu) {
          const int i = v1 - 1 - (base + u * int(blockDim.x));
          store_stream(dv + i, grad_vec(rs[u], rt[u]));
        }
    }
    for (int i = int(threadIdx.x); i < cv; i += int(blockDim.x)) {
      store_stream(dv + v0 + i, grad_vec(cache[i], cache[cache_vecs + i]));
      if (next < a.N) fetch(next, i);
    }
    if (tail)
      for (int64_t j = nvec * K + threadIdx.x; j < a.V; j += blockDim.x) {
        const float xs = to_float(s[j]), xt = to_float(t[j]);
        ds[j] = from_float<T>(zero ? 0.f : grad(xs, xt));
      }
    cp_async_commit();
  }
  if constexpr (C > 1) cluster_sync_all();  // peers may read this block's slots until here
}

}  // namespace
}  // namespace fce::cuda
