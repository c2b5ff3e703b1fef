#include "cuda/blas.hpp"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdint>
#include <initializer_list>
#include <mutex>
#include <vector>

#include "common/error.hpp"
#include "common/force_path.hpp"
#include "cuda/plan.hpp"

namespace fce::cuda {

namespace {

template <class F>
void bind(void* lib, F*& fn, const char* name) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
  FCE_CHECK(fn != nullptr, FCE_STATUS_BLAS_ERROR, "cuBLAS has no symbol %s", name);
}

template <class F>
void bind_opt(void* lib, F*& fn, const char* name) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
}

// One cached cuBLASLt plan: the GEMM's shape, strides, types and alignments, its descriptors and algorithm.
struct LtPlan {
  cublasOperation_t ta, tb;
  int m, n, k, lda, ldb, ldd;
  cudaDataType ab, dt;
  uint32_t align[3];
  GemmRole role;
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool usable = false;  // false: cuBLASLt offered no algorithm, use cublasGemmEx
};

// What a handle's `blas` points to.
struct BlasState {
  cublasHandle_t blas = nullptr;
  cublasLtHandle_t lt = nullptr;
  std::vector<LtPlan> plans;
};

BlasState* state(fce_handle* h) {
  if (!h->blas) h->blas = new BlasState;
  return static_cast<BlasState*>(h->blas);
}

uint32_t alignment(const void* p) {  // the largest power of two up to 256 dividing the address
  const auto a = reinterpret_cast<uintptr_t>(p);
  return a == 0 ? 256u : uint32_t(std::min<uintptr_t>(a & (~a + 1), 256));
}

// plan.cpp holds cuBLASLt's tile ids as plain numbers (it is built without CUDA's headers).
static_assert(CUBLASLT_MATMUL_TILE_176x128 == 201 && CUBLASLT_MATMUL_TILE_168x128 == 197 &&
                  CUBLASLT_MATMUL_TILE_128x160 == 29,
              "cuBLASLt's tile ids moved: update kTunings in plan.cpp");

// Whether the architecture's tuning (plan.cpp) names this tile for the role.
bool preferred(int arch, GemmRole role, int tile) {
  const Tuning& t = tuning_for(arch);
  if (tile == 0) return false;
  if (role == GemmRole::Logits) return tile == t.lce_logits_tiles[0] || tile == t.lce_logits_tiles[1];
  return tile == t.lce_dweight_tile;
}

// The first of `names` that dlopen finds, or null.
void* open_first(std::initializer_list<const char*> names) {
  for (const char* name : names)
    if (void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL)) return lib;
  return nullptr;
}

}  // namespace

const CublasLtApi& cublas_lt() {
  static CublasLtApi api{};
  static std::once_flag once;
  std::call_once(once, [] {
    // libcublas links libcublasLt: loading cuBLAS first makes this find the same library.
    void* lib = open_first({"libcublasLt.so.13", "libcublasLt.so"});
    if (!lib) return;
    bind_opt(lib, api.create, "cublasLtCreate");
    bind_opt(lib, api.destroy, "cublasLtDestroy");
    bind_opt(lib, api.desc_create, "cublasLtMatmulDescCreate");
    bind_opt(lib, api.desc_destroy, "cublasLtMatmulDescDestroy");
    bind_opt(lib, api.desc_set, "cublasLtMatmulDescSetAttribute");
    bind_opt(lib, api.layout_create, "cublasLtMatrixLayoutCreate");
    bind_opt(lib, api.layout_destroy, "cublasLtMatrixLayoutDestroy");
    bind_opt(lib, api.pref_create, "cublasLtMatmulPreferenceCreate");
    bind_opt(lib, api.pref_destroy, "cublasLtMatmulPreferenceDestroy");
    bind_opt(lib, api.pref_set, "cublasLtMatmulPreferenceSetAttribute");
    bind_opt(lib, api.heuristic, "cublasLtMatmulAlgoGetHeuristic");
    bind_opt(lib, api.algo_get, "cublasLtMatmulAlgoConfigGetAttribute");
    bind_opt(lib, api.matmul, "cublasLtMatmul");
    const bool all = api.create && api.destroy && api.desc_create && api.desc_destroy && api.desc_set &&
                     api.layout_create && api.layout_destroy && api.pref_create && api.pref_destroy && api.pref_set &&
                     api.heuristic && api.algo_get && api.matmul;
    if (!all) api = CublasLtApi{};
  });
  return api;
}

const CublasApi& cublas() {
  static CublasApi api{};
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    void* lib = open_first({"libcublas.so.13", "libcublas.so"});
    if (!lib) {
      const char* e = dlerror();
      error = e ? e : "dlopen failed";
      return;
    }
    try {
      bind(lib, api.create, "cublasCreate_v2");
      bind(lib, api.destroy, "cublasDestroy_v2");
      bind(lib, api.set_stream, "cublasSetStream_v2");
      bind(lib, api.set_math_mode, "cublasSetMathMode");
      bind(lib, api.gemm_ex, "cublasGemmEx");
    } catch (const Error& e) {
      error = e.message;
      api = CublasApi{};
    }
  });
  FCE_CHECK(api.gemm_ex != nullptr, FCE_STATUS_BLAS_ERROR, "cannot load cuBLAS (libcublas.so.13): %s", error.c_str());
  return api;
}

void check_blas(cublasStatus_t s, const char* what) {
  FCE_CHECK(s == CUBLAS_STATUS_SUCCESS, FCE_STATUS_BLAS_ERROR, "%s failed with cuBLAS status %d", what, int(s));
}

cublasHandle_t cublas_handle(fce_handle* h, cudaStream_t stream) {
  const CublasApi& api = cublas();
  BlasState* st = state(h);
  if (!st->blas) {
    cublasHandle_t b = nullptr;
    check_blas(api.create(&b), "cublasCreate");
    const cublasStatus_t m =
        api.set_math_mode(b, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    if (m != CUBLAS_STATUS_SUCCESS) api.destroy(b);
    check_blas(m, "cublasSetMathMode");
    st->blas = b;
  }
  check_blas(api.set_stream(st->blas, stream), "cublasSetStream");
  return st->blas;
}

namespace {

void destroy_plan(const CublasLtApi& lt, LtPlan& p) {
  if (p.desc) lt.desc_destroy(p.desc);
  for (cublasLtMatrixLayout_t l : {p.a, p.b, p.d})
    if (l) lt.layout_destroy(l);
  p.desc = nullptr;
  p.a = p.b = p.d = nullptr;
}

// The cached plan for `g` (made on first use: descriptors and cuBLASLt's heuristic answer).
const LtPlan& lt_plan(fce_handle* h, BlasState* st, const CublasLtApi& lt, const GemmArgs& g, GemmRole role) {
  const uint32_t al[3] = {alignment(g.A), alignment(g.B), alignment(g.D)};
  for (const LtPlan& p : st->plans)
    if (p.ta == g.ta && p.tb == g.tb && p.m == g.m && p.n == g.n && p.k == g.k && p.lda == g.lda &&
        p.ldb == g.ldb && p.ldd == g.ldd && p.ab == g.ab && p.dt == g.dt && p.align[0] == al[0] &&
        p.align[1] == al[1] && p.align[2] == al[2] && p.role == role)
      return p;
  if (st->plans.size() >= 64) {  // a bound on what a handle keeps (shapes that vary call after call)
    for (LtPlan& q : st->plans) destroy_plan(lt, q);
    st->plans.clear();
  }
  LtPlan p{g.ta, g.tb, g.m, g.n, g.k, g.lda, g.ldb, g.ldd, g.ab, g.dt, {al[0], al[1], al[2]}, role};
  auto fail = [&](cublasStatus_t s, const char* what) {
    if (s == CUBLAS_STATUS_SUCCESS) return;
    destroy_plan(lt, p);
    check_blas(s, what);
  };
  if (!st->lt) check_blas(lt.create(&st->lt), "cublasLtCreate");
  fail(lt.desc_create(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), "cublasLtMatmulDescCreate");
  fail(lt.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &g.ta, sizeof g.ta), "cublasLtMatmulDescSetAttribute");
  fail(lt.desc_set(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &g.tb, sizeof g.tb), "cublasLtMatmulDescSetAttribute");
  const bool at = g.ta == CUBLAS_OP_T, bt = g.tb == CUBLAS_OP_T;
  fail(lt.layout_create(&p.a, g.ab, uint64_t(at ? g.k : g.m), uint64_t(at ? g.m : g.k), g.lda),
       "cublasLtMatrixLayoutCreate");
  fail(lt.layout_create(&p.b, g.ab, uint64_t(bt ? g.n : g.k), uint64_t(bt ? g.k : g.n), g.ldb),
       "cublasLtMatrixLayoutCreate");
  fail(lt.layout_create(&p.d, g.dt, uint64_t(g.m), uint64_t(g.n), g.ldd), "cublasLtMatrixLayoutCreate");
  cublasLtMatmulPreference_t pref = nullptr;
  fail(lt.pref_create(&pref), "cublasLtMatmulPreferenceCreate");
  // No workspace and no split-K: every output element is one fp32 sum over K, rounded once, in a fixed order.
  const size_t no_ws = 0;
  const uint32_t scheme = CUBLASLT_REDUCTION_SCHEME_NONE;
  cublasStatus_t s = lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &no_ws, sizeof no_ws);
  if (s == CUBLAS_STATUS_SUCCESS) s = lt.pref_set(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &scheme, sizeof scheme);
  const cublasLtMatmulPreferenceAttributes_t align_attr[4] = {
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
      CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
  for (int i = 0; i < 4 && s == CUBLAS_STATUS_SUCCESS; ++i)
    s = lt.pref_set(pref, align_attr[i], &al[i < 2 ? i : 2], sizeof(uint32_t));
  cublasLtMatmulHeuristicResult_t res[24];
  int got = 0;
  if (s == CUBLAS_STATUS_SUCCESS) s = lt.heuristic(st->lt, p.desc, p.a, p.b, p.d, p.d, pref, 24, res, &got);
  lt.pref_destroy(pref);
  // NOT_SUPPORTED: no algorithm for this problem (cublasGemmEx runs it).
  if (s != CUBLAS_STATUS_NOT_SUPPORTED) fail(s, "cublasLtMatmulAlgoGetHeuristic");
  int pick = -1;
  for (int i = 0; i < got; ++i) {
    if (res[i].state != CUBLAS_STATUS_SUCCESS) continue;
    int tile = 0;
    size_t n = 0;
    if (pick < 0) pick = i;
    if (lt.algo_get(&res[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile, &n) == CUBLAS_STATUS_SUCCESS &&
        preferred(h->caps.arch, role, tile)) {
      pick = i;
      break;
    }
  }
  if (pick >= 0) {
    p.algo = res[pick].algo;
    p.usable = true;
  }
  st->plans.push_back(p);
  return st->plans.back();
}

}  // namespace

void gemm(fce_handle* h, cudaStream_t stream, const GemmArgs& g, GemmRole role, const char* what) {
  static const char* const kPaths[] = {"lt", "gemmex"};
  const CublasApi& api = cublas();
  const CublasLtApi& lt = cublas_lt();
  const float one = 1.f;
  if (lt.matmul && forced_path("lce_gemm", kPaths) != 1) {
    BlasState* st = state(h);
    const LtPlan& p = lt_plan(h, st, lt, g, role);
    if (p.usable) {
      check_blas(lt.matmul(st->lt, p.desc, &one, g.A, p.a, g.B, p.b, &g.beta, g.D, p.d, g.D, p.d, &p.algo, nullptr,
                           0, stream),
                 what);
      return;
    }
  }
  check_blas(api.gemm_ex(cublas_handle(h, stream), g.ta, g.tb, g.m, g.n, g.k, &one, g.A, g.ab, g.lda, g.B, g.ab,
                         g.ldb, &g.beta, g.D, g.dt, g.ldd, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
             what);
}

void build_versions(int* cudart, int* cublas) {
  *cudart = CUDART_VERSION;
  *cublas = CUBLAS_VERSION;
}

void cublas_release(fce_handle* h) {
  auto* st = static_cast<BlasState*>(h->blas);
  if (!st) return;
  const CublasLtApi& lt = cublas_lt();
  for (LtPlan& p : st->plans) destroy_plan(lt, p);
  if (st->lt) lt.destroy(st->lt);
  if (st->blas) cublas().destroy(st->blas);
  delete st;
  h->blas = nullptr;
}

}  // namespace fce::cuda
