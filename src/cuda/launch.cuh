// Host side of launching a plan (the plans: cuda/plan.hpp): the register kernels as the planner's
// ClusterFit, alignment, and the launchers of row plans (grid, clusters, shared memory).
#pragma once
#include <algorithm>
#include <utility>

#include "cuda/few_rows.cuh"

namespace fce::cuda {
namespace {

// ---- host side: launching a plan (the plans: cuda/plan.hpp) ----------------------------------------

// The kernels a register plan launches for R = 1, 2, 4 vectors per thread (their register counts differ),
// or one stand-in for all three, as the planner's ClusterFit: the runtime's occupancy answers, asked once
// per handle.
struct RegKernels : ClusterFit {
  fce_handle* h;
  const void* k[3];
  RegKernels(fce_handle* hh, const void* all) : h(hh), k{all, all, all} {}
  RegKernels(fce_handle* hh, const void* r1, const void* r2, const void* r4) : h(hh), k{r1, r2, r4} {}
  const void* of(int R) const { return k[R <= 1 ? 0 : R == 2 ? 1 : 2]; }
  int clusters(int R, int C, int threads) const override { return max_active_clusters(h, of(R), C, threads); }
  bool nonportable(int R) const override { return allow_cluster(of(R), kMaxFewCluster); }
};

// 16-byte aligned rows (pointer and row stride).
inline bool aligned16(const void* data, int64_t ld, int esize) {
  return ((reinterpret_cast<uintptr_t>(data) | uintptr_t(ld * esize)) & 15u) == 0;
}

RowPlan as_row_plan(const RegPlan& r) {
  RowPlan p;
  p.C = r.C;
  p.cluster = r.C > 1;
  p.threads = r.threads;
  p.replicas = r.D;
  return p;
}

// Calls body(std::integral_constant<int, R>) for R in {1, 2, 4}.
template <class F>
void dispatch_regs(int R, F&& body) {
  switch (R) {
    case 1: body(std::integral_constant<int, 1>{}); break;
    case 2: body(std::integral_constant<int, 2>{}); break;
    default: body(std::integral_constant<int, 4>{}); break;
  }
}

// Launches `grid` blocks of plan `p` (threads, dynamic shared memory, clusters of C when p.cluster).
// `dependent`: a programmatic dependent launch (launch_ex), for kernels that call wait_prior_grid before
// their first global memory access.
template <class... P, class... A>
void launch_grid(void (*kernel)(P...), const RowPlan& p, int64_t grid, cudaStream_t s, const char* what,
                 bool dependent, A&&... args) {
  if (p.cluster && !allow_cluster(reinterpret_cast<const void*>(kernel), p.C))
    raise(FCE_STATUS_INTERNAL_ERROR, "cluster size above 8 not allowed for this kernel");
  launch_ex(kernel, dim3(unsigned(grid), unsigned(p.replicas)), dim3(unsigned(p.threads)), p.smem, s,
            p.cluster ? p.C : 0, dependent, what, std::forward<A>(args)...);
}

// Launches N rows of plan `p` (N * C blocks, or fewer that loop over the rows); `dependent` as in
// launch_grid.
template <class Args>
void launch_rows(void (*kernel)(Args), const RowPlan& p, int64_t N, const Args& a, cudaStream_t s,
                 const char* what, bool dependent = false) {
  constexpr int64_t kMaxGrid = int64_t(1) << 30;
  int64_t grid = N * p.C;
  if (grid > kMaxGrid) grid = kMaxGrid / p.C * p.C;
  if (p.smem > 0)  // static shared memory counts toward the 48 KiB default too: always raise the limit
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(p.smem)),
          "cudaFuncSetAttribute");
  if (p.resident)  // the slices live in shared memory and nothing is re-read through L1: all of it shared
    check(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                               int(cudaSharedmemCarveoutMaxShared)),
          "cudaFuncSetAttribute");
  launch_grid(kernel, p, grid, s, what, dependent, a);
}

}  // namespace
}  // namespace fce::cuda
