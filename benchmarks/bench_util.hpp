// Benchmark support: device buffers, CUDA-event timing (median of repeats), the device's copy bandwidth
// measured in the same run, a table printer, and the --json FILE output (cJSON; FCE_BENCH_JSON when found).
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#ifdef FCE_BENCH_JSON
#include <cJSON.h>
#endif

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

// --json FILE: the result rows as JSON. A field is a number, a string, null or an object of fields;
// a row is a list of fields, written in order.
struct Field {
  enum Kind { kNum, kStr, kNull, kObj } kind = kNull;
  std::string key;
  double num = 0;
  std::string str;
  std::vector<Field> sub;
};
inline Field jnum(std::string k, double v) {
  Field f;
  f.kind = std::isfinite(v) ? Field::kNum : Field::kNull;
  f.key = std::move(k);
  f.num = v;
  return f;
}
inline Field jstr(std::string k, std::string v) {
  Field f;
  f.kind = Field::kStr;
  f.key = std::move(k);
  f.str = std::move(v);
  return f;
}
inline Field jnull(std::string k) {
  Field f;
  f.key = std::move(k);
  return f;
}
inline Field jobj(std::string k, std::vector<Field> sub) {
  Field f;
  f.kind = Field::kObj;
  f.key = std::move(k);
  f.sub = std::move(sub);
  return f;
}
using JsonRow = std::vector<Field>;

// Takes `--json FILE` (or `--json=FILE`) out of argv, so the programs' own parsing sees the rest as before;
// returns FILE, or "" without the option. Exits 2 when FILE is missing or the build has no cJSON.
inline std::string take_json_arg(int& argc, char** argv) {
  std::string path;
  int out = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--json") == 0) {
      if (i + 1 >= argc || argv[i + 1][0] == '\0') {
        std::fprintf(stderr, "%s: --json needs a FILE\n", argv[0]);
        std::exit(2);
      }
      path = argv[++i];
    } else if (std::strncmp(argv[i], "--json=", 7) == 0 && argv[i][7] != '\0') {
      path = argv[i] + 7;
    } else {
      argv[out++] = argv[i];
    }
  }
  argc = out;
  argv[argc] = nullptr;
#ifndef FCE_BENCH_JSON
  if (!path.empty()) {
    std::fprintf(stderr,
                 "%s: --json is not available: this build found no cJSON (install libcjson-dev and reconfigure)\n",
                 argv[0]);
    std::exit(2);
  }
#endif
  return path;
}

#ifdef FCE_BENCH_JSON
inline void json_add(cJSON* obj, const Field& f) {
  switch (f.kind) {
    case Field::kNum: cJSON_AddItemToObject(obj, f.key.c_str(), cJSON_CreateNumber(f.num)); break;
    case Field::kStr: cJSON_AddItemToObject(obj, f.key.c_str(), cJSON_CreateString(f.str.c_str())); break;
    case Field::kNull: cJSON_AddItemToObject(obj, f.key.c_str(), cJSON_CreateNull()); break;
    case Field::kObj: {
      cJSON* o = cJSON_CreateObject();
      for (const Field& g : f.sub) json_add(o, g);
      cJSON_AddItemToObject(obj, f.key.c_str(), o);
      break;
    }
  }
}
#endif

// Writes {"program", "device", "driver", "runtime", "date", "library_version", <top>..., "rows": [...]} to
// `path`; false (with a message) when it cannot. `top` holds the in-run baseline (copy_gbps or cublas_tflops).
inline bool write_json(const std::string& path, const char* program, const std::vector<Field>& top,
                       const std::vector<JsonRow>& rows) {
#ifdef FCE_BENCH_JSON
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  int driver = 0, runtime = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  char date[32] = "";
  const std::time_t now = std::time(nullptr);
  std::tm utc{};
  gmtime_r(&now, &utc);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", &utc);
  cJSON* doc = cJSON_CreateObject();
  cJSON_AddStringToObject(doc, "program", program);
  cJSON_AddStringToObject(doc, "device", prop.name);
  cJSON_AddNumberToObject(doc, "driver", driver);
  cJSON_AddNumberToObject(doc, "runtime", runtime);
  cJSON_AddStringToObject(doc, "date", date);
  cJSON_AddStringToObject(doc, "library_version", fce_version_string());
  for (const Field& f : top) json_add(doc, f);
  cJSON* arr = cJSON_AddArrayToObject(doc, "rows");
  for (const JsonRow& r : rows) {
    cJSON* o = cJSON_CreateObject();
    for (const Field& f : r) json_add(o, f);
    cJSON_AddItemToArray(arr, o);
  }
  char* text = cJSON_Print(doc);
  cJSON_Delete(doc);
  bool ok = text != nullptr;
  std::FILE* fp = ok ? std::fopen(path.c_str(), "w") : nullptr;
  ok = fp != nullptr && std::fputs(text, fp) >= 0 && std::fputc('\n', fp) != EOF;
  if (fp && std::fclose(fp) != 0) ok = false;
  cJSON_free(text);
  if (!ok) std::fprintf(stderr, "%s: cannot write %s\n", program, path.c_str());
  return ok;
#else
  (void)path, (void)program, (void)top, (void)rows;
  return false;
#endif
}

// Fills a bf16/fp16/fp32 buffer with pseudo-random normal-ish values * scale (device-side generator).
void fill_random(Buf& b, float scale, unsigned seed, cudaStream_t s);
void fill_targets(Buf& b, int64_t V, unsigned seed, cudaStream_t s);
// The timing floor of this harness: an empty kernel timed like an op (event, launch, event; L2 flushed).
double launch_floor_us(cudaStream_t s);
// The same kernel per call in a replayed graph (time_us_graph).
double graph_floor_us(cudaStream_t s);

}  // namespace bench
