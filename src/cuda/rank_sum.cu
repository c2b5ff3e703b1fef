// The ranks' fp32 parts summed in rank order (common/comm.hpp). NCCL's all-reduce adds in its ring's or
// tree's order: with two ranks that is a + b, the rank-order sum whatever the order, but beyond two it is
// neither the one-device sum in rank order nor the same from one NCCL algorithm to the next. So two ranks
// all-reduce; more all-gather every rank's part, a piece at a time into the scratch (the caller's pieces,
// the same on every rank: NCCL's all-gathers must match), and each rank adds the W parts of every element
// in rank order. That moves (W - 1) parts into each rank where an all-reduce
// moves 2 (W - 1) / W, but it uses the communicator's ring only: grouped ncclSend/ncclRecv, which would
// move an all-reduce's bytes, made NCCL allocate connections of its own on first use (446 MiB on 2 ranks,
// 1214 MiB on 4, docs/lab-notes.md).
#include <algorithm>

#include "common/comm.hpp"
#include "cuda/common.cuh"

namespace fce::cuda {
namespace {

// s = ((g_0 + g_1) + ...) + g_{W-1} with g_r = gathered[r * n + i]; out[i] = s rounded, or sum[i] = s.
template <class O>
__global__ void rank_sum_kernel(const float* gathered, size_t n, int W, float* sum, O* out) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    float acc = gathered[i];
    for (int r = 1; r < W; ++r) acc += gathered[size_t(r) * n + i];
    if (out)
      out[i] = from_float<O>(acc);
    else
      sum[i] = acc;
  }
}

// Over n elements: the rank-order sum of W parts laid out [W, n], rounded into out or written to sum.
void launch_sum(cudaStream_t s, const float* gathered, size_t n, int W, float* sum, void* out, DType out_dtype) {
  if (n == 0) return;
  const unsigned blocks = unsigned(std::min<size_t>((n + 255) / 256, 4096));
  if (out) {
    dispatch_float(out_dtype, [&](auto tag) {
      using O = decltype(tag);
      rank_sum_kernel<O><<<blocks, 256, 0, s>>>(gathered, n, W, nullptr, static_cast<O*>(out));
    });
  } else {
    rank_sum_kernel<float><<<blocks, 256, 0, s>>>(gathered, n, W, sum, nullptr);
  }
  check_launch("rank sum kernel");
}

}  // namespace

void rank_order_sum(const fce_comm* c, fce_stream_t stream, float* part, size_t count, void* out, DType out_dtype,
                    void* scratch, size_t scratch_bytes, size_t piece) {
  const int W = c->size;
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  if (W <= 2) {  // a + b: NCCL's order is the rank order
    if (W == 2) comm_all_reduce_sum(c, stream, part, count);
    if (out) launch_sum(s, part, count, 1, nullptr, out, out_dtype);
    return;
  }
  FCE_CHECK((piece > 0 || count == 0) && piece <= scratch_bytes / (4 * size_t(W)), FCE_STATUS_INTERNAL_ERROR,
            "rank_order_sum: pieces of %zu elements in %zu bytes of scratch", piece, scratch_bytes);
  float* gathered = static_cast<float*>(scratch);
  for (size_t off = 0; off < count; off += piece) {
    const size_t n = std::min(piece, count - off);
    comm_all_gather(c, stream, part + off, gathered, n);
    launch_sum(s, gathered, n, W, part + off,
               out ? static_cast<char*>(out) + off * dtype_size(out_dtype) : nullptr, out_dtype);
  }
}

}  // namespace fce::cuda
