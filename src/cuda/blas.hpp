// cuBLAS and cuBLASLt, loaded at run time on the first linear cross-entropy call: processes that never run
// it (CPU users, the other ops) do not pay cuBLAS's load time and memory.
#pragma once
#include <cublasLt.h>
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

// The cuBLASLt calls of gemm() below (all null where libcublasLt lacks one: gemm() then uses cublasGemmEx).
struct CublasLtApi {
  cublasStatus_t (*create)(cublasLtHandle_t*);
  cublasStatus_t (*destroy)(cublasLtHandle_t);
  cublasStatus_t (*desc_create)(cublasLtMatmulDesc_t*, cublasComputeType_t, cudaDataType_t);
  cublasStatus_t (*desc_destroy)(cublasLtMatmulDesc_t);
  cublasStatus_t (*desc_set)(cublasLtMatmulDesc_t, cublasLtMatmulDescAttributes_t, const void*, size_t);
  cublasStatus_t (*layout_create)(cublasLtMatrixLayout_t*, cudaDataType, uint64_t, uint64_t, int64_t);
  cublasStatus_t (*layout_destroy)(cublasLtMatrixLayout_t);
  cublasStatus_t (*pref_create)(cublasLtMatmulPreference_t*);
  cublasStatus_t (*pref_destroy)(cublasLtMatmulPreference_t);
  cublasStatus_t (*pref_set)(cublasLtMatmulPreference_t, cublasLtMatmulPreferenceAttributes_t, const void*, size_t);
  cublasStatus_t (*heuristic)(cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
                              cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, int,
                              cublasLtMatmulHeuristicResult_t[], int*);
  cublasStatus_t (*algo_get)(const cublasLtMatmulAlgo_t*, cublasLtMatmulAlgoConfigAttributes_t, void*, size_t,
                             size_t*);
  cublasStatus_t (*matmul)(cublasLtHandle_t, cublasLtMatmulDesc_t, const void*, const void*, cublasLtMatrixLayout_t,
                           const void*, cublasLtMatrixLayout_t, const void*, const void*, cublasLtMatrixLayout_t,
                           void*, cublasLtMatrixLayout_t, const cublasLtMatmulAlgo_t*, void*, size_t, cudaStream_t);
};

// The loaded API (throws BLAS_ERROR with the loader's message when cuBLAS cannot be loaded).
const CublasApi& cublas();
// cuBLASLt's (every member null when it cannot be loaded); load cuBLAS first.
const CublasLtApi& cublas_lt();
// The handle's cuBLAS handle, created on first use and bound to `stream`. Its math mode disallows split-K
// reductions in a 16-bit output type (CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION): without it cuBLAS may
// sum a bf16 GEMM's partial products in bf16, rounding the gradient more than once.
cublasHandle_t cublas_handle(fce_handle* h, cudaStream_t stream);
void cublas_release(fce_handle* h);
void check_blas(cublasStatus_t s, const char* what);

// One column-major GEMM, D = op(A) op(B) + beta D, alpha 1, fp32 compute; A and B of type `ab`.
struct GemmArgs {
  cublasOperation_t ta, tb;
  int m, n, k;
  const void* A;
  int lda;
  const void* B;
  int ldb;
  cudaDataType ab;
  void* D;
  int ldd;
  cudaDataType dt;
  float beta;
};

// The tiles a GEMM prefers among cuBLASLt's heuristic algorithms, by what it is in linear cross-entropy.
enum class GemmRole { Logits, DWeight };

// Runs `g` on `stream` through cuBLASLt with the first of its heuristic algorithms (no split-K, no workspace)
// whose tile the role prefers on this device (Tuning's lce_* tiles, plan.cpp), else the heuristic's first;
// the choice is cached in the handle per shape, strides and alignments. cublasGemmEx where cuBLASLt has no
// algorithm or is forced (FCE_FORCE_PATH=lce_gemm:gemmex). Why the tiles: docs/lab-notes.md.
void gemm(fce_handle* h, cudaStream_t stream, const GemmArgs& g, GemmRole role, const char* what);

}  // namespace fce::cuda
