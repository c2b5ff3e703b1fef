// Linear CE's three GEMMs cut into token chunks, as src/cuda/linear_ce.cu issues them (bf16, fp32 compute,
// column-major views): logits = W^T h_c, dhidden_c = W dl_c, dweight += h_c dl_c^T (beta = 1 after the first
// chunk). For each chunk length, the sum over the chunks of N tokens of each GEMM's time (median of 5 event-
// timed repetitions), through cublasGemmEx with the library's math mode, without it, with an fp32 output,
// and through cublasLt with each of its first heuristic algorithms (its tile, split-K, waves). Whole N is the
// reference: the plain GEMMs of the same shapes.
//
//     probe_lce_gemms N H V C[,C...] [LT_ALGOS]
//
// --gemm: one of the three GEMMs alone, every variant timed once per round in a rotating order (so the
// H100's clock drift hits all alike), median over the rounds, against the whole GEMM (K or N = all tokens,
// cublasGemmEx) of the same rounds: cublasGemmEx over the chunks (the library until 2026-11-27; dweight
// adding, beta = 1), dweight not adding (beta = 0: the cost of reading the output), and cublasLt's first
// heuristic algorithms over the chunks. A chunk of N rows gives each algorithm's whole GEMM.
//
//     probe_lce_gemms --gemm logits|dhidden|dweight N H V C[,C...] [LT_ALGOS] [ROUNDS]
//
// --search: every configuration cuBLASLt accepts for the chunk's GEMM (see search_mode).
// --fwdblocks: the forward's chunk in vocabulary blocks that stay in L2 (see fwdblocks_mode).
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "probe_util.cuh"


namespace {

using probe_util::fill;
using probe_util::once_ms;



// Median of `reps` timed calls after one untimed.
float median_ms(const std::function<void()>& f, int reps = 5) {
  f();
  CK(cudaDeviceSynchronize());
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) t.push_back(once_ms(f));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

struct Gemm {  // one column-major GEMM: D (m x n) = alpha op(A) op(B) + beta C
  cublasOperation_t ta, tb;
  int m, n, k;
  const void* A;
  int lda;
  const void* B;
  int ldb;
  void* C;
  cudaDataType ct;
  int ldc;
};

cublasHandle_t g_blas, g_blas_free;
cublasLtHandle_t g_lt;
void* g_ws;
const size_t kWs = 32u << 20;

void gemm_ex(cublasHandle_t b, const Gemm& g, float beta) {
  const float one = 1.f;
  CK(cublasGemmEx(b, g.ta, g.tb, g.m, g.n, g.k, &one, g.A, CUDA_R_16BF, g.lda, g.B, CUDA_R_16BF, g.ldb, &beta, g.C,
                  g.ct, g.ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

struct LtPlan {
  cublasLtMatmulDesc_t desc;
  cublasLtMatrixLayout_t a, b, c;
  std::vector<cublasLtMatmulHeuristicResult_t> algos;
};

LtPlan lt_plan(const Gemm& g, int want) {
  LtPlan p{};
  CK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  CK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof g.ta));
  CK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof g.tb));
  const bool at = g.ta == CUBLAS_OP_T, bt = g.tb == CUBLAS_OP_T;
  CK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, at ? g.k : g.m, at ? g.m : g.k, g.lda));
  CK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, bt ? g.n : g.k, bt ? g.k : g.n, g.ldb));
  CK(cublasLtMatrixLayoutCreate(&p.c, g.ct, g.m, g.n, g.ldc));
  cublasLtMatmulPreference_t pref;
  CK(cublasLtMatmulPreferenceCreate(&pref));
  // PROBE_LIB=1: the library's preferences (src/cuda/blas.cpp: no workspace, no split-K)
  static const bool lib = std::getenv("PROBE_LIB") != nullptr;
  const size_t ws = lib ? 0 : kWs;
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
  // no reduction in the 16-bit output type (the library's math mode)
  const uint32_t mask =
      lib ? CUBLASLT_REDUCTION_SCHEME_NONE : CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  CK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &mask, sizeof mask));
  p.algos.resize(size_t(want));
  int got = 0;
  CK(cublasLtMatmulAlgoGetHeuristic(g_lt, p.desc, p.a, p.b, p.c, p.c, pref, want, p.algos.data(), &got));
  p.algos.resize(size_t(got));
  CK(cublasLtMatmulPreferenceDestroy(pref));
  return p;
}

// Algorithm i of `from`'s list (default: p's own) on p's shapes.
void lt_run(const LtPlan& p, const Gemm& g, int i, float beta, const LtPlan* from = nullptr) {
  const float one = 1.f;
  CK(cublasLtMatmul(g_lt, p.desc, &one, g.A, p.a, g.B, p.b, &beta, g.C, p.c, g.C, p.c,
                    &(from ? from : &p)->algos[size_t(i)].algo, g_ws, kWs, 0));
}

std::string algo_name(const cublasLtMatmulHeuristicResult_t& r) {
  int id = 0, tile = 0, splitk = 0, red = 0, stages = 0, swz = 0, custom = 0;
  uint16_t cluster = 0, inner = 0;
  size_t n;
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &n);
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &n);
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof splitk, &n);
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &red, sizeof red, &n);
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof stages, &n);
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof cluster, &n);
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof swz, &n);
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof custom, &n);
  cublasLtMatmulAlgoConfigGetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_INNER_SHAPE_ID, &inner, sizeof inner, &n);
  char s[200];
  std::snprintf(s, sizeof s, "id%d tile%d sk%d red%d st%d cl%d swz%d opt%d in%d waves%.2f ws%zuK", id, tile, splitk,
                red, stages, int(cluster), swz, custom, int(inner), double(r.wavesCount), r.workspaceSize >> 10);
  return s;
}

// The GEMMs' operands for N tokens (the chunk's dlogits buffer holds all N rows), filled, and the cuBLAS
// workspace.
struct Operands {
  int ldl;
  __nv_bfloat16 *hid, *w, *dl, *dh, *dw;
  Operands(int N, int H, int V) : ldl((V + 127) / 128 * 128) {
    CK(cudaMalloc(&hid, size_t(N) * H * 2));
    CK(cudaMalloc(&w, size_t(V) * H * 2));
    CK(cudaMalloc(&dl, size_t(N) * ldl * 2));
    CK(cudaMalloc(&dh, size_t(N) * H * 2));
    CK(cudaMalloc(&dw, size_t(V) * H * 2));
    CK(cudaMalloc(&g_ws, kWs));
    fill<<<1024, 256>>>(hid, size_t(N) * H, 1.f, 1);
    fill<<<1024, 256>>>(w, size_t(V) * H, 0.02f, 2);
    fill<<<1024, 256>>>(dl, size_t(N) * ldl, 1e-4f, 3);
    fill<<<1024, 256>>>(dw, size_t(V) * H, 1e-3f, 4);
  }
};

// Rows of a rounds table: each variant's median (min..max) over its rounds, its rate, and its rate against
// the first variant's.
void print_rows(const std::vector<std::string>& names, std::vector<std::vector<float>>& t, double flop) {
  std::vector<float> med(t.size());
  for (size_t v = 0; v < t.size(); ++v) {
    std::sort(t[v].begin(), t[v].end());
    med[v] = t[v][t[v].size() / 2];
  }
  for (size_t v = 0; v < t.size(); ++v)
    std::printf("| %s | %.3f (%.3f..%.3f) | %.0f | %.1f%% |\n", names[v].c_str(), med[v], t[v].front(), t[v].back(),
                flop / med[v] / 1e9, 100.0 * med[0] / med[v]);
}

// The chunk's GEMM of `kind` (0 logits, 1 dhidden, 2 dweight) for the tokens [r0, r0 + rows).
Gemm chunk_gemm(const Operands& o, int kind, int H, int V, int r0, int rows) {
  if (kind == 0)
    return Gemm{CUBLAS_OP_T, CUBLAS_OP_N, V, rows, H, o.w, H, o.hid + size_t(r0) * H, H, o.dl, CUDA_R_16BF, o.ldl};
  if (kind == 1)
    return Gemm{CUBLAS_OP_N, CUBLAS_OP_N, H, rows, V, o.w, H, o.dl + size_t(r0) * o.ldl, o.ldl,
                o.dh + size_t(r0) * H, CUDA_R_16BF, H};
  return Gemm{CUBLAS_OP_N, CUBLAS_OP_T, H, V, rows, o.hid + size_t(r0) * H, H, o.dl + size_t(r0) * o.ldl, o.ldl, o.dw,
              CUDA_R_16BF, H};
}

int gemm_mode(const std::string& which, int N, int H, int V, std::vector<int> cs, int lt_algos, int rounds) {
  const Operands o(N, H, V);
  const int kind = which == "logits" ? 0 : which == "dhidden" ? 1 : 2;
  CK(cublasCreate(&g_blas));
  CK(cublasSetMathMode(g_blas, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  CK(cublasSetWorkspace(g_blas, g_ws, kWs));
  CK(cublasLtCreate(&g_lt));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double flop = 2.0 * N * double(H) * V;
  auto gemm = [&](int r0, int rows) { return chunk_gemm(o, kind, H, V, r0, rows); };
  auto beta = [&](int r0) { return kind == 2 && r0 ? 1.f : 0.f; };
  std::printf("%s, %d SMs; %s GEMMs, N=%d H=%d V=%d; median ms over %d rounds (TFLOP/s, %% of the whole "
              "GEMM's rate in the same rounds)\n",
              prop.name, prop.multiProcessorCount, which.c_str(), N, H, V, rounds);
  for (int C : cs) {
    std::vector<std::pair<int, int>> chunks;
    for (int r = 0; r < N; r += C) chunks.push_back({r, std::min(C, N - r)});
    std::vector<std::string> names{"whole GEMM, GemmEx", "GemmEx over the chunks"};
    std::vector<std::function<void()>> fns{
        [&] { gemm_ex(g_blas, gemm(0, N), 0.f); },
        [&] { for (auto [r0, n] : chunks) gemm_ex(g_blas, gemm(r0, n), beta(r0)); }};
    if (kind == 2) {
      names.push_back("GemmEx over the chunks, not adding");
      fns.push_back([&] { for (auto [r0, n] : chunks) gemm_ex(g_blas, gemm(r0, n), 0.f); });
    }
    LtPlan pf = lt_plan(gemm(0, chunks[0].second), lt_algos);
    LtPlan pl = lt_plan(gemm(chunks.back().first, chunks.back().second), lt_algos);
    for (size_t i = 0; i < pf.algos.size(); ++i) {  // the full chunk's algorithm for the last chunk too
      names.push_back("Lt #" + std::to_string(i) + " [" + algo_name(pf.algos[i]) + "]");
      fns.push_back([&, i] {
        for (auto [r0, n] : chunks) lt_run(n == C ? pf : pl, gemm(r0, n), int(i), beta(r0), &pf);
      });
    }
    const size_t nv = fns.size();
    std::vector<std::vector<float>> t(nv);
    for (auto& f : fns) f();  // warm-up (first-call setup)
    for (int r = 0; r < rounds; ++r)
      for (size_t j = 0; j < nv; ++j) {
        const size_t v = (j + size_t(r)) % nv;
        t[v].push_back(once_ms(fns[v]));
      }
    std::vector<float> med(nv);
    for (size_t v = 0; v < nv; ++v) {
      std::sort(t[v].begin(), t[v].end());
      med[v] = t[v][t[v].size() / 2];
    }
    std::printf("\nchunks of %d rows (%zu chunks, last %d):\n| variant | ms (min..max) | TFLOP/s | of whole |\n"
                "|---|---|---|---|\n", C, chunks.size(), chunks.back().second);
    for (size_t v = 0; v < nv; ++v)
      std::printf("| %s | %.3f (%.3f..%.3f) | %.0f | %.1f%% |\n", names[v].c_str(), med[v], t[v].front(),
                  t[v].back(), flop / med[v] / 1e9, 100.0 * med[0] / med[v]);
    std::fflush(stdout);
  }
  return 0;
}


// --search: the heuristic's algorithms (no workspace, no split-K) varied in cluster shape, custom option and CTA
// swizzling, every variant cublasLtMatmulAlgoCheck accepts timed once over the chunks (40 s at most); the
// fastest TOP then timed in rotating rounds beside cublasGemmEx over the chunks and the
// heuristic's first algorithm. Configurations the heuristic never offers are how a tuning table can name one.
//
//     probe_lce_gemms --search logits|dhidden|dweight N H V C [TOP] [ROUNDS]
int search_mode(const std::string& which, int N, int H, int V, int C, int top, int rounds) {
  setvbuf(stdout, nullptr, _IOLBF, 0);
  const Operands o(N, H, V);
  const int kind = which == "logits" ? 0 : which == "dhidden" ? 1 : 2;
  CK(cublasCreate(&g_blas));
  CK(cublasSetMathMode(g_blas, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  CK(cublasSetWorkspace(g_blas, g_ws, kWs));
  CK(cublasLtCreate(&g_lt));
  auto gemm = [&](int r0, int rows) { return chunk_gemm(o, kind, H, V, r0, rows); };
  auto beta = [&](int r0) { return kind == 2 && r0 ? 1.f : 0.f; };
  std::vector<std::pair<int, int>> chunks;
  for (int r = 0; r < N; r += C) chunks.push_back({r, std::min(C, N - r)});
  setenv("PROBE_LIB", "1", 1);
  LtPlan pf = lt_plan(gemm(0, chunks[0].second), 24), pl = lt_plan(gemm(chunks.back().first, chunks.back().second), 24);
  // Seeds: the heuristic's algorithms (their tiles and stages are valid for the shape); each varied in its
  // cluster shape, custom option and CTA swizzling, kept where the check accepts it for both chunk shapes.
  std::vector<cublasLtMatmulHeuristicResult_t> cand;
  size_t checked = 0;
  for (const auto& seed : pf.algos)
    for (int cl : {-1, 2, 3, 4, 5, 6, 8})
      for (int opt = -1; opt < 8; ++opt)
        for (int swz : {0, 1}) {
          cublasLtMatmulHeuristicResult_t r = seed;
          const uint16_t cl16 = uint16_t(cl);
          if (cl >= 0 && cublasLtMatmulAlgoConfigSetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cl16,
                                                              sizeof cl16) != CUBLAS_STATUS_SUCCESS)
            continue;
          if (opt >= 0 && cublasLtMatmulAlgoConfigSetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &opt,
                                                               sizeof opt) != CUBLAS_STATUS_SUCCESS)
            continue;
          if (cublasLtMatmulAlgoConfigSetAttribute(&r.algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swz, sizeof swz) !=
              CUBLAS_STATUS_SUCCESS)
            continue;
          ++checked;
          cublasLtMatmulHeuristicResult_t res{}, res2{};
          const cublasStatus_t sf = cublasLtMatmulAlgoCheck(g_lt, pf.desc, pf.a, pf.b, pf.c, pf.c, &r.algo, &res);
          const cublasStatus_t sl = cublasLtMatmulAlgoCheck(g_lt, pl.desc, pl.a, pl.b, pl.c, pl.c, &r.algo, &res2);
          if (cl < 0 && opt < 0 && swz == 0)  // the seed itself (its swizzling set to 0)
            std::printf("seed [%s]: check %d / %d (full / last chunk), workspace %zu / %zu\n",
                        algo_name(seed).c_str(), int(sf), int(sl), res.workspaceSize, res2.workspaceSize);
          // The check reports 4 bytes for the dweight GEMM's heuristic algorithms, which run with none (the
          // library's calls); more than that is a workspace the library does not give.
          if (sf != CUBLAS_STATUS_SUCCESS || sl != CUBLAS_STATUS_SUCCESS || res.workspaceSize > 4 ||
              res2.workspaceSize > 4)
            continue;
          r.wavesCount = res.wavesCount;
          bool dup = false;
          for (const auto& c : cand) dup = dup || std::memcmp(&c.algo, &r.algo, sizeof r.algo) == 0;
          if (!dup) cand.push_back(r);
        }
  std::printf("%zu configurations checked, %zu accepted with no workspace\n", checked, cand.size());
  auto run_cfg = [&](const cublasLtMatmulHeuristicResult_t& r) {
    const float one = 1.f;
    for (auto [r0, n] : chunks) {
      const Gemm g = gemm(r0, n);
      const LtPlan& p = n == C ? pf : pl;
      const float b = beta(r0);
      if (cublasLtMatmul(g_lt, p.desc, &one, g.A, p.a, g.B, p.b, &b, g.C, p.c, g.C, p.c, &r.algo, nullptr, 0, 0) !=
          CUBLAS_STATUS_SUCCESS)
        return false;
    }
    return true;
  };
  // one timed pass each (after one untimed), fastest first
  std::vector<std::pair<float, size_t>> quick;
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < cand.size(); ++i) {
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(40)) {
      std::printf("quick pass stopped after 40 s, at %zu of %zu\n", i, cand.size());
      break;
    }
    if (!run_cfg(cand[i])) continue;
    if (cudaDeviceSynchronize() != cudaSuccess) {
      std::printf("config %zu failed at run time\n", i);
      return 1;
    }
    quick.push_back({once_ms([&] { run_cfg(cand[i]); }), i});
  }
  std::sort(quick.begin(), quick.end());
  std::vector<std::string> names{"GemmEx over the chunks", "heuristic's first [" + algo_name(pf.algos[0]) + "]"};
  std::vector<std::function<void()>> fns{
      [&] { for (auto [r0, n] : chunks) gemm_ex(g_blas, gemm(r0, n), beta(r0)); },
      [&] { run_cfg(pf.algos[0]); }};
  for (size_t k = 0; k < quick.size() && int(k) < top; ++k) {
    const size_t i = quick[k].second;
    names.push_back("[" + algo_name(cand[i]) + "] quick " + std::to_string(quick[k].first));
    fns.push_back([&, i] { run_cfg(cand[i]); });
  }
  const size_t nv = fns.size();
  std::vector<std::vector<float>> t(nv);
  for (int r = 0; r < rounds; ++r)
    for (size_t j = 0; j < nv; ++j) {
      const size_t v = (j + size_t(r)) % nv;
      t[v].push_back(once_ms(fns[v]));
    }
  const double flop = 2.0 * N * double(H) * V;
  std::printf("\n%s GEMMs, N=%d H=%d V=%d over chunks of %d rows; median of %d rounds\n| variant | ms (min..max) | "
              "TFLOP/s | of GemmEx |\n|---|---|---|---|\n", which.c_str(), N, H, V, C, rounds);
  print_rows(names, t, flop);
  return 0;
}


// Per token, the max and sum of exp over `cols` contiguous bf16 logits (a chunk's column of the col-major
// logits): what the cross-entropy forward reads. One block per token.
__global__ void row_stats(const __nv_bfloat16* x, int cols, int ld, float2* out) {
  const __nv_bfloat16* r = x + size_t(blockIdx.x) * ld;
  float m = -INFINITY, sum = 0.f;
  for (int j = threadIdx.x * 8; j < cols; j += blockDim.x * 8) {
    const uint4 v = *reinterpret_cast<const uint4*>(r + j);
    const __nv_bfloat16* e = reinterpret_cast<const __nv_bfloat16*>(&v);
    for (int k = 0; k < 8 && j + k < cols; ++k) {
      const float f = __bfloat162float(e[k]);
      if (f > m) {
        sum *= __expf(m - f);
        m = f;
      }
      sum += __expf(f - m);
    }
  }
  __shared__ float2 red[32];
  for (int o = 16; o; o >>= 1) {
    const float m2 = __shfl_xor_sync(~0u, m, o), s2 = __shfl_xor_sync(~0u, sum, o), mm = fmaxf(m, m2);
    sum = (m == -INFINITY ? 0.f : sum * __expf(m - mm)) + (m2 == -INFINITY ? 0.f : s2 * __expf(m2 - mm));
    m = mm;
  }
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = make_float2(m, sum);
  __syncthreads();
  if (threadIdx.x == 0) {
    float2 a = red[0];
    for (int w = 1; w < int(blockDim.x >> 5); ++w) {
      const float mm = fmaxf(a.x, red[w].x);
      a = make_float2(mm, a.y * __expf(a.x - mm) + red[w].y * __expf(red[w].x - mm));
    }
    out[blockIdx.x] = a;
  }
}

// --fwdblocks: the forward's logits GEMM of one C-row chunk, then the read of its logits for the loss's
// statistics (row_stats), whole (one GEMM, one read of 2 C V bytes from HBM) against vocabulary blocks of VB
// rows of the weight (a GEMM per block into a buffer small enough for L2, each read right after it is
// written), cuBLASLt's heuristic first algorithm. Every variant once per round, rotating, medians.
//
//     probe_lce_gemms --fwdblocks N H V C VB[,VB...] [ROUNDS]
int fwdblocks_mode(int N, int H, int V, int C, std::vector<int> vbs, int rounds) {
  const Operands o(N, H, V);
  CK(cublasLtCreate(&g_lt));
  setenv("PROBE_LIB", "1", 1);
  float2* stats;
  CK(cudaMalloc(&stats, size_t(C) * 64 * sizeof(float2)));
  auto logits_gemm = [&](int v0, int vn, int ld) {  // logits[v0 : v0 + vn] of every chunk token
    return Gemm{CUBLAS_OP_T, CUBLAS_OP_N, vn, C, H, o.w + size_t(v0) * H, H, o.hid, H, o.dl, CUDA_R_16BF, ld};
  };
  std::vector<std::string> names;
  std::vector<std::function<void()>> fns;
  std::vector<LtPlan> plans;
  plans.reserve(64);
  const int ldw = o.ldl;
  plans.push_back(lt_plan(logits_gemm(0, V, ldw), 8));
  const LtPlan* whole = &plans.back();
  names.push_back("whole chunk: GEMM alone");
  fns.push_back([&, whole] { lt_run(*whole, logits_gemm(0, V, ldw), 0, 0.f); });
  names.push_back("whole chunk: GEMM, then the read");
  fns.push_back([&, whole] {
    lt_run(*whole, logits_gemm(0, V, ldw), 0, 0.f);
    row_stats<<<C, 512>>>(o.dl, V, ldw, stats);
  });
  for (int vb : vbs) {
    const int ld = (vb + 127) / 128 * 128;
    std::vector<std::pair<int, int>> blocks;
    for (int v0 = 0; v0 < V; v0 += vb) blocks.push_back({v0, std::min(vb, V - v0)});
    const size_t first = plans.size();
    for (auto [v0, vn] : blocks) plans.push_back(lt_plan(logits_gemm(v0, vn, ld), 8));
    names.push_back("blocks of " + std::to_string(vb) + " (" + std::to_string(size_t(C) * ld * 2 >> 20) +
                    " MiB): GEMMs alone");
    fns.push_back([&, blocks, first, ld] {
      for (size_t b = 0; b < blocks.size(); ++b)
        lt_run(plans[first + b], logits_gemm(blocks[b].first, blocks[b].second, ld), 0, 0.f);
    });
    names.push_back("blocks of " + std::to_string(vb) + ": GEMM, read, GEMM, read...");
    fns.push_back([&, blocks, first, ld] {
      for (size_t b = 0; b < blocks.size(); ++b) {
        lt_run(plans[first + b], logits_gemm(blocks[b].first, blocks[b].second, ld), 0, 0.f);
        row_stats<<<C, 512>>>(o.dl, blocks[b].second, ld, stats + size_t(C) * (b % 64));
      }
    });
  }
  for (auto& f : fns) f();
  CK(cudaDeviceSynchronize());
  const size_t nv = fns.size();
  std::vector<std::vector<float>> t(nv);
  void* flush;
  CK(cudaMalloc(&flush, 256u << 20));
  for (int r = 0; r < rounds; ++r)
    for (size_t j = 0; j < nv; ++j) {
      const size_t v = (j + size_t(r)) % nv;
      CK(cudaMemsetAsync(flush, r, 256u << 20));
      t[v].push_back(once_ms(fns[v]));
    }
  const double flop = 2.0 * C * double(H) * V;
  std::printf("forward of one %d-token chunk, H=%d V=%d, %d rounds, medians\n| variant | ms (min..max) | TFLOP/s | of "
              "the whole GEMM alone |\n|---|---|---|---|\n", C, H, V, rounds);
  print_rows(names, t, flop);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc >= 7 && std::strcmp(argv[1], "--fwdblocks") == 0) {
    std::vector<int> vbs;
    for (char* t = std::strtok(argv[6], ","); t; t = std::strtok(nullptr, ",")) vbs.push_back(std::atoi(t));
    return fwdblocks_mode(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), vbs,
                          argc > 7 ? std::atoi(argv[7]) : 9);
  }
  if (argc >= 7 && std::strcmp(argv[1], "--search") == 0)
    return search_mode(argv[2], std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), std::atoi(argv[6]),
                       argc > 7 ? std::atoi(argv[7]) : 12, argc > 8 ? std::atoi(argv[8]) : 7);
  if (argc >= 7 && std::strcmp(argv[1], "--gemm") == 0) {
    std::vector<int> cs;
    for (char* t = std::strtok(argv[6], ","); t; t = std::strtok(nullptr, ",")) cs.push_back(std::atoi(t));
    return gemm_mode(argv[2], std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), cs,
                     argc > 7 ? std::atoi(argv[7]) : 8, argc > 8 ? std::atoi(argv[8]) : 9);
  }
  if (argc < 5) {
    std::fprintf(stderr, "usage: probe_lce_gemms N H V C[,C...] [LT_ALGOS]\n");
    return 2;
  }
  const int N = std::atoi(argv[1]), H = std::atoi(argv[2]), V = std::atoi(argv[3]);
  std::vector<int> cs;
  for (char* t = std::strtok(argv[4], ","); t; t = std::strtok(nullptr, ",")) cs.push_back(std::atoi(t));
  const int lt_algos = argc > 5 ? std::atoi(argv[5]) : 4;
  const Operands o(N, H, V);
  const int ldl = o.ldl;
  __nv_bfloat16 *hid = o.hid, *w = o.w, *dl = o.dl, *dh = o.dh, *dw = o.dw;
  float *dh32, *dw32;
  CK(cudaMalloc(&dh32, size_t(N) * H * 4));
  CK(cudaMalloc(&dw32, size_t(V) * H * 4));
  CK(cublasCreate(&g_blas));
  CK(cublasSetMathMode(g_blas, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
  CK(cublasCreate(&g_blas_free));
  CK(cublasLtCreate(&g_lt));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const double flop = 2.0 * N * double(H) * V;
  std::printf("%s, %d SMs; N=%d H=%d V=%d; ms summed over the chunks of N tokens (TFLOP/s)\n", prop.name,
              prop.multiProcessorCount, N, H, V);
  std::printf("| chunk | GEMM | GemmEx (library mode) | GemmEx (reduced allowed) | GemmEx fp32 out | cublasLt algos |\n");
  std::printf("|---|---|---|---|---|---|\n");
  cs.push_back(N);
  for (int C : cs) {
    std::vector<int> starts;
    for (int r = 0; r < N; r += C) starts.push_back(r);
    const int last = N - starts.back();
    auto chunk_gemm = [&](int which, int r0, void* out, cudaDataType ct) {
      const int rows = std::min(C, N - r0);
      const __nv_bfloat16* h = hid + size_t(r0) * H;
      if (which == 0) return Gemm{CUBLAS_OP_T, CUBLAS_OP_N, V, rows, H, w, H, h, H, dl, CUDA_R_16BF, ldl};
      if (which == 1)
        return Gemm{CUBLAS_OP_N, CUBLAS_OP_N, H, rows, V, w, H, dl, ldl,
                    static_cast<char*>(out) + size_t(r0) * H * (ct == CUDA_R_32F ? 4 : 2), ct, H};
      return Gemm{CUBLAS_OP_N, CUBLAS_OP_T, H, V, rows, h, H, dl, ldl, out, ct, H};
    };
    const char* names[3] = {"logits", "dhidden", "dweight +="};
    for (int which = 0; which < 3; ++which) {
      void* o16 = which == 1 ? static_cast<void*>(dh) : static_cast<void*>(dw);
      void* o32 = which == 1 ? static_cast<void*>(dh32) : static_cast<void*>(dw32);
      auto all = [&](cublasHandle_t b, void* out, cudaDataType ct) {
        return median_ms([&] {
          for (int r0 : starts) gemm_ex(b, chunk_gemm(which, r0, out, ct), which == 2 && r0 > 0 ? 1.f : 0.f);
        });
      };
      const float a = all(g_blas, o16, CUDA_R_16BF), b = all(g_blas_free, o16, CUDA_R_16BF);
      const float c = which == 0 ? 0.f : all(g_blas, o32, CUDA_R_32F);
      std::string lt;
      // cublasLt: the full chunk's plan and the last chunk's, algorithm i of each heuristic list
      LtPlan pf = lt_plan(chunk_gemm(which, 0, o16, CUDA_R_16BF), lt_algos);
      LtPlan pl = lt_plan(chunk_gemm(which, starts.back(), o16, CUDA_R_16BF), lt_algos);
      for (size_t i = 0; i < std::min(pf.algos.size(), pl.algos.size()); ++i) {
        const float m = median_ms([&] {
          for (int r0 : starts) {
            const bool is_last = r0 == starts.back() && last != C;
            lt_run(is_last ? pl : pf, chunk_gemm(which, r0, o16, CUDA_R_16BF), int(i), which == 2 && r0 > 0 ? 1.f : 0.f);
          }
        });
        char s[256];
        std::snprintf(s, sizeof s, "%s#%zu %.3f (%.0f) [%s]", i ? "; " : "", i, m, flop / m / 1e9,
                      algo_name(pf.algos[i]).c_str());
        lt += s;
      }
      std::printf("| %d%s | %s | %.3f (%.0f) | %.3f (%.0f) | %.3f | %s |\n", C,
                  last != C ? (" + last " + std::to_string(last)).c_str() : "", names[which], a, flop / a / 1e9, b,
                  flop / b / 1e9, c, lt.c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}
