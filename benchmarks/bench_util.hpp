// Benchmark support: device buffers, CUDA-event timing (median of repeats), the device's copy bandwidth
// measured in the same run, and a table printer.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "fusedce/fusedce.h"

namespace bench {

inline void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}
inline void ok(fce_status_t s, const char* what) {
  if (s != FCE_STATUS_SUCCESS) {
    std::fprintf(stderr, "%s: %s: %s\n", what, fce_status_string(s), fce_last_error_message());
    std::exit(1);
  }
}

// A device buffer with a DLTensor describing it.
struct Buf {
  void* p = nullptr;
  std::vector<int64_t> shape;
  DLTensor t{};
  Buf(std::vector<int64_t> shp, DLDataType dt) : shape(std::move(shp)) {
    size_t n = 1;
    for (int64_t s : shape) n *= size_t(s);
    ck(cudaMalloc(&p, n * (dt.bits / 8) + 256), "cudaMalloc");
    t.data = p;
    t.device = {kDLCUDA, 0};
    t.ndim = int(shape.size());
    t.dtype = dt;
    t.shape = shape.data();
  }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  DLTensor* dl() { return &t; }
  size_t bytes() const {
    size_t n = t.dtype.bits / 8;
    for (int64_t s : shape) n *= size_t(s);
    return n;
  }
};

inline DLDataType f32() { return {kDLFloat, 32, 1}; }
inline DLDataType bf16() { return {kDLBfloat, 16, 1}; }
inline DLDataType f16() { return {kDLFloat, 16, 1}; }
inline DLDataType i32() { return {kDLInt, 32, 1}; }

// Median time in ms of `fn` over `reps` runs (after warm-up), by CUDA events on `stream`, with `prep` enqueued
// before each run, outside the timing.
inline double time_ms_after(cudaStream_t stream, const std::function<void()>& prep, const std::function<void()>& fn,
                            int reps = 20) {
  for (int i = 0; i < 3; ++i) fn();
  std::vector<float> ms;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < reps; ++i) {
    prep();
    cudaEventRecord(a, stream);
    fn();
    cudaEventRecord(b, stream);
    ck(cudaEventSynchronize(b), "sync");
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

// The L2 flush before each timed run: a 256 MiB memset (as triton.testing.do_bench; it leaves L2 full of
// dirty lines).
inline void flush_l2(cudaStream_t stream) {
  static void* flush = nullptr;
  static int value = 0;
  const size_t flush_bytes = size_t(256) << 20;
  if (!flush) ck(cudaMalloc(&flush, flush_bytes), "flush buffer");
  ck(cudaMemsetAsync(flush, value++ & 0xff, flush_bytes, stream), "flush");
}

// Median time in ms of `fn` over `reps` runs (after warm-up), by CUDA events on `stream`; the L2 is
// flushed before each run so every op reads from DRAM.
inline double time_ms(cudaStream_t stream, const std::function<void()>& fn, int reps = 20) {
  return time_ms_after(stream, [&] { flush_l2(stream); }, fn, reps);
}

// As time_ms, with the op's input (`bytes` at `x`) rewritten by a copy from a saved duplicate after the flush:
// the input sits in L2 as the output of the kernel before would (decode: the LM head's few MB of logits).
// Not what the targets are measured by; shown beside them.
inline double time_ms_input_in_l2(cudaStream_t stream, void* x, size_t bytes, const std::function<void()>& fn,
                                  int reps = 20) {
  void* src = nullptr;
  ck(cudaMalloc(&src, bytes), "input duplicate");
  ck(cudaMemcpyAsync(src, x, bytes, cudaMemcpyDeviceToDevice, stream), "input duplicate");
  const double ms = time_ms_after(
      stream,
      [&] {
        flush_l2(stream);
        ck(cudaMemcpyAsync(x, src, bytes, cudaMemcpyDeviceToDevice, stream), "input copy");
      },
      fn, reps);
  cudaFree(src);
  return ms;
}

// Per-call time in us of calls captured into one CUDA graph and replayed, the way METHOD.md times many
// small launches: `ops[i]` enqueues one call on `stream` over input set i; the graph holds `calls` calls
// cycling through the sets, so that with enough sets (graph_sets) each call reads its inputs from DRAM, and
// the L2 holds what the calls before wrote, as in a decode loop. No flush and no event between calls, so
// the launch gap of one event-timed call (launch_floor_us) is not in it. Median of `reps` replays / calls.
// Not what the targets are measured by; shown beside them.
inline double time_us_graph(cudaStream_t stream, const std::vector<std::function<void()>>& ops, int calls = 256,
                            int reps = 10) {
  for (const auto& op : ops) op();  // first calls (plans, attributes) outside the capture
  cudaGraph_t g = nullptr;
  cudaGraphExec_t ge = nullptr;
  ck(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), "begin capture");
  for (int i = 0; i < calls; ++i) ops[size_t(i) % ops.size()]();
  ck(cudaStreamEndCapture(stream, &g), "end capture");
  ck(cudaGraphInstantiate(&ge, g, 0), "instantiate");
  const double ms = time_ms_after(stream, [] {}, [&] { ck(cudaGraphLaunch(ge, stream), "graph launch"); }, reps);
  cudaGraphExecDestroy(ge);
  cudaGraphDestroy(g);
  return 1e3 * ms / calls;
}

// Input sets for time_us_graph: enough sets of `bytes_per_set` to fill the L2 twice (at least 2).
inline int graph_sets(size_t bytes_per_set) {
  int dev = 0, l2 = 0;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev);
  const size_t want = 2 * size_t(l2);
  return int(std::max<size_t>(2, (want + bytes_per_set - 1) / bytes_per_set));
}

// Device-to-device copy bandwidth in GB/s (bytes read + written), 1 GiB copied.
inline double copy_bandwidth_gbs(cudaStream_t stream) {
  const size_t n = size_t(1) << 30;
  void *a, *b;
  ck(cudaMalloc(&a, n), "malloc");
  ck(cudaMalloc(&b, n), "malloc");
  cudaMemsetAsync(a, 1, n, stream);
  const double ms = time_ms(stream, [&] { cudaMemcpyAsync(b, a, n, cudaMemcpyDeviceToDevice, stream); }, 10);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * double(n) / (ms * 1e6);
}

inline std::string device_name() {
  cudaDeviceProp p{};
  cudaGetDeviceProperties(&p, 0);
  return p.name;
}

// Fills a bf16/fp16/fp32 buffer with pseudo-random normal-ish values * scale (device-side generator).
void fill_random(Buf& b, float scale, unsigned seed, cudaStream_t s);
void fill_targets(Buf& b, int64_t V, unsigned seed, cudaStream_t s);
// The timing floor of this harness: an empty kernel timed like an op (event, launch, event; L2 flushed).
double launch_floor_us(cudaStream_t s);
// The same kernel per call in a replayed graph (time_us_graph).
double graph_floor_us(cudaStream_t s);

}  // namespace bench
