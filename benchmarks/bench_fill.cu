// Device-side fills for the benchmarks (hash-based, so no host transfer of large inputs).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "bench_util.hpp"

namespace {
__device__ unsigned hash(unsigned x) {
  x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
  return x;
}
__device__ float normalish(size_t i, unsigned seed) {  // sum of 4 uniforms, centred: ~N(0, 1/3)*...
  float s = 0;
  for (unsigned k = 0; k < 4; ++k) s += float(hash(unsigned(i * 4 + k) ^ (seed * 0x9e3779b9u)) & 0xffffff) / 16777216.f;
  return (s - 2.f) * 1.7320508f;
}
template <class T>
__global__ void fill_kernel(T* p, size_t n, float scale, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = T(normalish(i, seed) * scale);
}
__global__ void empty_kernel() {}
__global__ void targets_kernel(int32_t* p, size_t n, int64_t V, unsigned seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = int32_t(hash(unsigned(i) ^ seed) % unsigned(V));
}
}  // namespace

namespace bench {
void fill_random(Buf& b, float scale, unsigned seed, cudaStream_t s) {
  size_t n = 1;
  for (int64_t x : b.shape) n *= size_t(x);
  if (b.t.dtype.bits == 32) fill_kernel<float><<<1024, 256, 0, s>>>(static_cast<float*>(b.p), n, scale, seed);
  else if (b.t.dtype.code == kDLBfloat) fill_kernel<__nv_bfloat16><<<1024, 256, 0, s>>>(static_cast<__nv_bfloat16*>(b.p), n, scale, seed);
  else fill_kernel<__half><<<1024, 256, 0, s>>>(static_cast<__half*>(b.p), n, scale, seed);
  ck(cudaGetLastError(), "fill");
}
double launch_floor_us(cudaStream_t s) {
  return 1e3 * time_ms(s, [&] { empty_kernel<<<1, 32, 0, s>>>(); });
}
double graph_floor_us(cudaStream_t s) {
  return time_us_graph(s, {[&] { empty_kernel<<<1, 32, 0, s>>>(); }});
}
void fill_targets(Buf& b, int64_t V, unsigned seed, cudaStream_t s) {
  targets_kernel<<<256, 256, 0, s>>>(static_cast<int32_t*>(b.p), size_t(b.shape[0]), V, seed);
  ck(cudaGetLastError(), "targets");
}
}  // namespace bench
