// cuBLAS, loaded at run time on the first linear cross-entropy call: processes that never run it (CPU
// users, the other ops) do not pay cuBLAS's load time and memory.
#pragma once
#include <cublas_api.h>

#include "common/handle.hpp"

namespace fce::cuda {

struct CublasApi {
  cublasStatus_t (*create)(cublasHandle_t*);
  cublasStatus_t (*destroy)(cublasHandle_t);
  cublasStatus_t (*set_stream)(cublasHandle_t, cudaStream_t);
  cublasStatus_t (*set_math_mode)(cublasHandle_t, cublasMath_t);
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
};

// The loaded API (throws BLAS_ERROR with the loader's message when cuBLAS cannot be loaded).
const CublasApi& cublas();
// The handle's cuBLAS handle, created on first use and bound to `stream`. Its math mode disallows split-K
// reductions in a 16-bit output type (CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION): without it cuBLAS may
// sum a bf16 GEMM's partial products in bf16, rounding the gradient more than once.
cublasHandle_t cublas_handle(fce_handle* h, cudaStream_t stream);
void cublas_release(fce_handle* h);
void check_blas(cublasStatus_t s, const char* what);

}  // namespace fce::cuda
