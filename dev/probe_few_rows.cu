// Where the few-row register kernels' time goes (a diagnostic, not part of the library; -Ddev=true builds it).
//
// A copy of the logsumexp / softmax few-row kernel structure built from the library's own device code
// (src/cuda/row_plan.cuh), with probes: every block records %globaltimer at entry and exit, and the block
// maximum over its threads of clock64 when the thread's data have landed (all its slots), when its
// exponentials are done, after the block merge, after the cluster exchange (row statistics) and after its
// stores were issued. Prints, per plan, the event time without and with the probes, the spread of the
// blocks' start times (a second wave of clusters shows here), the span from the first start to the last
// exit, and the phases (mean / max over blocks, ns at the nominal clock). The benchmarks' harness
// (bench::time_ms: 256 MiB memset before each run, events, median of 20); with --l2, the logits are also
// written by a copy after the flush, so that they sit in L2 (bench::time_ms_input_in_l2).
//
// Build: meson setup build -Ddev=true && ninja -C build dev/probe_few_rows; run on the GPU machine:
//   build/dev/probe_few_rows [--l2] [--ladder]
// --ladder: instead of the phases, the softmax plans' floor ladder (event time, same harness): a kernel with
// the same loads and stores and no dependency between its threads, then a block barrier after the data,
// then the row's dependency alone (that and one cluster exchange of a dummy value), then the real
// statistics (stores without exponentials), then the kernel itself. Each step's increase is its cost. The
// plan marked * is clusters of 8 with the registers capped for two blocks per SM (so that 16 clusters fit).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <vector>

#include "bench_util.hpp"
#include "cuda/row_plan.cuh"

using namespace fce::cuda;
using T = __nv_bfloat16;

namespace probe {

constexpr int kPhases = 5;  // data, exps, block, stats, stores
__device__ long long g_phase[4096][kPhases];
__device__ unsigned long long g_span[4096][2];

__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

// The softmax's floor ladder (--ladder): the same loads and stores, with less of the work between them.
enum Stage {
  kConvert = 0,  // each thread stores its values as fp32 once they land: no dependency, no arithmetic
  kBlock = 1,    // the block waits for all its data (__syncthreads), then the stores
  kDepend = 2,   // the same, then the cluster exchange (a dummy partial), then the stores
  kStats = 3,    // the kernel's statistics and exchange; the stores without exponentials (x * 1/d)
  kFull = 4      // the kernel
};

// kSoft: softmax (every block receives the statistics, fp32 probabilities) or logsumexp (rank 0 receives).
// kTwo: registers capped so that two blocks of up to 640 threads fit on an SM (--ladder's last plan).
template <int R, bool kSoft, bool kProbe, int kStage = kFull, bool kTwo = false>
__global__ void __launch_bounds__(kTwo ? 640 : 1024, kTwo ? 2 : 1)
    few_rows(const T* x, float* out, float* lse, int V, int C, int chunk, float c) {
  static_assert(kStage == kFull || (kSoft && !kProbe), "the ladder is the softmax's, unprobed");
  __shared__ unsigned long long ph[kPhases];
  const unsigned long long g0 = kProbe ? gtime() : 0;
  const long long c0 = clock64();
  if (kProbe && threadIdx.x < kPhases) ph[threadIdx.x] = 0;
  auto mark = [&](int i, float dep) {  // dep: a value the phase produced, so the clock reads after it
    if (kProbe) {
      asm volatile("" ::"f"(dep));
      atomicMax(&ph[i], static_cast<unsigned long long>(clock64() - c0));
    }
  };
  const FewCtx f = few_ctx(V, C, chunk);
  uint4 raw[R];
  reg_load_lean<T, R, kSoft>(x + f.row * V + f.begin, f.n, raw);
  auto store_row = [&](auto value) {  // the softmax's stores: value(x) for each of the slice's values
    float* o = out + f.row * V + f.begin;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v[8];
      unpack_words<T>(raw[r], v);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int e0 = slot_col<T, true>(r, h);
        if (e0 < f.n) {
          float w[4];
#pragma unroll
          for (int k = 0; k < 4; ++k) w[k] = value(v[h * 4 + k]);
          store_vals<float, 4>(o + e0, w, min(4, f.n - e0));
        }
      }
    }
  };
  if constexpr (kStage == kConvert) {
    store_row([](float v) { return v; });
    return;
  }
  if constexpr (kStage != kBlock) few_arrive<kSoft>(C);
  if constexpr (kStage == kBlock || kStage == kDepend) {
    unsigned any = 0;  // uses every loaded word, so the barrier comes after the thread's data landed
#pragma unroll
    for (int r = 0; r < R; ++r) any |= raw[r].x ^ raw[r].y ^ raw[r].z ^ raw[r].w;
    __syncthreads();
    const float d = any == 0x7f7f7f7fu ? 2.f : 1.f;
    const float s = kStage == kBlock ? d : few_merge<true>({0.f, d}, 1.f, C, f.rank).d;
    store_row([s](float v) { return v * s; });
    return;
  }
  float mx = -INFINITY;
#pragma unroll
  for (int r = 0; r < R; ++r) mx = fmaxf(mx, vec_max<T>(raw[r]));
  mark(0, mx);
  float d = 0.f;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    float v[8];
    unpack_words<T>(raw[r], v);
#pragma unroll
    for (int k = 0; k < 8; ++k) d += ex2((v[k] - mx) * c);
  }
  mark(1, d);
  const OnlineSoftmax part = block_merge_all({mx, d}, c);
  mark(2, part.d);
  const FewStats t = few_merge<kSoft>(part, c, C, f.rank);
  if (kSoft || f.rank == 0) mark(3, t.d);
  if (!kSoft) {
    if (f.rank == 0 && threadIdx.x == 0) lse[f.row] = (t.m * c + log2f(t.d)) * kLn2;
  } else {
    const float inv_d = 1.f / t.d, m = t.m;
    if constexpr (kStage == kStats) store_row([inv_d](float v) { return v * inv_d; });
    else store_row([inv_d, m, c](float v) { return ex2((v - m) * c) * inv_d; });
    mark(4, inv_d);
  }
  if (kProbe) {
    __syncthreads();
    if (threadIdx.x == 0) {
      for (int i = 0; i < kPhases; ++i) g_phase[blockIdx.x][i] = static_cast<long long>(ph[i]);
      g_span[blockIdx.x][0] = g0;
      g_span[blockIdx.x][1] = gtime();
    }
  }
}

__global__ void empty_kernel(int) {}

template <class K, class... A>
void launch_clusters(K kernel, int grid, int C, int threads, A... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(threads);
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeClusterDimension;
  at[0].val.clusterDim.x = C;
  at[0].val.clusterDim.y = 1;
  at[0].val.clusterDim.z = 1;
  cfg.attrs = at;
  cfg.numAttrs = C > 1;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  bench::ck(cudaLaunchKernelEx(&cfg, kernel, args...), "launch");
}

struct Plan {
  const char* name;
  int N, V, C, R, threads;
  bool soft;
};

size_t g_l2_bytes = 0;  // --l2: the logits' bytes, rewritten before each timed run (0: flushed only)

double time_us(const T* x, const std::function<void()>& f) {
  return 1e3 * (g_l2_bytes ? bench::time_ms_input_in_l2(nullptr, const_cast<T*>(x), g_l2_bytes, f)
                           : bench::time_ms(nullptr, f));
}

template <int R, bool kSoft>
void run_plan(const Plan& q, const T* x, float* out, float* lse, double ghz) {
  const int grid = q.N * q.C;
  const float c = kLog2e;
  const int chunk = int(slice_cols(q.V, q.C));
  auto run = [&](auto kernel) { launch_clusters(kernel, grid, q.C, q.threads, x, out, lse, q.V, q.C, chunk, c); };
  auto us = [&](const std::function<void()>& f) { return time_us(x, f); };
  const double plain = us([&] { run(few_rows<R, kSoft, false>); });
  const double probed = us([&] { run(few_rows<R, kSoft, true>); });
  const double empty = us([&] { launch_clusters(empty_kernel, grid, q.C, q.threads, 0); });
  std::vector<long long> ph(size_t(grid) * kPhases);
  std::vector<unsigned long long> sp(size_t(grid) * 2);
  cudaMemcpyFromSymbol(ph.data(), g_phase, ph.size() * sizeof(long long));
  cudaMemcpyFromSymbol(sp.data(), g_span, sp.size() * sizeof(unsigned long long));
  unsigned long long s0 = ~0ull, s1 = 0, e1 = 0;
  double mean[kPhases] = {}, mx[kPhases] = {};
  for (int b = 0; b < grid; ++b) {
    s0 = std::min(s0, sp[b * 2]);
    s1 = std::max(s1, sp[b * 2]);
    e1 = std::max(e1, sp[b * 2 + 1]);
    for (int i = 0; i < kPhases; ++i) {
      mean[i] += double(ph[b * kPhases + i]) / grid;
      mx[i] = std::max(mx[i], double(ph[b * kPhases + i]));
    }
  }
  int fit = 0;  // clusters of this plan the device reports room for at once
  {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(q.C);
    cfg.blockDim = dim3(q.threads);
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = q.C;
    at[0].val.clusterDim.y = 1;
    at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    if (cudaOccupancyMaxActiveClusters(&fit, few_rows<R, kSoft, false>, &cfg) != cudaSuccess) fit = -1;
    cudaGetLastError();
  }
  std::printf("%-24s %6.2f us (probed %6.2f, empty clusters %5.2f) | fit %3d | start skew %5.0f ns, span %5.0f ns |",
              q.name, plain, probed, empty, fit, double(s1 - s0), double(e1 - s0));
  const char* names[kPhases] = {"data", "exps", "block", "stats", "stores"};
  for (int i = 0; i < kPhases; ++i)
    if (mx[i] > 0) std::printf(" %s %.0f/%.0f", names[i], mean[i] / ghz, mx[i] / ghz);
  std::printf("\n");
}

// One line of the floor ladder: event time of each stage (softmax plans only).
template <int R, bool kTwo = false>
void run_ladder(const Plan& q, const T* x, float* out, float* lse) {
  const int grid = q.N * q.C, chunk = int(slice_cols(q.V, q.C));
  auto stage = [&](auto kernel) {
    return time_us(x, [&] { launch_clusters(kernel, grid, q.C, q.threads, x, out, lse, q.V, q.C, chunk, kLog2e); });
  };
  const double t0 = stage(few_rows<R, true, false, kConvert, kTwo>);
  const double t1 = stage(few_rows<R, true, false, kBlock, kTwo>);
  const double t2 = stage(few_rows<R, true, false, kDepend, kTwo>);
  const double t3 = stage(few_rows<R, true, false, kStats, kTwo>);
  const double t4 = stage(few_rows<R, true, false, kFull, kTwo>);
  std::printf("%-24s conversion %6.2f | + block wait %6.2f | + cluster exchange %6.2f | + statistics %6.2f | "
              "+ stores' exponentials %6.2f us\n", q.name, t0, t1, t2, t3, t4);
}

}  // namespace probe

using namespace probe;

int main(int argc, char** argv) {
  bool in_l2 = false, ladder = false;
  for (int i = 1; i < argc; ++i) {
    in_l2 |= std::strcmp(argv[i], "--l2") == 0;
    ladder |= std::strcmp(argv[i], "--ladder") == 0;
  }
  int khz = 0;
  cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0);
  const double ghz = khz / 1e6;
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s, nominal clock %.3f GHz; phases: mean/max over blocks of the block's last thread, ns since the "
              "block started\n", prop.name, ghz);
  const size_t n = size_t(16) * 151936;
  T* x;
  float *out, *lse;
  cudaMalloc(&x, n * sizeof(T));
  cudaMalloc(&out, n * sizeof(float));
  cudaMalloc(&lse, 64 * sizeof(float));
  std::vector<unsigned short> h(n);
  unsigned s = 1;
  for (auto& v : h) {  // uniform in [-3, 3), as bf16 bits
    s = s * 1664525u + 1013904223u;
    const float f = ((s >> 8) / 16777216.f - 0.5f) * 6;
    unsigned u;
    std::memcpy(&u, &f, 4);
    v = static_cast<unsigned short>(u >> 16);
  }
  cudaMemcpy(x, h.data(), n * sizeof(T), cudaMemcpyHostToDevice);
  if (in_l2) {
    g_l2_bytes = n * sizeof(T);
    std::printf("logits written by a copy before each run (in L2)\n");
  }
  const Plan plans[] = {
      {"softmax 1x128256 C=16", 1, 128256, 16, 2, 512, true},  {"lse 1x128256 C=16", 1, 128256, 16, 2, 512, false},
      {"softmax 16x151936 C=6", 16, 151936, 6, 4, 800, true},  {"lse 16x151936 C=6", 16, 151936, 6, 4, 800, false},
      {"softmax 16x151936 C=7", 16, 151936, 7, 4, 704, true},  {"lse 16x151936 C=7", 16, 151936, 7, 4, 704, false},
      {"softmax 16x151936 C=8", 16, 151936, 8, 4, 608, true},  {"lse 16x151936 C=8", 16, 151936, 8, 4, 608, false},
      {"lse 16x151936 C=9", 16, 151936, 9, 4, 640, false},     {"lse 16x151936 C=12", 16, 151936, 12, 2, 896, false},
      {"lse 16x151936 C=16", 16, 151936, 16, 2, 640, false},   {"lse 16x128256 C=16", 16, 128256, 16, 2, 512, false},
  };
  for (int rep = 0; rep < 2; ++rep)
    for (const Plan& q : plans) {
      if (ladder) {
        if (q.soft) q.R == 2 ? run_ladder<2>(q, x, out, lse) : run_ladder<4>(q, x, out, lse);
        if (&q == plans + sizeof(plans) / sizeof(plans[0]) - 1)
          run_ladder<4, true>({"softmax 16x151936 C=8 *", 16, 151936, 8, 4, 608, true}, x, out, lse);
        continue;
      }
      if (q.R == 2) q.soft ? run_plan<2, true>(q, x, out, lse, ghz) : run_plan<2, false>(q, x, out, lse, ghz);
      else q.soft ? run_plan<4, true>(q, x, out, lse, ghz) : run_plan<4, false>(q, x, out, lse, ghz);
    }
  const cudaError_t e = cudaDeviceSynchronize();
  std::printf("%s\n", cudaGetErrorString(e));
  return e == cudaSuccess ? 0 : 1;
}
