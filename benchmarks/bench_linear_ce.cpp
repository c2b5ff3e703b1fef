// Linear cross-entropy benchmark: time and TFLOP/s of forward(+backward) against a plain cuBLAS bf16 GEMM
// of the same shape timed in the same rounds (call and GEMM alternate, L2 flushed before each), with the
// extra device memory the call needs.
// usage: bench_linear_ce [--debug | --sweep | --case N H V | --ab N H V MODES [ROUNDS]] [--json FILE]
//   --ab: fwd+bwd under each FCE_FORCE_PATH value of MODES (comma-separated; "default" leaves it unset;
//   "rows=R": default, with a workspace that holds R-row chunks, so the planner cuts chunks of at most R)
//   and the three whole cuBLAS GEMMs of the shape, one timed run of each per round in a rotating order (the
//   H100's clocks drift over a run; every variant sees the same drift), L2 flushed before each, medians.
#include <cublas_v2.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <vector>

#include "bench_util.hpp"

using namespace bench;

namespace {

std::vector<JsonRow> g_rows;
std::vector<Field> g_rates;  // shape -> the GEMM's TFLOP/s in its rounds (the last measured), for plot_c.py

// The in-run reference (and issue 27's): one bf16 GEMM of N x V x H, logits-shaped, with its own operands.
struct GemmNVH {
  cublasHandle_t blas;
  int64_t N, V, H;
  Buf a, b, c;
  GemmNVH(cublasHandle_t bl, cudaStream_t s, int64_t N_, int64_t V_, int64_t H_)
      : blas(bl), N(N_), V(V_), H(H_), a({N, H}, bf16()), b({V, H}, bf16()), c({N, V}, bf16()) {
    fill_random(a, 1.f, 5, s);
    fill_random(b, 1.f, 6, s);
  }
  void operator()() const {
    const float one = 1.f, zero = 0.f;
    cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(V), int(N), int(H), &one, b.p, CUDA_R_16BF, int(H), a.p,
                 CUDA_R_16BF, int(H), &zero, c.p, CUDA_R_16BF, int(V), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }
  double flops() const { return 2.0 * double(N) * double(V) * double(H); }
  std::string shape() const { return std::to_string(N) + "x" + std::to_string(V) + "x" + std::to_string(H); }
};

// Each of `fns` once per round in a rotating order, the L2 flushed before each (after one warm-up call of
// each): the times in ms, sorted, per function. The H100's clocks drift over a run; every function sees
// the same drift.
std::vector<std::vector<float>> rounds_ms(cudaStream_t s, const std::vector<std::function<void()>>& fns, int rounds) {
  std::vector<std::vector<float>> t(fns.size());
  cudaEvent_t ea, eb;
  cudaEventCreate(&ea);
  cudaEventCreate(&eb);
  for (auto& f : fns) f();
  for (int r = 0; r < rounds; ++r)
    for (size_t j = 0; j < fns.size(); ++j) {
      const size_t v = (j + size_t(r)) % fns.size();
      flush_l2(s);
      cudaEventRecord(ea, s);
      fns[v]();
      cudaEventRecord(eb, s);
      ck(cudaEventSynchronize(eb), "sync");
      float ms = 0;
      cudaEventElapsedTime(&ms, ea, eb);
      t[v].push_back(ms);
    }
  cudaEventDestroy(ea);
  cudaEventDestroy(eb);
  for (auto& v : t) std::sort(v.begin(), v.end());
  return t;
}

float median(const std::vector<float>& sorted) { return sorted[sorted.size() / 2]; }

// The three GEMMs of a linear CE forward + backward, whole (logits, dhidden, dweight over all N).
struct ThreeGemms {
  cublasHandle_t blas;
  int64_t N, H, V;
  Buf hid, w, lg, dh, dw;
  ThreeGemms(cublasHandle_t b, cudaStream_t s, int64_t N_, int64_t H_, int64_t V_)
      : blas(b), N(N_), H(H_), V(V_), hid({N, H}, bf16()), w({V, H}, bf16()), lg({N, V}, bf16()),
        dh({N, H}, bf16()), dw({V, H}, bf16()) {
    fill_random(hid, 1.f, 7, s);
    fill_random(w, 0.02f, 8, s);
    fill_random(lg, 1e-4f, 9, s);
  }
  void operator()() const {
    const float one = 1.f, zero = 0.f;
    cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(V), int(N), int(H), &one, w.p, CUDA_R_16BF, int(H), hid.p,
                 CUDA_R_16BF, int(H), &zero, lg.p, CUDA_R_16BF, int(V), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, int(H), int(N), int(V), &one, w.p, CUDA_R_16BF, int(H), lg.p,
                 CUDA_R_16BF, int(V), &zero, dh.p, CUDA_R_16BF, int(H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, int(H), int(V), int(N), &one, hid.p, CUDA_R_16BF, int(H), lg.p,
                 CUDA_R_16BF, int(V), &zero, dw.p, CUDA_R_16BF, int(H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }
};

double three_gemms_ms(cublasHandle_t blas, cudaStream_t s, int64_t N, int64_t H, int64_t V) {
  const ThreeGemms g(blas, s, N, H, V);
  return time_ms(s, [&] { g(); }, 5);
}

// --ab (the header): prints one row per variant.
void ab_case(fce_handle_t h, cublasHandle_t blas, cudaStream_t s, int64_t N, int64_t H, int64_t V,
             const std::string& modes, int rounds) {
  std::vector<std::string> names;
  std::stringstream ss(modes);
  for (std::string m; std::getline(ss, m, ',');) names.push_back(m);
  const ThreeGemms three(blas, s, N, H, V);
  Buf hid({N, H}, bf16()), w({V, H}, bf16()), tg({N}, i32()), loss({}, f32()), dh({N, H}, bf16()),
      dw({V, H}, bf16());
  fill_random(hid, 1.f, 1, s);
  fill_random(w, 0.02f, 2, s);
  fill_targets(tg, V, 3, s);
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.dhidden = dh.dl();
  out.dweight = dw.dl();
  size_t wsb = 0;
  ok(fce_linear_cross_entropy_fwd_workspace_size(h, hid.dl(), w.dl(), nullptr, tg.dl(), nullptr, &out, &wsb), "ws");
  void* ws = nullptr;
  ck(cudaMalloc(&ws, wsb), "ws");
  const GemmNVH gemm(blas, s, N, V, H);
  std::vector<std::function<void()>> fns{[&] { three(); }, [&] { gemm(); }};
  for (const std::string& m : names) {
    size_t bytes = wsb;
    if (m.rfind("rows=", 0) == 0) {  // what R rows take (a call of R tokens, one chunk), with 1 MiB to spare
      Buf hr({std::atoll(m.c_str() + 5), H}, bf16()), tr({std::atoll(m.c_str() + 5)}, i32());
      fce_linear_ce_outputs_t o = out;
      o.dhidden = nullptr;
      ok(fce_linear_cross_entropy_fwd_workspace_size(h, hr.dl(), w.dl(), nullptr, tr.dl(), nullptr, &o, &bytes),
         "ws rows");
      bytes = std::min(wsb, bytes + (size_t(1) << 20));
    }
    fns.push_back([&, m, bytes] {
      if (m == "default" || m.rfind("rows=", 0) == 0) unsetenv("FCE_FORCE_PATH");
      else setenv("FCE_FORCE_PATH", m.c_str(), 1);
      ok(fce_linear_cross_entropy_fwd(h, reinterpret_cast<fce_stream_t>(s), hid.dl(), w.dl(), nullptr, tg.dl(),
                                      nullptr, &out, ws, bytes), "lce");
    });
  }
  names.insert(names.begin(), {"three whole cuBLAS GEMMs", "one cuBLAS GEMM, N x V x H"});
  const std::vector<std::vector<float>> t = rounds_ms(s, fns, rounds);
  unsetenv("FCE_FORCE_PATH");
  cudaFree(ws);
  std::vector<double> med(t.size());
  for (size_t v = 0; v < t.size(); ++v) med[v] = median(t[v]);
  const double flops3 = 6.0 * double(N) * double(H) * double(V), gemm_in_rounds = flops3 / 3 / (med[1] * 1e9),
               rate3 = flops3 / (med[0] * 1e9);
  std::printf("N=%lld H=%lld V=%lld, %d rounds; cuBLAS bf16 GEMM %s: %.0f TFLOP/s in them\n", (long long)N,
              (long long)H, (long long)V, rounds, gemm.shape().c_str(), gemm_in_rounds);
  std::printf("| variant | ms median (min..max) | TFLOP/s | of the GEMM's rate in the rounds | of the three whole "
              "GEMMs' rate |\n|---|---|---|---|---|\n");
  for (size_t v = 0; v < t.size(); ++v) {
    const double flops = v == 1 ? flops3 / 3 : flops3, rate = flops / (med[v] * 1e9);
    std::printf("| %s | %.2f (%.2f..%.2f) | %.0f | %.1f%% | %.1f%% |\n", names[v].c_str(), med[v], t[v].front(),
                t[v].back(), rate, 100 * rate / gemm_in_rounds, 100 * rate / rate3);
    char shape[96];
    std::snprintf(shape, sizeof shape, "N=%lld H=%lld V=%lld", (long long)N, (long long)H, (long long)V);
    g_rows.push_back({jstr("op", "linear CE fwd+bwd"), jstr("shape", shape), jstr("variant", names[v]),
                      jnum("time_ms", med[v]), jnum("min_ms", t[v].front()), jnum("max_ms", t[v].back()),
                      jnum("tflops", rate), jnum("pct_of_gemm_in_rounds", 100 * rate / gemm_in_rounds),
                      jnum("pct_of_three_gemms", 100 * rate / rate3),
                      jnum("gemm_tflops_in_rounds", gemm_in_rounds),
                      jnum("rounds", rounds)});
  }
  std::fflush(stdout);
}

// One call's time (median of `rounds`, alternating with the N x V x H GEMM, whose rate in the same rounds is
// the row's baseline) and the device memory it takes beyond the caller's buffers.
void lce_case(fce_handle_t h, cublasHandle_t blas, cudaStream_t s, int64_t N, int64_t H, int64_t V, bool grad,
              DLDataType dwt = bf16(), bool with_dw = true, size_t ws_bytes = 0, int rounds = 9) {
  Buf hid({N, H}, bf16()), w({V, H}, bf16()), tg({N}, i32()), loss({}, f32());
  fill_random(hid, 1.f, 1, s);
  fill_random(w, 0.02f, 2, s);
  fill_targets(tg, V, 3, s);
  Buf dh({N, H}, bf16()), dw({V, H}, dwt);
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  if (grad) { out.dhidden = dh.dl(); out.dweight = with_dw ? dw.dl() : nullptr; }
  size_t wsb = 0;
  ok(fce_linear_cross_entropy_fwd_workspace_size(h, hid.dl(), w.dl(), nullptr, tg.dl(), nullptr, &out, &wsb), "ws");
  if (ws_bytes) wsb = ws_bytes;
  void* ws = nullptr;
  ck(cudaMalloc(&ws, wsb), "ws");
  const GemmNVH gemm(blas, s, N, V, H);
  // Device memory the calls take beyond the caller's buffers (the library's cuBLAS handle and its
  // workspace, on the first call of the process), by the driver's count of free memory.
  size_t free0 = 0, free1 = 0, total = 0;
  ck(cudaDeviceSynchronize(), "sync");
  ck(cudaMemGetInfo(&free0, &total), "cudaMemGetInfo");
  const std::vector<std::vector<float>> t = rounds_ms(
      s,
      {[&] { gemm(); },
       [&] {
         ok(fce_linear_cross_entropy_fwd(h, reinterpret_cast<fce_stream_t>(s), hid.dl(), w.dl(), nullptr, tg.dl(),
                                         nullptr, &out, ws, wsb),
            "lce");
       }},
      rounds);
  const double ms = median(t[1]), gemm_rate = gemm.flops() / (median(t[0]) * 1e9);
  g_rates.erase(std::remove_if(g_rates.begin(), g_rates.end(), [&](const Field& f) { return f.key == gemm.shape(); }),
                g_rates.end());
  g_rates.push_back(jnum(gemm.shape(), gemm_rate));
  ck(cudaMemGetInfo(&free1, &total), "cudaMemGetInfo");
  cudaFree(ws);
  // Sanity: no NaN or inf in the loss and the gradients (bf16 bit patterns with an all-ones exponent).
  auto nonfinite = [&](Buf& b) {
    size_t n = 0;
    if (b.t.dtype.bits == 32) {
      std::vector<float> hbuf(b.bytes() / 4);
      ck(cudaMemcpy(hbuf.data(), b.p, b.bytes(), cudaMemcpyDeviceToHost), "copy back");
      for (float v : hbuf) n += !std::isfinite(v);
      return n;
    }
    std::vector<uint16_t> hbuf(b.bytes() / 2);
    ck(cudaMemcpy(hbuf.data(), b.p, b.bytes(), cudaMemcpyDeviceToHost), "copy back");
    for (uint16_t v : hbuf) n += (v & 0x7f80u) == 0x7f80u;
    return n;
  };
  float hl = 0;
  ck(cudaMemcpy(&hl, loss.p, 4, cudaMemcpyDeviceToHost), "copy back");
  std::printf("  (device memory taken by the calls beyond the caller's buffers, cudaMemGetInfo: %.1f MiB)\n",
              (double(free0) - double(free1)) / 1048576.0);
  const size_t bad_dh = grad ? nonfinite(dh) : size_t(0), bad_dw = grad && with_dw ? nonfinite(dw) : size_t(0);
  std::printf("  (loss %.6f; non-finite gradient elements: dhidden %zu, dweight %zu)\n", hl, bad_dh, bad_dw);
  const double flops = (grad ? 6.0 : 2.0) * double(N) * double(H) * double(V);
  const double rate = flops / (ms * 1e9);
  const std::string op = grad ? "linear CE fwd+bwd" : "linear CE fwd";
  char shape[96];
  std::snprintf(shape, sizeof shape, "N=%lld H=%lld V=%lld", (long long)N, (long long)H, (long long)V);
  std::printf("| %s | %s | %.2f | %.0f | %.1f%% | %.0f MiB workspace |\n", op.c_str(), shape, ms, rate,
              100 * rate / gemm_rate, double(wsb) / 1048576.0);
  std::fflush(stdout);
  g_rows.push_back({jstr("op", op), jstr("shape", shape), jstr("dtype", dwt.bits == 32 ? "bf16, fp32 dweight" : "bf16"),
                    jstr("outputs", !grad ? "loss" : with_dw ? "loss, dhidden, dweight" : "loss, dhidden"),
                    jnum("time_ms", ms), jnum("tflops", rate), jnum("pct_of_baseline", 100 * rate / gemm_rate),
                    jstr("baseline_gemm", gemm.shape()), jnum("baseline_tflops", gemm_rate),
                    jnum("workspace_mib", double(wsb) / 1048576.0),
                    jnum("device_mib_beyond_buffers", (double(free0) - double(free1)) / 1048576.0),
                    jnum("loss", double(hl)),
                    grad ? jnum("nonfinite_dhidden", double(bad_dh)) : jnull("nonfinite_dhidden"),
                    grad && with_dw ? jnum("nonfinite_dweight", double(bad_dw)) : jnull("nonfinite_dweight")});
}

}  // namespace

int main(int argc, char** argv) {
  const std::string json = take_json_arg(argc, argv);
  cudaStream_t s;
  ck(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cublasHandle_t blas;
  cublasCreate(&blas);
  cublasSetStream(blas, s);
  fce_handle_t h;
  ok(fce_handle_create(kDLCUDA, 0, &h), "handle");
  std::printf("device: %s\n", device_name().c_str());
  if (argc >= 6 && std::strcmp(argv[1], "--ab") == 0) {
    ab_case(h, blas, s, std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), argv[5],
            argc > 6 ? std::atoi(argv[6]) : 9);
    fce_handle_destroy(h);
    cublasDestroy(blas);
    return json.empty() || write_json(json, "bench_linear_ce", {}, g_rows) ? 0 : 1;
  }
  std::printf("| op | shape | ms | TFLOP/s | of the cuBLAS GEMM in the same rounds | extra memory |\n"
              "|---|---|---|---|---|---|\n");
  if (argc == 5 && std::strcmp(argv[1], "--case") == 0) {  // one fwd+bwd shape
    lce_case(h, blas, s, std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), true);
  } else {
    if (argc > 1 && std::strcmp(argv[1], "--debug") == 0) {  // variants that locate a gradient problem
      std::printf("fp32 dweight:\n");
      lce_case(h, blas, s, 8192, 4096, 128256, true, f32());
      std::printf("dhidden only:\n");
      lce_case(h, blas, s, 8192, 4096, 128256, true, bf16(), false);
      std::printf("N=1024:\n");
      lce_case(h, blas, s, 1024, 4096, 128256, true);
      std::printf("N=300 H=64 V=3001:\n");
      lce_case(h, blas, s, 300, 64, 3001, true);
    }
    if (argc > 1 && std::strcmp(argv[1], "--sweep") == 0) {  // chunk length against the whole GEMMs
      for (auto [H, V] : {std::pair<int64_t, int64_t>{4096, 128256}, {2304, 256000}}) {
        const double ms = three_gemms_ms(blas, s, 8192, H, V);
        std::printf("three whole GEMMs N=8192 H=%lld V=%lld: %.2f ms\n", (long long)H, (long long)V, ms);
        for (size_t mib : {448, 1024, 2304}) lce_case(h, blas, s, 8192, H, V, true, bf16(), true, mib << 20);
      }
    }
    lce_case(h, blas, s, 8192, 4096, 128256, true);
    lce_case(h, blas, s, 8192, 4096, 128256, false);
    lce_case(h, blas, s, 8192, 2304, 256000, true);
  }
  fce_handle_destroy(h);
  cublasDestroy(blas);
  if (!json.empty() && !write_json(json, "bench_linear_ce", {jobj("cublas_tflops", g_rates)}, g_rows)) return 1;
  return 0;
}
