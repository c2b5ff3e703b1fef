#include "cuda/blas.hpp"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <mutex>

#include "common/error.hpp"

namespace fce::cuda {

namespace {

template <class F>
void bind(void* lib, F*& fn, const char* name) {
  fn = reinterpret_cast<F*>(dlsym(lib, name));
  FCE_CHECK(fn != nullptr, FCE_STATUS_BLAS_ERROR, "cuBLAS has no symbol %s", name);
}

}  // namespace

const CublasApi& cublas() {
  static CublasApi api{};
  static std::once_flag once;
  static std::string error;
  std::call_once(once, [] {
    void* lib = nullptr;
    for (const char* name : {"libcublas.so.13", "libcublas.so"}) {
      lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (lib) break;
    }
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
  if (!h->blas) {
    cublasHandle_t b = nullptr;
    check_blas(api.create(&b), "cublasCreate");
    const cublasStatus_t m =
        api.set_math_mode(b, cublasMath_t(CUBLAS_DEFAULT_MATH | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
    if (m != CUBLAS_STATUS_SUCCESS) api.destroy(b);
    check_blas(m, "cublasSetMathMode");
    h->blas = b;
  }
  cublasHandle_t b = static_cast<cublasHandle_t>(h->blas);
  check_blas(api.set_stream(b, stream), "cublasSetStream");
  return b;
}

void build_versions(int* cudart, int* cublas) {
  *cudart = CUDART_VERSION;
  *cublas = CUBLAS_VERSION;
}

void cublas_release(fce_handle* h) {
  if (h->blas) cublas().destroy(static_cast<cublasHandle_t>(h->blas));
  h->blas = nullptr;
}

}  // namespace fce::cuda
