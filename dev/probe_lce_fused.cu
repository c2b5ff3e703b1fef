// Linear CE's forward with the loss's statistics in the logits GEMM, the designs around the library's fused
// forward (src/cuda/linear_ce_fused.cu), in one run with L2 flushes and a rotating order:
//   - cublasGemmEx's whole logits GEMM (bf16 out, the library's math mode): the rate to reach;
//   - the library's fce_linear_cross_entropy_fwd as it plans (on sm_90, the fused GEMM with the staged
//     epilogue) and under FCE_FORCE_PATH=linear_ce:chunked (cuBLAS chunks, then the CE rows kernel);
//   - the same CUTLASS mainloop with the reduction in the consumer warp groups' epilogue (the tensor cores
//     wait for it: each tile's rows give (max, sum of exp) in registers and two quad shuffles);
//   - that mainloop with no epilogue work, the bound of any epilogue.
// Each is checked against a float64 lse of cuBLAS's logits (1-ulp bf16 differences of the logits, which come
// from another accumulation order, move lse by ~1e-5 at small shapes).
//
//     probe_lce_fused N H V [ROUNDS]
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/epilogue/thread/linear_combination.h"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/gemm/kernel/tile_scheduler.hpp"
#include "cuda/cutlass_epilogue.hpp"
#include "cuda/online_softmax.cuh"
#include "fusedce/fusedce.h"
#include "probe_util.cuh"

namespace probe {

using probe_util::fill;
using probe_util::once_ms;
using fce::cuda::ex2;
using fce::cuda::kLog2e;

struct CeStatsArgs {
  const int64_t* targets = nullptr;  // [M]
  float2* partials = nullptr;        // [ceil(N / tile N), M]: per tile (max, sum exp(x - max))
  float* target_logit = nullptr;     // [M]
};

// An operator-style epilogue (the interface of cutlass::epilogue::collective::DefaultEpilogue, run by the sm90
// kernels through Sm90TmaWarpSpecializedAdapter) that reduces each accumulator row instead of storing it.
// WGMMA's accumulator layout: a warp's quad of lanes holds one row (values ((2, 2, N/8), THR_M, THR_N): mode
// 0.1 steps 8 rows), so a row's tile reduces in registers, then over the quad by two shuffles.
template <bool kNoop = false>
class CeStatsEpilogue : public fce::cuda::NoOperandEpilogue<CeStatsArgs> {
 public:
  struct SharedStorage {};
  using TensorStorage = SharedStorage;

  CUTLASS_HOST_DEVICE CeStatsEpilogue(Params const& p, SharedStorage const& = SharedStorage()) : params(p) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem_shape_mnkl, BlockShapeMNK blk_shape_MNK,
                                 BlockCoordMNKL blk_coord_mnkl, cute::Tensor<FrgEngine, FrgLayout> const& acc,
                                 TiledMma tiled_mma, ResidueMNK, int thread_idx, char*) {
    using namespace cute;
    const int M = int(get<0>(problem_shape_mnkl));
    const int N = int(get<1>(problem_shape_mnkl));
    auto m_coord = get<0>(blk_coord_mnkl);
    auto n_coord = get<1>(blk_coord_mnkl);
    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(blk_shape_MNK),
                           make_coord(m_coord, n_coord));
    Tensor tCcD = tiled_mma.get_thread_slice(thread_idx).partition_C(cD);  // (VEC, THR_M, THR_N) -> (m, n)
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "WGMMA accumulator layout expected");
    static_assert(size<0, 0>(FrgLayout{}) == 2 && size<0, 1>(FrgLayout{}) == 2, "WGMMA accumulator layout expected");
    constexpr int V2 = size<0, 2>(FrgLayout{});
    constexpr int TM = size<1>(FrgLayout{});
    constexpr int TN = size<2>(FrgLayout{});
    if constexpr (kNoop) {  // the mainloop alone: one accumulator per row kept
      CUTLASS_PRAGMA_UNROLL
      for (int tm = 0; tm < TM; ++tm) {
        CUTLASS_PRAGMA_UNROLL
        for (int v1 = 0; v1 < 2; ++v1) {
          auto c = make_coord(make_coord(0, v1, 0), tm, 0);
          const int row = int(get<0>(tCcD(c)));
          if ((thread_idx & 3) == 0 && row < M) params.partials[int64_t(n_coord) * M + row] = make_float2(acc(c), 1.f);
        }
      }
      return;
    }
    // A tile of a cluster's padding, wholly outside the problem, has nothing to write.
    if (int(get<0>(cD(0))) >= M || int(get<1>(cD(0))) >= N) return;
    // Columns of element (v0, v2, tn) relative to the thread's first: static. A tile wholly inside V needs no mask.
    const int n_base = int(get<1>(tCcD(0)));
    const bool full = int(get<1>(tCcD(size(tCcD) - 1))) < N;
    CUTLASS_PRAGMA_UNROLL
    for (int tm = 0; tm < TM; ++tm) {
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        const int row = int(get<0>(tCcD(make_coord(make_coord(0, v1, 0), tm, 0))));
        auto at = [&](int v0, int v2, int tn) { return make_coord(make_coord(v0, v1, v2), tm, tn); };
        auto col = [&](int v0, int v2, int tn) { return int(get<1>(tCcD(at(v0, v2, tn)))); };
        // Max of the raw accumulators: rounding is monotonic, so it rounds to the max of the rounded logits.
        float m4[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
        CUTLASS_PRAGMA_UNROLL
        for (int tn = 0; tn < TN; ++tn) {
          CUTLASS_PRAGMA_UNROLL
          for (int v2 = 0; v2 < V2; ++v2) {
            CUTLASS_PRAGMA_UNROLL
            for (int v0 = 0; v0 < 2; ++v0) {
              const float x = acc(at(v0, v2, tn));
              float& m = m4[(v2 & 1) * 2 + v0];
              m = full || col(v0, v2, tn) < N ? fmaxf(m, x) : m;
            }
          }
        }
        float mx = fmaxf(fmaxf(m4[0], m4[1]), fmaxf(m4[2], m4[3]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        mx = __bfloat162float(__float2bfloat16_rn(mx));
        const float nm = -mx * kLog2e;
        float s4[4] = {0.f, 0.f, 0.f, 0.f};
        CUTLASS_PRAGMA_UNROLL
        for (int tn = 0; tn < TN; ++tn) {
          CUTLASS_PRAGMA_UNROLL
          for (int v2 = 0; v2 < V2; ++v2) {
            const float2 x = __bfloat1622float2(__floats2bfloat162_rn(acc(at(0, v2, tn)), acc(at(1, v2, tn))));
            const float e0 = ex2(fmaf(x.x, kLog2e, nm)), e1 = ex2(fmaf(x.y, kLog2e, nm));
            s4[(v2 & 1) * 2] += full || col(0, v2, tn) < N ? e0 : 0.f;
            s4[(v2 & 1) * 2 + 1] += full || col(1, v2, tn) < N ? e1 : 0.f;
          }
        }
        float s = (s4[0] + s4[1]) + (s4[2] + s4[3]);
        s += __shfl_xor_sync(0xffffffffu, s, 1);
        s += __shfl_xor_sync(0xffffffffu, s, 2);
        if ((thread_idx & 3) == 0 && row < M) params.partials[int64_t(n_coord) * M + row] = make_float2(mx, s);
        // The target's logit, where this tile holds it (one tile of the row's ceil(V / tile) does).
        const int64_t t = row < M ? params.targets[row] : -1;
        if (t >= n_base && t < n_base + int(size<1>(blk_shape_MNK))) {
          CUTLASS_PRAGMA_UNROLL
          for (int tn = 0; tn < TN; ++tn) {
            CUTLASS_PRAGMA_UNROLL
            for (int v2 = 0; v2 < V2; ++v2) {
              CUTLASS_PRAGMA_UNROLL
              for (int v0 = 0; v0 < 2; ++v0) {
                if (col(v0, v2, tn) == t) params.target_logit[row] = __bfloat162float(__float2bfloat16_rn(acc(at(v0, v2, tn))));
              }
            }
          }
        }
      }
    }
  }

 private:
  Params params;
};

using namespace cute;

template <class Tile, class Cluster, class Schedule, bool kNoop = false, int kCarveout = 0>
struct FusedGemm {
  using Epi = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<CeStatsEpilogue<kNoop>>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::bfloat16_t, cutlass::layout::RowMajor, 8,
      cutlass::bfloat16_t, cutlass::layout::ColumnMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<int(sizeof(typename Epi::SharedStorage)) + kCarveout>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epi,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  static constexpr int kTileN = int(size<1>(Tile{}));
};

// Merges a row's tiles in order: lse = m + log(sum_t s_t 2^((m_t - m) log2 e)); loss = lse - x_target.
__global__ void combine(const float2* partials, const float* target_logit, const int64_t* targets, int M, int T,
                        float* lse, float* loss) {
  const int row = blockIdx.x * blockDim.x + threadIdx.x;
  if (row >= M) return;
  float m = -INFINITY;
  for (int t = 0; t < T; ++t) m = fmaxf(m, partials[int64_t(t) * M + row].x);
  float s = 0.f;
  for (int t = 0; t < T; ++t) {
    const float2 p = partials[int64_t(t) * M + row];
    s += p.y * ex2((p.x - m) * kLog2e);
  }
  const float l = m + logf(s);
  lse[row] = l;
  loss[row] = targets[row] < 0 ? 0.f : l - target_logit[row];
}


// float64 lse of a row of cuBLAS's bf16 logits, and its target's logit.
__global__ void ref_rows(const __nv_bfloat16* logits, int V, const int64_t* targets, double* lse, float* tl) {
  const int row = blockIdx.x;
  const __nv_bfloat16* x = logits + int64_t(row) * V;
  __shared__ double red[256];
  double m = -INFINITY;
  for (int j = threadIdx.x; j < V; j += blockDim.x) m = fmax(m, double(__bfloat162float(x[j])));
  red[threadIdx.x] = m;
  __syncthreads();
  for (int o = 128; o > 0; o >>= 1) {
    if (threadIdx.x < o) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + o]);
    __syncthreads();
  }
  m = red[0];
  __syncthreads();
  double s = 0;
  for (int j = threadIdx.x; j < V; j += blockDim.x) s += exp(double(__bfloat162float(x[j])) - m);
  red[threadIdx.x] = s;
  __syncthreads();
  for (int o = 128; o > 0; o >>= 1) {
    if (threadIdx.x < o) red[threadIdx.x] += red[threadIdx.x + o];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    lse[row] = m + log(red[0]);
    tl[row] = __bfloat162float(x[targets[row]]);
  }
}

__global__ void targets_fill(int64_t* t, int M, int V) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < M) t[i] = (i % 17 == 5) ? -100 : int64_t((uint64_t(i) * 2654435761ull) % uint64_t(V));
}


struct Problem {
  int M, K, N;
  __nv_bfloat16 *h, *w, *logits;
  int64_t* targets;
  float2* partials;
  float *tl, *lse, *loss;
};

template <class G>
struct Runner {
  typename G::Gemm gemm;
  void* ws = nullptr;
  int T = 0;
  std::string name;
  bool setup(const Problem& p, int raster, int swizzle, const char* label) {
    T = (p.N + G::kTileN - 1) / G::kTileN;
    typename G::Kernel::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm, {p.M, p.N, p.K, 1},
                                       {reinterpret_cast<cutlass::bfloat16_t*>(p.h),
                                        make_stride(int64_t(p.K), _1{}, int64_t(p.M) * p.K),
                                        reinterpret_cast<cutlass::bfloat16_t*>(p.w),
                                        make_stride(int64_t(p.K), _1{}, int64_t(p.N) * p.K)},
                                       {p.targets, p.partials, p.tl}};
    using R = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params::RasterOrderOptions;
    args.scheduler.raster_order = raster == 0 ? R::Heuristic : raster == 1 ? R::AlongM : R::AlongN;
    args.scheduler.max_swizzle_size = swizzle;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
      std::printf("%s: cannot implement\n", label);
      return false;
    }
    size_t wsb = G::Gemm::get_workspace_size(args);
    if (wsb) CK(cudaMalloc(&ws, wsb));
    CK(int(gemm.initialize(args, ws)));
    name = std::string(label) + " r" + std::to_string(raster) + " s" + std::to_string(swizzle);
    return true;
  }
  void run(const Problem& p) {
    CK(int(gemm.run()));
    combine<<<(p.M + 255) / 256, 256>>>(p.partials, p.tl, p.targets, p.M, T, p.lse, p.loss);
  }
};

}  // namespace probe

using namespace probe;

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: probe_lce_fused N H V [ROUNDS]\n");
    return 2;
  }
  Problem p{};
  p.M = std::atoi(argv[1]);
  p.K = std::atoi(argv[2]);
  p.N = std::atoi(argv[3]);
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 7;
  CK(cudaMalloc(&p.h, size_t(p.M) * p.K * 2));
  CK(cudaMalloc(&p.w, size_t(p.N) * p.K * 2));
  CK(cudaMalloc(&p.logits, size_t(p.M) * p.N * 2));
  CK(cudaMalloc(&p.targets, size_t(p.M) * 8));
  CK(cudaMalloc(&p.partials, size_t(p.M) * ((p.N + 127) / 128) * 8));
  CK(cudaMalloc(&p.tl, size_t(p.M) * 4));
  CK(cudaMalloc(&p.lse, size_t(p.M) * 4));
  CK(cudaMalloc(&p.loss, size_t(p.M) * 4));
  fill<<<1024, 256>>>(p.h, size_t(p.M) * p.K, 2.f, 1);
  fill<<<1024, 256>>>(p.w, size_t(p.N) * p.K, 0.05f, 2);
  targets_fill<<<(p.M + 255) / 256, 256>>>(p.targets, p.M, p.N);
  void* flush = nullptr;
  const size_t flush_bytes = size_t(256) << 20;
  CK(cudaMalloc(&flush, flush_bytes));

  cublasHandle_t cb;
  CK(cublasCreate(&cb));
  CK(cublasSetMathMode(cb, CUBLAS_DEFAULT_MATH));
  const float one = 1.f, zero = 0.f;
  // logits^T [N, M] column-major = W [N, K] row-major times h^T: the library's column-major view.
  auto cublas_logits = [&] {
    CK(cublasGemmEx(cb, CUBLAS_OP_T, CUBLAS_OP_N, p.N, p.M, p.K, &one, p.w, CUDA_R_16BF, p.K, p.h, CUDA_R_16BF, p.K,
                    &zero, p.logits, CUDA_R_16BF, p.N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  };

  // Reference: float64 over cuBLAS's logits.
  cublas_logits();
  double* ref_lse;
  float* ref_tl;
  CK(cudaMalloc(&ref_lse, size_t(p.M) * 8));
  CK(cudaMalloc(&ref_tl, size_t(p.M) * 4));
  ref_rows<<<p.M, 256>>>(p.logits, p.N, p.targets, ref_lse, ref_tl);
  CK(cudaDeviceSynchronize());
  std::vector<double> rl(p.M);
  std::vector<float> rt(p.M);
  std::vector<int64_t> tg(p.M);
  CK(cudaMemcpy(rl.data(), ref_lse, size_t(p.M) * 8, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(rt.data(), ref_tl, size_t(p.M) * 4, cudaMemcpyDeviceToHost));
  CK(cudaMemcpy(tg.data(), p.targets, size_t(p.M) * 8, cudaMemcpyDeviceToHost));

  // The library's forward (loss + lse), for the same run.
  fce_handle_t lib = nullptr;
  CK(fce_handle_create(kDLCUDA, 0, &lib));
  int64_t shp_h[2] = {p.M, p.K}, shp_w[2] = {p.N, p.K}, shp_m[1] = {p.M};
  DLTensor th{p.h, {kDLCUDA, 0}, 2, {kDLBfloat, 16, 1}, shp_h, nullptr, 0};
  DLTensor tw{p.w, {kDLCUDA, 0}, 2, {kDLBfloat, 16, 1}, shp_w, nullptr, 0};
  DLTensor tt{p.targets, {kDLCUDA, 0}, 1, {kDLInt, 64, 1}, shp_m, nullptr, 0};
  float *lib_loss, *lib_lse;
  CK(cudaMalloc(&lib_loss, size_t(p.M) * 4));
  CK(cudaMalloc(&lib_lse, size_t(p.M) * 4));
  DLTensor tlo{lib_loss, {kDLCUDA, 0}, 1, {kDLFloat, 32, 1}, shp_m, nullptr, 0};
  DLTensor tls{lib_lse, {kDLCUDA, 0}, 1, {kDLFloat, 32, 1}, shp_m, nullptr, 0};
  fce_ce_options_t opts = FCE_CE_OPTIONS_INIT;
  opts.reduction = FCE_REDUCTION_NONE;
  fce_linear_ce_outputs_t outs = FCE_LINEAR_CE_OUTPUTS_INIT;
  outs.loss = &tlo;
  outs.lse = &tls;
  auto library_fwd = [&] {
    CK(fce_linear_cross_entropy_fwd(lib, nullptr, &th, &tw, nullptr, &tt, &opts, &outs, nullptr, 0));
  };

  using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  Runner<FusedGemm<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop>> c21;
  Runner<FusedGemm<Shape<_128, _256, _64>, Shape<_2, _1, _1>, Coop, true>> c21n;
  std::vector<std::pair<std::string, std::function<void()>>> variants;
  variants.push_back({"cublasGemmEx logits (bf16 out)", cublas_logits});
  variants.push_back({"library fce_linear_cross_entropy_fwd", library_fwd});
  variants.push_back({"library, FCE_FORCE_PATH=linear_ce:chunked", [&] {
                        setenv("FCE_FORCE_PATH", "linear_ce:chunked", 1);
                        library_fwd();
                        unsetenv("FCE_FORCE_PATH");
                      }});
  auto add = [&](auto& r, int raster, int swz, const char* label) {
    if (r.setup(p, raster, swz, label)) variants.push_back({r.name, [&] { r.run(p); }});
  };
  add(c21, 1, 1, "epilogue in the consumers 128x256 c2x1");
  add(c21n, 1, 1, "mainloop alone (no epilogue) 128x256 c2x1");

  // Correctness of every fused variant and of the library against the float64 reference.
  std::vector<float> lse(p.M), loss(p.M);
  for (size_t v = 1; v < variants.size(); ++v) {
    if (variants[v].first.find("no epilogue") != std::string::npos) continue;
    CK(cudaMemset(p.lse, 0xff, size_t(p.M) * 4));
    CK(cudaMemset(p.loss, 0xff, size_t(p.M) * 4));
    CK(cudaMemset(p.tl, 0xff, size_t(p.M) * 4));
    variants[v].second();
    CK(cudaDeviceSynchronize());
    const bool lib_row = v <= 2;
    CK(cudaMemcpy(lse.data(), lib_row ? lib_lse : p.lse, size_t(p.M) * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(loss.data(), lib_row ? lib_loss : p.loss, size_t(p.M) * 4, cudaMemcpyDeviceToHost));
    double e_lse = 0, e_loss = 0;
    for (int r = 0; r < p.M; ++r) {
      e_lse = std::max(e_lse, std::fabs(lse[r] - rl[r]) / std::max(1.0, std::fabs(rl[r])));
      const double want = tg[r] < 0 ? 0.0 : rl[r] - rt[r];
      const double d = std::fabs(loss[r] - want);
      e_loss = std::max(e_loss, std::isnan(d) ? INFINITY : d);
    }
    std::printf("check %-40s max rel err lse %.3g, max abs err loss %.3g\n", variants[v].first.c_str(), e_lse, e_loss);
  }

  // Timing: rotating order, each call after an L2 flush, median over rounds.
  std::vector<std::vector<float>> t(variants.size());
  for (int r = 0; r < rounds + 1; ++r) {
    for (size_t k = 0; k < variants.size(); ++k) {
      const size_t v = (k + r) % variants.size();
      CK(cudaMemset(flush, r, flush_bytes));
      const float ms = once_ms(variants[v].second);
      if (r > 0) t[v].push_back(ms);
    }
  }
  const double gemm_flops = 2.0 * p.M * p.K * double(p.N);
  std::vector<float> med(variants.size());
  for (size_t v = 0; v < variants.size(); ++v) {
    std::sort(t[v].begin(), t[v].end());
    med[v] = t[v][t[v].size() / 2];
  }
  std::printf("\nN=%d H=%d V=%d, %d rounds, medians (%% = cuBLAS logits GEMM time / this)\n", p.M, p.K, p.N, rounds);
  for (size_t v = 0; v < variants.size(); ++v)
    std::printf("%-42s %8.3f ms %7.1f TFLOP/s %6.1f %%\n", variants[v].first.c_str(), med[v],
                gemm_flops / med[v] * 1e-9, 100.0 * med[0] / med[v]);
  return 0;
}
