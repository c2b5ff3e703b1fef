// Cross-entropy and logsumexp benchmark on the GPU: each op as a fraction of the device's copy bandwidth,
// measured in the same run (the decode-size logsumexp also with its logits in L2, no target). Prints a table;
// usage: bench_ce [--quick] [--json FILE]
#include <cstring>
#include <functional>
#include <memory>

#include "bench_util.hpp"

using namespace bench;

namespace {

struct Row {
  std::string op, shape, dtype;
  double us, gbs, frac, target;
};
std::vector<Row> rows;

void report(const std::string& op, int64_t N, int64_t V, const char* dt, double ms, double bytes, double copy_gbs,
            double target) {
  const double gbs = bytes / (ms * 1e6);
  rows.push_back({op, std::to_string(N) + "x" + std::to_string(V), dt, ms * 1e3, gbs, gbs / copy_gbs, target});
  std::printf("%-34s %-14s %-5s %10.1f us %8.0f GB/s %6.1f%%\n", op.c_str(), rows.back().shape.c_str(), dt, ms * 1e3,
              gbs, 100 * gbs / copy_gbs);
  std::fflush(stdout);
}

const char* name(DLDataType d) { return d.bits == 32 ? "fp32" : d.code == kDLBfloat ? "bf16" : "fp16"; }

// per_row: reduction NONE with the lse too (scoring sampled tokens), else the mean loss.
void ce_case(fce_handle_t h, cudaStream_t s, int64_t N, int64_t V, DLDataType dt, bool grad, double copy_gbs,
             double target, bool per_row = false) {
  Buf logits({N, V}, dt), targets({N}, i32()), loss(per_row ? std::vector<int64_t>{N} : std::vector<int64_t>{}, f32()),
      lse({N}, f32());
  fill_random(logits, 3.f, 1, s);
  fill_targets(targets, V, 2, s);
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  if (per_row) {
    o.reduction = FCE_REDUCTION_NONE;
    out.lse = lse.dl();
  }
  if (grad) out.dlogits = logits.dl();  // in place, as Liger does
  size_t wsb = 0;
  ok(fce_cross_entropy_fwd_workspace_size(h, logits.dl(), targets.dl(), &o, &out, &wsb), "ws");
  void* ws = nullptr;
  ck(cudaMalloc(&ws, wsb + 256), "ws");
  const double ms = time_ms(s, [&] {
    ok(fce_cross_entropy_fwd(h, reinterpret_cast<fce_stream_t>(s), logits.dl(), targets.dl(), &o, &out, ws, wsb),
       "ce");
  });
  cudaFree(ws);
  const double bytes = double(N) * double(V) * (dt.bits / 8) * (grad ? 2 : 1);
  report(grad ? "CE fwd + dlogits (in place)" : per_row ? "CE fwd (per-row loss and lse)" : "CE fwd (mean loss)", N, V,
         name(dt), ms, bytes, copy_gbs, target);
}

// in_l2: the logits written by a copy just before each run (still in L2, as the LM head's output is at decode)
// instead of read from DRAM after the flush; shown beside the targets, not measured against them.
void lse_case(fce_handle_t h, cudaStream_t s, int64_t N, int64_t V, DLDataType dt, double copy_gbs, double target,
              bool in_l2 = false, const char* label = nullptr) {
  Buf x({N, V}, dt), lse({N}, f32());
  fill_random(x, 3.f, 3, s);
  size_t wsb = 0;
  ok(fce_logsumexp_workspace_size(h, x.dl(), nullptr, lse.dl(), &wsb), "ws");
  void* ws = nullptr;
  ck(cudaMalloc(&ws, wsb + 256), "ws");
  auto op = [&] { ok(fce_logsumexp(h, reinterpret_cast<fce_stream_t>(s), x.dl(), nullptr, lse.dl(), ws, wsb), "lse"); };
  const double ms = in_l2 ? time_ms_input_in_l2(s, x.p, x.bytes(), op) : time_ms(s, op);
  cudaFree(ws);
  report(label ? label : in_l2 ? "logsumexp (logits in L2)" : "logsumexp", N, V, name(dt), ms,
         double(N) * double(V) * (dt.bits / 8), copy_gbs, in_l2 ? -1 : target);
}

// The decode logsumexp per call in a replayed CUDA graph over rotating input sets (time_us_graph); no target.
void lse_graph_case(fce_handle_t h, cudaStream_t s, int64_t N, int64_t V, double copy_gbs) {
  const int sets = graph_sets(size_t(N * V) * 2);
  std::vector<std::unique_ptr<Buf>> xs;
  Buf lse({N}, f32());
  size_t wsb = 0;
  for (int i = 0; i < sets; ++i) {
    xs.push_back(std::make_unique<Buf>(std::vector<int64_t>{N, V}, bf16()));
    fill_random(*xs.back(), 3.f, 3 + unsigned(i), s);
    size_t b = 0;
    ok(fce_logsumexp_workspace_size(h, xs.back()->dl(), nullptr, lse.dl(), &b), "ws");
    wsb = std::max(wsb, b);
  }
  void* ws = nullptr;
  ck(cudaMalloc(&ws, wsb + 256), "ws");
  std::vector<std::function<void()>> ops;
  for (int i = 0; i < sets; ++i)
    ops.push_back([&, i] {
      ok(fce_logsumexp(h, reinterpret_cast<fce_stream_t>(s), xs[size_t(i)]->dl(), nullptr, lse.dl(), ws, wsb), "lse");
    });
  const double us = time_us_graph(s, ops);
  cudaFree(ws);
  char label[64];
  std::snprintf(label, sizeof label, "logsumexp (in a graph, %d sets)", sets);
  report(label, N, V, name(bf16()), us * 1e-3, double(N) * double(V) * 2, copy_gbs, -1);
}

std::string target_text(double target) {
  return target > 0 ? std::to_string(int(target * 100)) + "%" : target < 0 ? "none" : "time";
}

}  // namespace

int main(int argc, char** argv) {
  const std::string json = take_json_arg(argc, argv);
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  fce_handle_t h;
  ok(fce_handle_create(kDLCUDA, 0, &h), "handle");
  const double copy = copy_bandwidth_gbs(s);
  std::printf("device: %s\ncopy bandwidth (read+write): %.0f GB/s\n", device_name().c_str(), copy);
  std::printf("timing floor (an empty kernel, same harness): %.1f us\n\n", launch_floor_us(s));
  // The decode sizes first, before the large shapes heat the GPU (as bench_softmax_kd does), and once more at
  // the end for comparison: H100, logsumexp 16x151936 read 0.2-0.3 us slower after them.
  lse_case(h, s, 16, 151936, bf16(), copy, 0.0);
  lse_case(h, s, 1, 128256, bf16(), copy, 0.0);
  lse_case(h, s, 16, 151936, bf16(), copy, 0.0, true);
  lse_case(h, s, 1, 128256, bf16(), copy, 0.0, true);
  std::printf("timing floor in a graph (an empty kernel per call): %.1f us\n", graph_floor_us(s));
  lse_graph_case(h, s, 16, 151936, copy);
  lse_graph_case(h, s, 1, 128256, copy);
  ce_case(h, s, 8192, 128256, bf16(), false, copy, 0.90);
  ce_case(h, s, 8192, 128256, bf16(), true, copy, 0.85);
  ce_case(h, s, 16384, 151936, bf16(), false, copy, 0.90);
  ce_case(h, s, 4096, 256000, bf16(), false, copy, 0.90);
  if (!quick) {
    ce_case(h, s, 8192, 128256, f16(), false, copy, 0.90);
    ce_case(h, s, 4096, 128256, f32(), false, copy, 0.90);
    ce_case(h, s, 8192, 128256, f16(), true, copy, 0.85);
    ce_case(h, s, 16384, 151936, bf16(), true, copy, 0.85);
    ce_case(h, s, 16, 151936, bf16(), false, copy, 0.0);
    ce_case(h, s, 16, 151936, bf16(), false, copy, 0.0, true);
    ce_case(h, s, 1, 128256, bf16(), false, copy, 0.0, true);
    ce_case(h, s, 32, 151936, bf16(), false, copy, 0.0);
    lse_case(h, s, 32, 151936, bf16(), copy, 0.0);
    ce_case(h, s, 64, 151936, bf16(), false, copy, 0.0);
    lse_case(h, s, 64, 151936, bf16(), copy, 0.0);
    ce_case(h, s, 128, 151936, bf16(), false, copy, 0.0);
    lse_case(h, s, 128, 151936, bf16(), copy, 0.0);
    ce_case(h, s, 256, 151936, bf16(), false, copy, 0.0);
    lse_case(h, s, 256, 151936, bf16(), copy, 0.0);
  }
  lse_case(h, s, 8192, 128256, bf16(), copy, 0.90);
  if (!quick) lse_case(h, s, 8192, 128256, f32(), copy, 0.90);
  lse_case(h, s, 16, 151936, bf16(), copy, -1.0, false, "logsumexp, after the large shapes");
  lse_case(h, s, 1, 128256, bf16(), copy, -1.0, false, "logsumexp, after the large shapes");
  std::printf("\n| op | shape | dtype | time (us) | GB/s | of copy bw | target |\n|---|---|---|---|---|---|---|\n");
  for (const Row& r : rows)
    std::printf("| %s | %s | %s | %.1f | %.0f | %.1f%% | %s |\n", r.op.c_str(), r.shape.c_str(), r.dtype.c_str(), r.us,
                r.gbs, 100 * r.frac, target_text(r.target).c_str());
  fce_handle_destroy(h);
  if (!json.empty()) {
    std::vector<JsonRow> out;
    for (const Row& r : rows)
      out.push_back({jstr("op", r.op), jstr("shape", r.shape), jstr("dtype", r.dtype), jnum("time_us", r.us),
                     jnum("gbps", r.gbs), jnum("pct_of_baseline", 100 * r.frac),
                     jstr("target", target_text(r.target))});
    if (!write_json(json, "bench_ce", {jnum("copy_gbps", copy)}, out)) return 1;
  }
  return 0;
}
