// Cross-entropy and logsumexp device code for rows split across blocks: the split paths (partial + merge
// kernels, or one cluster launch), the gradient of split rows and of the backward, and the register-resident
// few-row kernel of the regs path.
#pragma once
#include "cuda/ce_kernels.cuh"

namespace fce::cuda {
namespace {

// Split rows, phase 1: statistics of split blockIdx.x of row blockIdx.y.
template <class T>
__global__ void __launch_bounds__(kRowThreads) partial_kernel(CeParams p) {
  const int64_t row = blockIdx.y;
  int64_t b, e;
  split_range(p.V, p.splits, blockIdx.x, &b, &e);
  const T* x = static_cast<const T*>(p.x) + row * p.ld;
  allow_dependents();  // the merge kernel may start its launch (it waits for this grid's writes)
  const CeAcc a = row_stats<T>(p, x, b, e);
  if (threadIdx.x == 0) p.partial[row * p.splits + blockIdx.x] = a;
}

// Split rows, phase 2: merge the splits of each row in order and write its outputs.
template <class T>
__global__ void merge_kernel(CeParams p) {
  wait_prior_grid();   // launched as a programmatic dependent of partial_kernel where the device allows
  allow_dependents();  // the cross-entropy finalize kernel may start its launch
  const int64_t row = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (row >= p.N) return;
  CeAcc a = p.partial[row * p.splits];
  for (int k = 1; k < p.splits; ++k) a.merge(p.partial[row * p.splits + k]);
  float H;
  const LsePair lse = write_row_outputs<T>(p, row, a, nullptr, &H);
  if (p.row_lse) p.row_lse[row] = lse;
  if (p.row_ent) p.row_ent[row] = H;
}

// The merge as a programmatic dependent of partial_kernel (sm_90 code on an sm_90 device): its launch
// overlaps the partials (faster; measured in docs/lab-notes.md, "Kernel choices").
template <class T>
void launch_merge(cudaStream_t s, const CeParams& k, bool dependent) {
  launch_ex(merge_kernel<T>, dim3(unsigned((k.N + 127) / 128)), dim3(128), 0, s, 0, dependent, "merge kernel", k);
}

// A CeAcc as two 16-byte words for the cluster exchange (no padding bytes on the wire).
struct CeWire {
  uint4 a, b;
};
__device__ __forceinline__ CeWire to_wire(const CeAcc& v) {
  const unsigned long long ai = static_cast<unsigned long long>(v.ai);
  return {make_uint4(__float_as_uint(v.m), __float_as_uint(v.d), __float_as_uint(v.s1), __float_as_uint(v.swz)),
          make_uint4(__float_as_uint(v.av), 0u, unsigned(ai), unsigned(ai >> 32))};
}
__device__ __forceinline__ CeAcc from_wire(const CeWire& w) {
  CeAcc v;
  v.m = __uint_as_float(w.a.x);
  v.d = __uint_as_float(w.a.y);
  v.s1 = __uint_as_float(w.a.z);
  v.swz = __uint_as_float(w.a.w);
  v.av = __uint_as_float(w.b.x);
  v.ai = static_cast<int64_t>(static_cast<unsigned long long>(w.b.z) | static_cast<unsigned long long>(w.b.w) << 32);
  return v;
}

// Split rows in one launch: the splits of a row (2..kMaxGatherCluster) form a cluster; each block's
// statistics (partial_kernel's slices) go to rank 0's shared memory, and rank 0 merges them in split order,
// as merge_kernel does, and writes the row's outputs: no second launch, no partials through device memory.
// Faster than partial + merge (docs/lab-notes.md, "Kernel choices"). At most 64 registers, as partial_kernel
// (4 blocks per SM): at 80, 2x256 rows no longer fit in one wave. Not a programmatic dependent launch,
// unlike the register kernels: it lets its own dependents launch at once, so back to back each launch's
// blocks would be placed while the one before still ran (slower).
template <class T>
__global__ void __launch_bounds__(kRowThreads, 4) split_cluster_kernel(CeParams p) {
  const int C = p.splits;
  const int rank = cluster_rank_of(C);  // == blockIdx.x: the cluster spans gridDim.x
  few_arrive<false>(C, sizeof(CeWire));
  allow_dependents();  // a finalize or gradient kernel may start its launch
  const int64_t row = blockIdx.y;
  int64_t b, e;
  split_range(p.V, C, rank, &b, &e);
  const T* x = static_cast<const T*>(p.x) + row * p.ld;
  const CeAcc a = row_stats<T>(p, x, b, e);
  if (threadIdx.x >= 32) return;
  const CeWire* slot = few_gather_rank0(to_wire(a), C, rank);
  if (rank != 0 || threadIdx.x != 0) return;
  CeAcc m = from_wire(slot[0]);
  for (int k = 1; k < C; ++k) m.merge(from_wire(slot[k]));
  float H;
  const LsePair lse = write_row_outputs<T>(p, row, m, nullptr, &H);
  if (p.row_lse) p.row_lse[row] = lse;
  if (p.row_ent) p.row_ent[row] = H;
}

// Launches the split rows' statistics and outputs: one cluster launch (`cluster`: the plan's split_cluster
// path), else partial_kernel then merge_kernel (split_phased).
template <class T>
void launch_split_rows(const fce_handle* h, cudaStream_t s, const CeParams& k, bool cluster) {
  if (cluster) {
    launch_ex(split_cluster_kernel<T>, dim3(unsigned(k.splits), unsigned(k.N)), dim3(kRowThreads), 0, s, k.splits,
              false, "split rows kernel", k);
    return;
  }
  partial_kernel<T><<<dim3(unsigned(k.splits), unsigned(k.N)), kRowThreads, 0, s>>>(k);
  launch_merge<T>(s, k, h->caps.clusters);
}

// Split rows (and the backward), phase 3: gradient of split blockIdx.x of row blockIdx.y.
template <class T, class O>
__global__ void __launch_bounds__(kRowThreads) grad_kernel(CeParams p) {
  const int64_t row = blockIdx.y;
  int64_t b, e;
  split_range(p.V, p.splits, blockIdx.x, &b, &e);
  const float H = p.saved_entropy ? p.saved_entropy[row] : p.row_ent ? p.row_ent[row] : 0.f;
  write_grad<T, O>(p, row, b, e, p.saved_lse ? saved_lse_of(p, row) : p.row_lse[row], H);
}

// Few rows of logsumexp in one launch: C blocks per row (a cluster of up to 16), each holding its slice in
// registers; the blocks' (max, sum) partials are pushed to rank 0, which merges them in a fixed order
// (few_merge) and writes the row's logsumexp. kCe: the row's cross-entropy outputs instead (loss, z-loss,
// lse; no soft-cap, label smoothing, entropy or argmax: ce_regs_ok), rank 0's thread 0 loading the target
// and its logit while the slice's loads are in flight.
template <class T, int R, bool kCe = false>
__global__ void __launch_bounds__(1024) lse_regs_kernel(CeParams p) {
  const FewCtx f = few_ctx(p.V, p.splits, p.chunk);
  wait_prior_grid();  // a programmatic dependent launch: its launch overlaps the end of the kernel before
  const T* x = static_cast<const T*>(p.x) + f.row * p.ld + f.begin;
  uint4 raw[R];
  reg_load_lean<T, R>(x, f.n, raw);
  // The cluster's barrier arrival after the loads are issued, so that nothing but the addresses precedes
  // them.
  few_arrive<false>(p.splits);
  if constexpr (kCe) allow_dependents();  // the finalize kernel of a reduction may start its launch
  RowHints hint{};
  if constexpr (kCe) {
    if (f.rank == 0 && threadIdx.x == 0) {
      hint.t = load_index(p.targets, p.t64, f.row);
      hint.xt = hint.t >= 0 && hint.t < p.V ? to_float(static_cast<const T*>(p.x)[f.row * p.ld + hint.t]) : NAN;
    }
  }
  const float c = p.scale * kLog2e;  // the raw max first, then the scale (scale > 0)
  // Only warp 0 goes on to the exchange (a little faster); the others leave once the block merge has their
  // partials.
  const OnlineSoftmax part = few_partial<T, R, false, true>(raw, f.n, c);
  if (threadIdx.x >= 32 && p.splits > 1) return;
  const FewStats t = few_merge<false>(part, c, p.splits, f.rank);  // rank 0 writes the result
  if (f.rank != 0 || threadIdx.x != 0) return;
  if constexpr (kCe) {
    // The statistics in the scaled logits' units; a +inf scaled max (a +inf logit, or one that overflows
    // with the scale) makes the row NaN, as in accumulate (inf - inf inside the log-sum-exp).
    CeAcc a;
    a.m = t.nan ? NAN : t.m * p.scale;
    a.d = t.nan || a.m == INFINITY ? NAN : t.d;
    write_row_outputs<T>(p, f.row, a, &hint);
  } else {
    p.lse[f.row] = t.nan                ? NAN
                   : t.m == INFINITY     ? INFINITY
                   : t.m == -INFINITY    ? -INFINITY
                                         : (t.m * c + log2f(t.d)) * kLn2;
  }
}

// The register-resident cross-entropy forward covers these options (the others need per-element work or
// outputs that the (max, sum) merge does not carry).
bool ce_regs_ok(const CeParams& k) {
  return !k.dx && !k.saved_lse && k.softcap == 0.f && k.eps == 0.f && !k.entropy && !k.argmax;
}

// The kernels of the register path (for the planner's occupancy questions).
template <class T, bool kCe>
RegKernels lse_regs_kernels(fce_handle* h) {
  return RegKernels(h, reinterpret_cast<const void*>(lse_regs_kernel<T, 1, kCe>),
                    reinterpret_cast<const void*>(lse_regs_kernel<T, 2, kCe>),
                    reinterpret_cast<const void*>(lse_regs_kernel<T, 4, kCe>));
}

// Launches lse_regs_kernel for N rows with register plan `rp`: logsumexp, or (kCe) the cross-entropy
// forward.
template <class T, bool kCe>
void launch_lse_regs(fce_handle* h, cudaStream_t s, CeParams k, const RegPlan& rp) {
  k.splits = rp.C;
  k.chunk = int(slice_cols(k.V, rp.C));
  const bool dependent = h->caps.clusters;  // sm_90 code on an sm_90 device
  dispatch_regs(rp.R, [&](auto r) {
    launch_rows(lse_regs_kernel<T, decltype(r)::value, kCe>, as_row_plan(rp), k.N, k, s,
                kCe ? "cross-entropy kernel" : "logsumexp kernel", dependent);
  });
}

}  // namespace
}  // namespace fce::cuda
