// Linear cross-entropy's forward records from the logits GEMM (see lce_fused.hpp): a CUTLASS sm90 persistent
// cooperative GEMM (TMA loads, WGMMA, fp32 accumulation; 128 x 256 x 64 tiles, clusters of 2 along the tokens)
// with a collective epilogue of the library's own. Built only for sm_90a (-gencode in src/cuda/meson.build).
//
// The epilogue's two roles, once per output tile, hand one shared-memory buffer over by two named barriers
// (PTX's memory model: a bar.arrive synchronizes with the bar.sync that completes the barrier):
//   - the consumer warp groups (store): sync on kEmpty (the epilogue warp has read the previous tile), write
//     the tile's accumulators rounded to bf16 (as torch.nn.functional.linear returns them), arrive on kFull,
//     go on to the next tile's GEMM;
//   - the producer warp group's epilogue warp (load; the role reads no C operand here): load the rows'
//     targets, arrive on kEmpty for the previous tile, sync on kFull, then reduce each staged row to a record,
//     a lane per row, in column order.
// compute-sanitizer's racecheck does not follow an arrive and reports the reads as racing with the writes;
// syncing on both sides quiets it but fails synccheck ("divergent threads") and a launch under it.
// The reduction so overlaps the next tile's mainloop; the logits never reach global memory. Fixed orders
// throughout (no atomics): the records, and so the loss, are the same bits run to run.
#include <cuda_bf16.h>

#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "common/error.hpp"
#include "cuda/cutlass_epilogue.hpp"
#include "cuda/lce_fused.hpp"
#include "cuda/online_softmax.cuh"

namespace fce::cuda {
namespace {

struct RecordArgs {
  const void* targets = nullptr;
  bool t64 = false;
  float4* records = nullptr;
};

template <int kTileM, int kTileN>
class CeRecordEpilogue : public NoOperandEpilogue<RecordArgs> {
 public:
  using LoadPipeline = cutlass::PipelineTransactionAsync<0>;
  using LoadPipelineState = cutlass::PipelineState<0>;
  static constexpr bool RequiresTransactionBytes = false;
  using StorePipeline = cutlass::PipelineTmaStore<0>;
  using StorePipelineState = cutlass::PipelineState<0>;
  // 16 bytes of padding per staged row: the 8 rows of a quad's store fall in distinct banks, and 8 lanes'
  // 16-byte loads of 8 rows cover the 32 banks.
  static constexpr int kStride = kTileN + 8;
  struct TensorStorage {
    alignas(128) __nv_bfloat16 tile[kTileM * kStride];
  };
  using SharedStorage = TensorStorage;
  using TensorMapStorage = TensorStorage;
  using PipelineStorage = typename LoadPipeline::SharedStorage;
  static constexpr uint32_t kBarThreads = 256 + 32;  // the two consumer warp groups and the epilogue warp
  static constexpr uint32_t kFull = 0, kEmpty = 1;   // named barriers after CUTLASS's reserved ones
  static_assert(kTileM % 32 == 0 && kTileN % 8 == 0, "a lane per row, 16-byte loads");

  template <class T>
  CUTLASS_HOST_DEVICE static constexpr int get_load_pipe_increment(T) {
    return 1;
  }
  template <class T>
  CUTLASS_HOST_DEVICE static constexpr int get_store_pipe_increment(T) {
    return 1;
  }
  CUTLASS_DEVICE static void prefetch_tma_descriptors(Params const&) {}
  CUTLASS_HOST_DEVICE CeRecordEpilogue(Params const& p, TensorStorage&) : params(p) {}
  CUTLASS_DEVICE bool is_producer_load_needed() const { return true; }
  CUTLASS_DEVICE auto load_init(Params const&, TensorMapStorage&, int32_t, int32_t) { return cute::make_tuple(nullptr); }
  CUTLASS_DEVICE auto store_init(Params const&, TensorMapStorage&, int32_t, int32_t, int32_t) {
    return cute::make_tuple(nullptr);
  }

  // The epilogue warp: lane i reduces staged rows i, i + 32, ...: the max (then a second pass, the sum of
  // 2^((x - max) log2 e) and of x) in column order, with the target's logit where this tile holds it.
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class TiledMma>
  CUTLASS_DEVICE LoadPipelineState load(LoadPipeline, LoadPipelineState state, ProblemShapeMNKL problem_shape_mnkl,
                                        TileShapeMNK, TileCoordMNKL tile_coord_mnkl, TiledMma, int lane,
                                        TensorStorage& smem, int = -1) {
    using namespace cute;
    const int M = int(get<0>(problem_shape_mnkl));
    const int N = int(get<1>(problem_shape_mnkl));
    const int n_tile = int(get<1>(tile_coord_mnkl));
    const int m0 = int(get<0>(tile_coord_mnkl)) * kTileM, n0 = n_tile * kTileN;
    const int cols = min(kTileN, N - n0);
    int64_t tgt[kTileM / 32];  // the rows' targets, loaded while the consumers finish this tile
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kTileM / 32; ++k) {
      const int row = m0 + 32 * k + lane;
      tgt[k] = row >= M     ? -1
               : params.t64 ? static_cast<const int64_t*>(params.targets)[row]
                            : int64_t(static_cast<const int32_t*>(params.targets)[row]);
    }
    if (tiles_++ > 0) cutlass::arch::NamedBarrier::arrive(kBarThreads, kEmpty);  // the previous tile is read
    cutlass::arch::NamedBarrier::arrive_and_wait(kBarThreads, kFull);
    if (m0 >= M || n0 >= N) return state;  // a tile of a cluster's padding
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kTileM / 32; ++k) {
      const int row = m0 + 32 * k + lane;
      const __nv_bfloat16* x = &smem.tile[(32 * k + lane) * kStride];
      const int t = tgt[k] >= n0 && tgt[k] < int64_t(n0) + cols ? int(tgt[k] - n0) : -1;  // the target's column
      auto chunk = [&](int c, float(&v)[8]) {
        const uint4 raw = *reinterpret_cast<const uint4*>(x + c);
        const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) {
          v[2 * j] = __uint_as_float(w[j] << 16);
          v[2 * j + 1] = __uint_as_float(w[j] & 0xffff0000u);
        }
      };
      float m2[2] = {-INFINITY, -INFINITY}, z2[2] = {0.f, 0.f};
      if (cols == kTileN) {
#pragma unroll 4
        for (int c = 0; c < kTileN; c += 8) {
          float v[8];
          chunk(c, v);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < 8; ++j) {
            m2[j & 1] = fmaxf(m2[j & 1], v[j]);
            z2[j & 1] += v[j];
          }
        }
      } else {
        for (int c = 0; c < cols; c += 8) {
          float v[8];
          chunk(c, v);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < 8; ++j)
            if (c + j < cols) {
              m2[j & 1] = fmaxf(m2[j & 1], v[j]);
              z2[j & 1] += v[j];
            }
        }
      }
      const float m = fmaxf(m2[0], m2[1]), nm = -m * kLog2e;
      float s2[2] = {0.f, 0.f};
      if (cols == kTileN) {
#pragma unroll 4
        for (int c = 0; c < kTileN; c += 8) {
          float v[8];
          chunk(c, v);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < 8; ++j) s2[j & 1] += ex2(fmaf(v[j], kLog2e, nm));
        }
      } else {
        for (int c = 0; c < cols; c += 8) {
          float v[8];
          chunk(c, v);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < 8; ++j)
            if (c + j < cols) s2[j & 1] += ex2(fmaf(v[j], kLog2e, nm));
        }
      }
      const float s = s2[0] + s2[1];
      if (row < M) {
        // fmaxf skips a NaN, which the sum keeps (as it does an inf): the record's max marks the row NaN.
        params.records[int64_t(n_tile) * M + row] =
            make_float4(s != s ? NAN : m, s, t >= 0 ? __bfloat162float(x[t]) : 0.f, z2[0] + z2[1]);
      }
    }
    return state;
  }

  CUTLASS_DEVICE LoadPipelineState load_tail(LoadPipeline, LoadPipelineState state) { return state; }

  // The consumers: stage this tile's accumulators once the epilogue warp has read the previous tile.
  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma>
  CUTLASS_DEVICE auto store(LoadPipeline, LoadPipelineState load_state, StorePipeline, StorePipelineState store_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK tile_shape_mnk,
                            TileCoordMNKL tile_coord_mnkl, cute::Tensor<AccEngine, AccLayout> accumulators,
                            TiledMma tiled_mma, int thread_idx, TensorStorage& smem, int = -1) {
    using namespace cute;
    // WGMMA's accumulators: per thread ((2, 2, N/8), THR_M, THR_N) values; mode 0.0 steps a column, 0.1 eight
    // rows. A pair along mode 0.0 is one 4-byte store.
    static_assert(rank(AccLayout{}) == 3 && rank<0>(AccLayout{}) == 3, "WGMMA accumulator layout expected");
    static_assert(size<0, 0>(AccLayout{}) == 2 && size<0, 1>(AccLayout{}) == 2, "WGMMA accumulator layout expected");
    constexpr int V2 = size<0, 2>(AccLayout{});
    constexpr int TM = size<1>(AccLayout{});
    constexpr int TN = size<2>(AccLayout{});
    const int M = int(get<0>(problem_shape_mnkl));
    const int N = int(get<1>(problem_shape_mnkl));
    Tensor cD = local_tile(make_identity_tensor(make_shape(M, N)), take<0, 2>(tile_shape_mnk),
                           make_coord(get<0>(tile_coord_mnkl), get<1>(tile_coord_mnkl)));
    Tensor tCcD = tiled_mma.get_thread_slice(thread_idx).partition_C(cD);
    const int m0 = int(get<0>(cD(0))), n0 = int(get<1>(cD(0)));
    if (tiles_++ > 0) cutlass::arch::NamedBarrier::arrive_and_wait(kBarThreads, kEmpty);
    CUTLASS_PRAGMA_UNROLL
    for (int tm = 0; tm < TM; ++tm) {
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < 2; ++v1) {
        CUTLASS_PRAGMA_UNROLL
        for (int tn = 0; tn < TN; ++tn) {
          CUTLASS_PRAGMA_UNROLL
          for (int v2 = 0; v2 < V2; ++v2) {
            auto c = make_coord(make_coord(0, v1, v2), tm, tn);
            const int r = int(get<0>(tCcD(c))) - m0, col = int(get<1>(tCcD(c))) - n0;
            *reinterpret_cast<__nv_bfloat162*>(&smem.tile[r * kStride + col]) = __floats2bfloat162_rn(
                accumulators(c), accumulators(make_coord(make_coord(1, v1, v2), tm, tn)));
          }
        }
      }
    }
    cutlass::arch::NamedBarrier::arrive(kBarThreads, kFull);
    return cute::make_tuple(load_state, store_state);
  }

  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                                 StorePipelineState store_state) {
    return cute::make_tuple(load_state, store_state);
  }

 private:
  Params params;
  int tiles_ = 0;  // tiles this thread's role has seen: the first waits on nothing
};

using Tile = cute::Shape<cute::_128, cute::_256, cute::_64>;
using Cluster = cute::Shape<cute::_2, cute::_1, cute::_1>;
static_assert(cute::size<1>(Tile{}) == kLceFusedTileN, "lce_fused.hpp's tile width");
using Epilogue = CeRecordEpilogue<128, 256>;
using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, cutlass::bfloat16_t, cutlass::layout::RowMajor, 8,
    cutlass::bfloat16_t, cutlass::layout::ColumnMajor, 8, float, Tile, Cluster,
    cutlass::gemm::collective::StageCountAutoCarveout<int(sizeof(typename Epilogue::TensorStorage))>,
    cutlass::gemm::KernelTmaWarpSpecializedCooperative>::CollectiveOp;
using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue,
                                                    cutlass::gemm::PersistentScheduler>;
using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

typename Kernel::Arguments arguments(const LceFusedArgs& a) {
  using namespace cute;
  typename Kernel::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {int(a.rows), int(a.V), int(a.H), 1},
      {static_cast<const cutlass::bfloat16_t*>(a.hidden), make_stride(a.ldh, _1{}, a.ldh * a.rows),
       static_cast<const cutlass::bfloat16_t*>(a.weight), make_stride(a.ldw, _1{}, a.ldw * a.V)},
      {a.targets, a.t64, reinterpret_cast<float4*>(a.records)}};
  args.hw_info.device_id = a.device;
  args.hw_info.sm_count = a.sm_count;
  // Along the tokens first: the CTAs running together share the weight's tiles.
  args.scheduler.raster_order =
      cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Params::RasterOrderOptions::AlongM;
  args.scheduler.max_swizzle_size = 1;
  return args;
}

}  // namespace

bool lce_fused_can(const LceFusedArgs& a) {
  if (a.rows < 1 || a.rows > INT32_MAX || a.V > INT32_MAX || a.H > INT32_MAX) return false;
  if ((reinterpret_cast<uintptr_t>(a.hidden) | reinterpret_cast<uintptr_t>(a.weight)) % 16 != 0) return false;
  return Gemm::can_implement(arguments(a)) == cutlass::Status::kSuccess &&
         Gemm::get_workspace_size(arguments(a)) == 0;
}

void lce_fused_records(cudaStream_t s, const LceFusedArgs& a) {
  Gemm gemm;
  const auto args = arguments(a);
  FCE_CHECK(gemm.initialize(args, nullptr, s) == cutlass::Status::kSuccess, FCE_STATUS_CUDA_ERROR,
            "the fused linear cross-entropy GEMM could not be set up (%s)", cudaGetErrorString(cudaGetLastError()));
  FCE_CHECK(gemm.run(s) == cutlass::Status::kSuccess, FCE_STATUS_CUDA_ERROR,
            "the fused linear cross-entropy GEMM did not launch (%s)", cudaGetErrorString(cudaGetLastError()));
}

}  // namespace fce::cuda
