// Temperature softmax and knowledge-distillation benchmarks (issue 5 targets), on device 0.
//
// Measures the device-to-device copy bandwidth first, then each shape with CUDA events (median of 20 runs,
// L2 flushed before each run, caller workspace allocated outside the timing) and prints, per shape, the time,
// the effective bandwidth (bytes that must move at least once, divided by the time), its fraction of the copy
// bandwidth, and the target; a compact table with PASS/MISS closes the run. A light sanity check of each
// result (probabilities summing to 1, a finite loss) is printed too. The decode shapes run a second time with the
// logits written just before each run (in L2, as at decode), without a target. Runs in a few seconds.
// usage: bench_softmax_kd [--json FILE]
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_util.hpp"

using namespace bench;

namespace {

struct Result {
  std::string name, op, shape, dtype;  // name: the table's first column, op + shape + dtype
  double us, gbs, frac;
  std::string target;
  bool pass, has_target;
};

std::vector<Result> g_results;
double g_copy = 0;

fce_stream_t fs(cudaStream_t s) { return reinterpret_cast<fce_stream_t>(s); }

struct DevMem {  // a caller workspace
  void* p = nullptr;
  size_t bytes = 0;
  explicit DevMem(size_t n) : bytes(n) {
    if (n) ck(cudaMalloc(&p, n), "cudaMalloc (workspace)");
  }
  ~DevMem() { cudaFree(p); }
  DevMem(const DevMem&) = delete;
  DevMem& operator=(const DevMem&) = delete;
};

void upload(Buf& b, const void* host, size_t bytes, cudaStream_t s) {
  ck(cudaMemcpyAsync(b.p, host, bytes, cudaMemcpyHostToDevice, s), "upload");
  ck(cudaStreamSynchronize(s), "upload sync");
}

std::string nxv(int64_t N, int64_t V) { return std::to_string(N) + "x" + std::to_string(V); }

// Records one shape: `bytes` moved at least once, and either a time limit (us) or a bandwidth fraction.
void record(const std::string& name, const std::string& op, const std::string& shape, const std::string& dtype,
            double ms, double bytes, double max_us, double min_frac) {
  Result r;
  r.name = name;
  r.op = op;
  r.shape = shape;
  r.dtype = dtype;
  r.us = ms * 1e3;
  r.gbs = bytes / (ms * 1e6);
  r.frac = r.gbs / g_copy;
  char t[64];
  r.has_target = max_us > 0 || min_frac > 0;
  if (!r.has_target) {
    std::snprintf(t, sizeof t, "(none)");
    r.pass = true;
  } else if (max_us > 0) {
    std::snprintf(t, sizeof t, "<= %.0f us", max_us);
    r.pass = r.us <= max_us;
  } else {
    std::snprintf(t, sizeof t, ">= %.0f%% of copy", min_frac * 100);
    r.pass = r.frac >= min_frac;
  }
  r.target = t;
  std::printf("  %-44s %9.1f us  %7.0f GB/s  %5.1f%% of copy   target %-16s %s\n", name.c_str(), r.us, r.gbs,
              100 * r.frac, t, !r.has_target ? "" : r.pass ? "PASS" : "MISS");
  g_results.push_back(r);
}

// softmax(x / T) with a temperature per row, bf16 logits -> fp32 probabilities. in_l2: the logits written by a
// copy just before each run (in L2, as the LM head's output is at decode) instead of read from DRAM after the
// flush; shown beside the targets, not measured against them.
void bench_softmax(fce_handle_t h, cudaStream_t s, int64_t N, int64_t V, double max_us, double min_frac,
                   bool in_l2 = false) {
  Buf x({N, V}, bf16());
  Buf p({N, V}, f32());
  Buf temps({N}, f32());
  fill_random(x, 3.f, 11, s);
  std::vector<float> t(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) t[size_t(i)] = 0.6f + 0.8f * float(i % 7) / 6.f;
  upload(temps, t.data(), t.size() * 4, s);
  fce_softmax_options_t o = FCE_SOFTMAX_OPTIONS_INIT;
  o.temperatures = temps.dl();
  size_t wsb = 0;
  ok(fce_temp_softmax_workspace_size(h, x.dl(), &o, p.dl(), nullptr, &wsb), "softmax workspace size");
  DevMem ws(wsb);
  auto op = [&] { ok(fce_temp_softmax(h, fs(s), x.dl(), &o, p.dl(), nullptr, ws.p, ws.bytes), "fce_temp_softmax"); };
  const double ms = in_l2 ? time_ms_input_in_l2(s, x.p, x.bytes(), op) : time_ms(s, op);
  // Sanity: the last row sums to 1.
  std::vector<float> row(static_cast<size_t>(V));
  ck(cudaMemcpy(row.data(), static_cast<float*>(p.p) + (N - 1) * V, size_t(V) * 4, cudaMemcpyDeviceToHost), "dl");
  double sum = 0;
  for (float v : row) sum += v;
  char name[96];
  std::snprintf(name, sizeof name, "softmax %lldx%lld bf16->f32, T per row%s", (long long)N, (long long)V,
                in_l2 ? ", in L2" : "");
  std::printf("%s: workspace %zu B, last row sums to %.6f\n", name, wsb, sum);
  record(name, in_l2 ? "softmax, T per row, in L2" : "softmax, T per row", nxv(N, V), "bf16->f32", ms,
         double(x.bytes() + p.bytes()), max_us, min_frac);
}

// The same with log-probabilities too (the general kernel): two fp32 outputs, no target.
void bench_softmax_logp(fce_handle_t h, cudaStream_t s, int64_t N, int64_t V) {
  Buf x({N, V}, bf16());
  Buf p({N, V}, f32()), lp({N, V}, f32());
  fill_random(x, 3.f, 12, s);
  fce_softmax_options_t o = FCE_SOFTMAX_OPTIONS_INIT;
  o.temperature = 0.8f;
  size_t wsb = 0;
  ok(fce_temp_softmax_workspace_size(h, x.dl(), &o, p.dl(), lp.dl(), &wsb), "softmax workspace size");
  DevMem ws(wsb);
  const double ms = time_ms(s, [&] {
    ok(fce_temp_softmax(h, fs(s), x.dl(), &o, p.dl(), lp.dl(), ws.p, ws.bytes), "fce_temp_softmax");
  });
  float p0 = NAN, l0 = NAN;
  ck(cudaMemcpy(&p0, p.p, 4, cudaMemcpyDeviceToHost), "dl");
  ck(cudaMemcpy(&l0, lp.p, 4, cudaMemcpyDeviceToHost), "dl");
  char name[96];
  std::snprintf(name, sizeof name, "softmax + logprobs %lldx%lld bf16->2xf32", (long long)N, (long long)V);
  std::printf("%s: workspace %zu B, exp(logp[0]) - p[0] = %.3g\n", name, wsb, std::exp(double(l0)) - double(p0));
  record(name, "softmax + logprobs", nxv(N, V), "bf16->2xf32", ms, double(x.bytes() + p.bytes() + lp.bytes()), 0, 0);
}

// A divergence (forward KL unless said) between two bf16 [N,V] logit matrices, batchmean; with or without
// dstudent.
void bench_kd_full(fce_handle_t h, cudaStream_t s, int64_t N, int64_t V, bool grad, double min_frac,
                   int div = FCE_KD_FORWARD_KL) {
  Buf st({N, V}, bf16()), te({N, V}, bf16());
  Buf loss({}, f32());
  fill_random(st, 2.f, 21, s);
  fill_random(te, 2.f, 22, s);
  fce_kd_teacher_t teacher = FCE_KD_TEACHER_INIT;
  teacher.logits = te.dl();
  fce_kd_options_t o = FCE_KD_OPTIONS_INIT;
  o.divergence = div;
  fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
  out.loss = loss.dl();
  std::vector<int64_t> dshape = grad ? std::vector<int64_t>{N, V} : std::vector<int64_t>{1, 1};
  Buf ds(dshape, bf16());
  if (grad) out.dstudent = ds.dl();
  size_t wsb = 0;
  ok(fce_kd_loss_workspace_size(h, st.dl(), &teacher, nullptr, &o, &out, &wsb), "KD workspace size");
  DevMem ws(wsb);
  const double ms = time_ms(s, [&] {
    ok(fce_kd_loss(h, fs(s), st.dl(), &teacher, nullptr, &o, &out, ws.p, ws.bytes), "fce_kd_loss");
  });
  float l = NAN;
  ck(cudaMemcpy(&l, loss.p, 4, cudaMemcpyDeviceToHost), "dl");
  char name[96];
  const char* dn = div == FCE_KD_FORWARD_KL ? "fwd KL" : div == FCE_KD_REVERSE_KL ? "rev KL" : "JSD";
  std::snprintf(name, sizeof name, "KD %s %lldx%lld bf16%s", dn, (long long)N, (long long)V, grad ? " + dstudent" : "");
  std::printf("%s: workspace %zu B, loss %.6f\n", name, wsb, double(l));
  record(name, std::string("KD ") + dn + (grad ? " + dstudent" : ""), nxv(N, V), "bf16", ms,
         double(st.bytes()) * (grad ? 3 : 2), 0, min_frac);
}

// Top-K teacher (int32 ids, fp32 log-probs), student normalized over the full vocabulary, forward only.
void bench_kd_topk(fce_handle_t h, cudaStream_t s, int64_t N, int64_t V, int64_t K, double min_frac) {
  Buf st({N, V}, bf16());
  Buf ids({N, K}, i32()), lp({N, K}, f32());
  Buf loss({}, f32());
  fill_random(st, 2.f, 31, s);
  std::vector<int32_t> hid(static_cast<size_t>(N * K));
  std::vector<float> hlp(static_cast<size_t>(N * K));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t k = 0; k < K; ++k) {  // distinct per row: 2003 is coprime with V
      hid[size_t(i * K + k)] = int32_t((i * 7919 + k * 2003) % V);
      hlp[size_t(i * K + k)] = -0.5f - 0.15f * float(k);
    }
  upload(ids, hid.data(), hid.size() * 4, s);
  upload(lp, hlp.data(), hlp.size() * 4, s);
  fce_kd_teacher_t teacher = FCE_KD_TEACHER_INIT;
  teacher.topk_ids = ids.dl();
  teacher.topk_logprobs = lp.dl();
  fce_kd_options_t o = FCE_KD_OPTIONS_INIT;
  fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
  out.loss = loss.dl();
  size_t wsb = 0;
  ok(fce_kd_loss_workspace_size(h, st.dl(), &teacher, nullptr, &o, &out, &wsb), "KD top-K workspace size");
  DevMem ws(wsb);
  const double ms = time_ms(s, [&] {
    ok(fce_kd_loss(h, fs(s), st.dl(), &teacher, nullptr, &o, &out, ws.p, ws.bytes), "fce_kd_loss (top-K)");
  });
  float l = NAN;
  ck(cudaMemcpy(&l, loss.p, 4, cudaMemcpyDeviceToHost), "dl");
  char name[96];
  std::snprintf(name, sizeof name, "KD top-%lld %lldx%lld bf16, full-vocab lse", (long long)K, (long long)N,
                (long long)V);
  std::printf("%s: workspace %zu B, loss %.6f\n", name, wsb, double(l));
  record(name, "KD top-" + std::to_string(K) + ", full-vocab lse", nxv(N, V), "bf16", ms, double(st.bytes()), 0,
         min_frac);  // the student read once
}

}  // namespace

// The decode shapes per call in a replayed CUDA graph over rotating input sets (time_us_graph): the device
// time a decode loop that captures its sampling step pays, without one event-timed call's launch gap.
void bench_softmax_graph(fce_handle_t h, cudaStream_t s, int64_t N, int64_t V) {
  const int sets = graph_sets(size_t(N * V) * 6);
  std::vector<std::unique_ptr<Buf>> xs, ps;
  Buf temps({N}, f32());
  std::vector<float> t(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) t[size_t(i)] = 0.6f + 0.8f * float(i % 7) / 6.f;
  upload(temps, t.data(), t.size() * 4, s);
  fce_softmax_options_t o = FCE_SOFTMAX_OPTIONS_INIT;
  o.temperatures = temps.dl();
  std::vector<std::function<void()>> ops;
  size_t wsb = 0;
  for (int i = 0; i < sets; ++i) {
    xs.push_back(std::make_unique<Buf>(std::vector<int64_t>{N, V}, bf16()));
    ps.push_back(std::make_unique<Buf>(std::vector<int64_t>{N, V}, f32()));
    fill_random(*xs.back(), 3.f, 11 + unsigned(i), s);
    size_t b = 0;
    ok(fce_temp_softmax_workspace_size(h, xs.back()->dl(), &o, ps.back()->dl(), nullptr, &b), "softmax workspace size");
    wsb = std::max(wsb, b);
  }
  DevMem ws(wsb);
  for (int i = 0; i < sets; ++i)
    ops.push_back([&, i] {
      ok(fce_temp_softmax(h, fs(s), xs[size_t(i)]->dl(), &o, ps[size_t(i)]->dl(), nullptr, ws.p, ws.bytes),
         "fce_temp_softmax");
    });
  const double us = time_us_graph(s, ops);
  char name[96];
  std::snprintf(name, sizeof name, "softmax %lldx%lld bf16->f32, in a graph (%d sets)", (long long)N, (long long)V,
                sets);
  record(name, "softmax, in a graph (" + std::to_string(sets) + " sets)", nxv(N, V), "bf16->f32", us * 1e-3,
         double(N * V) * 6, 0, 0);
}

int main(int argc, char** argv) {
  const std::string json = take_json_arg(argc, argv);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  fce_handle_t h = nullptr;
  ok(fce_handle_create(kDLCUDA, 0, &h), "fce_handle_create");
  g_copy = copy_bandwidth_gbs(s);
  std::printf("device: %s\ncopy bandwidth (bytes read + written): %.0f GB/s\n", device_name().c_str(), g_copy);
  std::printf("timing floor (an empty kernel, same harness): %.1f us\n\n", launch_floor_us(s));

  bench_softmax(h, s, 1, 128256, 6, 0);
  bench_softmax(h, s, 16, 151936, 10, 0);
  bench_softmax(h, s, 256, 151936, 0, 0.85);
  bench_softmax(h, s, 1, 128256, 0, 0, true);
  bench_softmax(h, s, 16, 151936, 0, 0, true);
  std::printf("timing floor in a graph (an empty kernel per call): %.1f us\n", graph_floor_us(s));
  bench_softmax_graph(h, s, 1, 128256);
  bench_softmax_graph(h, s, 16, 151936);
  bench_softmax_logp(h, s, 256, 151936);
  bench_kd_full(h, s, 4096, 128256, false, 0.85);  // bytes: two reads
  bench_kd_full(h, s, 4096, 128256, true, 0.80);   // bytes: two reads and one write
  bench_kd_topk(h, s, 8192, 128256, 64, 0.85);     // bytes: the student read once
  bench_kd_full(h, s, 4096, 128256, false, 0, FCE_KD_REVERSE_KL);  // no target: the other divergences' paths
  bench_kd_full(h, s, 4096, 128256, true, 0, FCE_KD_REVERSE_KL);
  bench_kd_full(h, s, 4096, 128256, false, 0, FCE_KD_JSD);
  bench_kd_full(h, s, 4096, 128256, true, 0, FCE_KD_JSD);

  std::printf("\n%-44s %10s %9s %8s  %-18s %s\n", "shape", "time(us)", "GB/s", "of copy", "target", "result");
  int pass = 0, targets = 0;
  for (const Result& r : g_results) {
    std::printf("%-44s %10.1f %9.0f %7.1f%%  %-18s %s\n", r.name.c_str(), r.us, r.gbs, 100 * r.frac, r.target.c_str(),
                !r.has_target ? "" : r.pass ? "PASS" : "MISS");
    pass += r.has_target && r.pass;
    targets += r.has_target;
  }
  std::printf("%d of %d targets met\n", pass, targets);
  fce_handle_destroy(h);
  cudaStreamDestroy(s);
  if (!json.empty()) {
    std::vector<JsonRow> out;
    for (const Result& r : g_results)
      out.push_back({jstr("op", r.op), jstr("shape", r.shape), jstr("dtype", r.dtype), jnum("time_us", r.us),
                     jnum("gbps", r.gbs), jnum("pct_of_baseline", 100 * r.frac), jstr("target", r.target),
                     r.has_target ? jstr("result", r.pass ? "PASS" : "MISS") : jnull("result"), jstr("label", r.name)});
    if (!write_json(json, "bench_softmax_kd", {jnum("copy_gbps", g_copy)}, out)) return 1;
  }
  return 0;
}
