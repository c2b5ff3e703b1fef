// fce_scale_rows on the GPU: blocks stride over rows; a row whose factor is 1 is skipped before any load,
// so a scalar factor of 1 costs one launch and one 4-byte read per block.
#include "cuda/common.cuh"

namespace fce::cuda {
namespace {

template <class T>
__global__ void __launch_bounds__(kRowThreads) scale_rows_kernel(T* x, int64_t ld, int64_t N, int64_t V,
                                                                 const float* factor, bool scalar) {
  for (int64_t row = blockIdx.x; row < N; row += gridDim.x) {
    const float g = factor[scalar ? 0 : row];
    if (g == 1.f) {
      if (scalar) return;
      continue;
    }
    T* r = x + row * ld;
    row_map<T, T>(r, r, 0, V, [&](float (&v)[kVec<T>], int64_t, int n) {
#pragma unroll
      for (int k = 0; k < kVec<T>; ++k)
        if (k < n) v[k] *= g;
    });
  }
}

}  // namespace

void scale_rows(fce_handle* h, fce_stream_t stream, const ScaleProblem& p) {
  DeviceGuard guard(h->device_id);
  const int64_t blocks = std::min<int64_t>(p.x.rows, int64_t(h->caps.sm_count > 0 ? h->caps.sm_count : 1) * 4);
  dispatch_float(p.x.dtype, [&](auto tag) {
    using T = decltype(tag);
    scale_rows_kernel<T><<<unsigned(blocks), kRowThreads, 0, stream_of(stream)>>>(
        reinterpret_cast<T*>(p.x.data), p.x.ld, p.x.rows, p.x.cols, reinterpret_cast<const float*>(p.factor.data),
        p.factor.scalar);
  });
  check_launch("scale kernel");
}

}  // namespace fce::cuda
