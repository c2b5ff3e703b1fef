// How fast one SM can store (a diagnostic, not part of the library; -Ddev=true builds it).
//
// B blocks of one row each write S KiB of fp32 to their own part of a buffer, after the benchmarks' L2 flush
// (256 MiB memset), by 16-byte stores (512 or 1024 threads, plain or evict-first) or by bulk copies from
// shared memory (cp.async.bulk, 16 or 4 KiB per copy, waited on to the reads or to completion). Prints
// the event time (median of 10) and, from %globaltimer in every block, the store phase (first thread's
// start to the last thread's end, median over runs of the slowest and of the median block) and the bytes
// per second per SM of the slowest block. Answers whether a few-row kernel's stores are bound by the SM
// (few blocks: the rate stays the same per block) or by L2/HBM (many blocks: it falls), and whether bulk
// copies beat plain stores (H100, 2026-11-22: 64 GB/s per SM with 16 blocks, 33-37 GB/s with 96-132, bulk
// copies slower; see docs/lab-notes.md, eighth session).
//
// Build: meson setup build -Ddev=true && ninja -C build dev/probe_store_rate; run on the GPU machine:
//   build/dev/probe_store_rate
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                                  \
  do {                                                                         \
    cudaError_t e_ = (x);                                                      \
    if (e_ != cudaSuccess) {                                                   \
      std::printf("%s: %s\n", #x, cudaGetErrorString(e_));                     \
      std::exit(1);                                                            \
    }                                                                          \
  } while (0)

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ float4 value(int i) { return make_float4(i * 1.f, i + 1.f, i + 2.f, blockIdx.x); }

extern __shared__ float4 g_stage[];

// 16-byte stores, coalesced (a warp writes 512 contiguous bytes per instruction); kStream: evict-first hint.
template <bool kStream>
__global__ void store_kernel(float4* out, int nvec, unsigned long long* phase) {
  float4* o = out + size_t(blockIdx.x) * nvec;
  __syncthreads();
  const unsigned long long t0 = now_ns();
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
    if (kStream) __stcs(o + i, value(i));
    else o[i] = value(i);
  }
  __syncthreads();
  if (threadIdx.x == 0) phase[blockIdx.x] = now_ns() - t0;
}

// The block's bytes staged in shared memory, then bulk copies of `chunk` bytes issued by the first warp.
template <bool kWaitReads>
__global__ void bulk_kernel(float4* out, int nvec, unsigned long long* phase, int chunk) {
  float4* o = out + size_t(blockIdx.x) * nvec;
  for (int i = threadIdx.x; i < nvec; i += blockDim.x) g_stage[i] = value(i);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // ordinary stores before the copy engine reads
  __syncthreads();
  const unsigned long long t0 = now_ns();
  const int bytes = nvec * 16;
  if (threadIdx.x < 32) {
    for (int off = int(threadIdx.x) * chunk; off < bytes; off += 32 * chunk) {
      const int n = min(chunk, bytes - off);
      const unsigned src = unsigned(__cvta_generic_to_shared(reinterpret_cast<char*>(g_stage) + off));
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(reinterpret_cast<char*>(o) + off),
                   "r"(src), "r"(n)
                   : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (kWaitReads) asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
    else asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  }
  __syncthreads();
  if (threadIdx.x == 0) phase[blockIdx.x] = now_ns() - t0;
}

int main() {
  void* flush;
  float4* out;
  unsigned long long* phase;
  CK(cudaMalloc(&flush, size_t(256) << 20));
  CK(cudaMalloc(&out, size_t(512) << 20));
  CK(cudaMalloc(&phase, 4096 * sizeof(unsigned long long)));
  constexpr int kMaxStage = 220 << 10;
  CK(cudaFuncSetAttribute(bulk_kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxStage));
  CK(cudaFuncSetAttribute(bulk_kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, kMaxStage));
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("%s, %d SMs; L2 flushed by a 256 MiB memset before each run\n", prop.name, prop.multiProcessorCount);
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  struct Case {
    int blocks, kib;
  } cases[] = {{16, 32}, {16, 64}, {96, 101}, {132, 74}, {132, 200}};
  const char* names[] = {"st 512 thr", "st 1024 thr", "st.cs 512 thr", "bulk, wait reads", "bulk, wait all",
                         "bulk 4 KiB, all"};
  std::printf("%-18s %6s %5s %9s %14s %14s %12s\n", "stores", "blocks", "KiB", "event us", "phase max ns",
              "phase med ns", "GB/s per SM");
  for (const Case& c : cases) {
    const int nvec = c.kib * 1024 / 16;
    for (int k = 0; k < 6; ++k) {
      std::vector<float> ev;
      std::vector<double> pmax, pmed;
      for (int rep = 0; rep < 13; ++rep) {
        CK(cudaMemsetAsync(flush, rep, size_t(256) << 20));
        CK(cudaEventRecord(a));
        switch (k) {
          case 0: store_kernel<false><<<c.blocks, 512>>>(out, nvec, phase); break;
          case 1: store_kernel<false><<<c.blocks, 1024>>>(out, nvec, phase); break;
          case 2: store_kernel<true><<<c.blocks, 512>>>(out, nvec, phase); break;
          case 3: bulk_kernel<true><<<c.blocks, 512, nvec * 16>>>(out, nvec, phase, 16384); break;
          case 4: bulk_kernel<false><<<c.blocks, 512, nvec * 16>>>(out, nvec, phase, 16384); break;
          default: bulk_kernel<false><<<c.blocks, 512, nvec * 16>>>(out, nvec, phase, 4096); break;
        }
        CK(cudaGetLastError());
        CK(cudaEventRecord(b));
        CK(cudaEventSynchronize(b));
        float ms = 0;
        CK(cudaEventElapsedTime(&ms, a, b));
        std::vector<unsigned long long> h(size_t(c.blocks));
        CK(cudaMemcpy(h.data(), phase, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
        std::sort(h.begin(), h.end());
        if (rep >= 3) {  // warm-up
          ev.push_back(ms * 1e3f);
          pmax.push_back(double(h.back()));
          pmed.push_back(double(h[h.size() / 2]));
        }
      }
      std::sort(ev.begin(), ev.end());
      std::sort(pmax.begin(), pmax.end());
      std::sort(pmed.begin(), pmed.end());
      const double worst = pmax[pmax.size() / 2];
      std::printf("%-18s %6d %5d %9.2f %14.0f %14.0f %12.1f\n", names[k], c.blocks, c.kib, ev[ev.size() / 2], worst,
                  pmed[pmed.size() / 2], c.kib * 1024.0 / worst);
    }
  }
  return 0;
}
