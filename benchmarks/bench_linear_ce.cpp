// Linear cross-entropy benchmark: time and TFLOP/s of forward(+backward) against a plain cuBLAS bf16 GEMM
// of the same shape in the same run, with the extra device memory the call needs.
// usage: bench_linear_ce [--debug | --sweep | --case N H V] [--json FILE]
#include <cublas_v2.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "bench_util.hpp"

using namespace bench;

namespace {

struct Gemm {  // an in-run cuBLAS baseline
  double tflops;
  std::string shape;  // MxNxK
};
std::vector<JsonRow> g_rows;

double gemm_tflops(cublasHandle_t blas, cudaStream_t s, int64_t M, int64_t N, int64_t K) {
  Buf a({M, K}, bf16()), b({N, K}, bf16()), c({M, N}, bf16());
  fill_random(a, 1.f, 5, s);
  fill_random(b, 1.f, 6, s);
  const float one = 1.f, zero = 0.f;
  const double ms = time_ms(s, [&] {
    cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(N), int(M), int(K), &one, b.p, CUDA_R_16BF, int(K), a.p,
                 CUDA_R_16BF, int(K), &zero, c.p, CUDA_R_16BF, int(N), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }, 10);
  return 2.0 * double(M) * double(N) * double(K) / (ms * 1e9);
}

// The three GEMMs of a linear CE forward + backward, whole (logits, dhidden, dweight over all N), in ms.
double three_gemms_ms(cublasHandle_t blas, cudaStream_t s, int64_t N, int64_t H, int64_t V) {
  Buf hid({N, H}, bf16()), w({V, H}, bf16()), lg({N, V}, bf16()), dh({N, H}, bf16()), dw({V, H}, bf16());
  fill_random(hid, 1.f, 7, s);
  fill_random(w, 0.02f, 8, s);
  fill_random(lg, 1e-4f, 9, s);
  const float one = 1.f, zero = 0.f;
  return time_ms(s, [&] {
    cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, int(V), int(N), int(H), &one, w.p, CUDA_R_16BF, int(H), hid.p,
                 CUDA_R_16BF, int(H), &zero, lg.p, CUDA_R_16BF, int(V), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, int(H), int(N), int(V), &one, w.p, CUDA_R_16BF, int(H), lg.p,
                 CUDA_R_16BF, int(V), &zero, dh.p, CUDA_R_16BF, int(H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_T, int(H), int(V), int(N), &one, hid.p, CUDA_R_16BF, int(H), lg.p,
                 CUDA_R_16BF, int(V), &zero, dw.p, CUDA_R_16BF, int(H), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }, 5);
}

void lce_case(fce_handle_t h, cudaStream_t s, int64_t N, int64_t H, int64_t V, bool grad, const Gemm& gemm,
              DLDataType dwt = bf16(), bool with_dw = true, size_t ws_bytes = 0) {
  const double gemm_rate = gemm.tflops;
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
  // Device memory the calls take beyond the caller's buffers (the library's cuBLAS handle and its
  // workspace, on the first call of the process), by the driver's count of free memory.
  size_t free0 = 0, free1 = 0, total = 0;
  ck(cudaDeviceSynchronize(), "sync");
  ck(cudaMemGetInfo(&free0, &total), "cudaMemGetInfo");
  const double ms = time_ms(s, [&] {
    ok(fce_linear_cross_entropy_fwd(h, reinterpret_cast<fce_stream_t>(s), hid.dl(), w.dl(), nullptr, tg.dl(), nullptr,
                                    &out, ws, wsb), "lce");
  }, 5);
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
                    jstr("baseline_gemm", gemm.shape), jnum("baseline_tflops", gemm_rate),
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
  if (argc == 5 && std::strcmp(argv[1], "--case") == 0) {  // one fwd+bwd shape, its own cuBLAS baseline
    const int64_t N = std::atoll(argv[2]), H = std::atoll(argv[3]), V = std::atoll(argv[4]);
    const Gemm g{gemm_tflops(blas, s, N, V, H), std::to_string(N) + "x" + std::to_string(V) + "x" + std::to_string(H)};
    std::printf("cuBLAS bf16 GEMM: %.0f TFLOP/s (%s)\n", g.tflops, g.shape.c_str());
    std::printf("| op | shape | ms | TFLOP/s | of cuBLAS | extra memory |\n|---|---|---|---|---|---|\n");
    lce_case(h, s, N, H, V, true, g);
    fce_handle_destroy(h);
    cublasDestroy(blas);
    return json.empty() || write_json(json, "bench_linear_ce", {jobj("cublas_tflops", {jnum(g.shape, g.tflops)})}, g_rows)
               ? 0
               : 1;
  }
  const Gemm g1{gemm_tflops(blas, s, 8192, 128256, 4096), "8192x128256x4096"},
      g2{gemm_tflops(blas, s, 8192, 256000, 2304), "8192x256000x2304"};
  std::printf("cuBLAS bf16 GEMM: %.0f TFLOP/s (8192x128256x4096), %.0f TFLOP/s (8192x256000x2304)\n\n", g1.tflops,
              g2.tflops);
  std::printf("| op | shape | ms | TFLOP/s | of cuBLAS | extra memory |\n|---|---|---|---|---|---|\n");
  if (argc > 1 && std::strcmp(argv[1], "--debug") == 0) {  // variants that locate a gradient problem
    std::printf("fp32 dweight:\n");
    lce_case(h, s, 8192, 4096, 128256, true, g1, f32());
    std::printf("dhidden only:\n");
    lce_case(h, s, 8192, 4096, 128256, true, g1, bf16(), false);
    std::printf("N=1024:\n");
    lce_case(h, s, 1024, 4096, 128256, true, g1);
    std::printf("N=300 H=64 V=3001:\n");
    lce_case(h, s, 300, 64, 3001, true, g1);
  }
  if (argc > 1 && std::strcmp(argv[1], "--sweep") == 0) {  // chunk length against the whole GEMMs
    for (auto [H, V] : {std::pair<int64_t, int64_t>{4096, 128256}, {2304, 256000}}) {
      const double ms = three_gemms_ms(blas, s, 8192, H, V);
      std::printf("three whole GEMMs N=8192 H=%lld V=%lld: %.2f ms\n", (long long)H, (long long)V, ms);
      for (size_t mib : {448, 1024, 2304})
        lce_case(h, s, 8192, H, V, true, H == 4096 ? g1 : g2, bf16(), true, mib << 20);
    }
  }
  lce_case(h, s, 8192, 4096, 128256, true, g1);
  lce_case(h, s, 8192, 4096, 128256, false, g1);
  lce_case(h, s, 8192, 2304, 256000, true, g2);
  fce_handle_destroy(h);
  cublasDestroy(blas);
  if (!json.empty() &&
      !write_json(json, "bench_linear_ce",
                  {jobj("cublas_tflops", {jnum(g1.shape, g1.tflops), jnum(g2.shape, g2.tflops)})}, g_rows))
    return 1;
  return 0;
}
