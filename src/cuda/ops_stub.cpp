// CUDA ops not implemented yet: a clear status until their kernels land.
#include "common/error.hpp"
#include "common/handle.hpp"

namespace fce::cuda {

#define FCE_CUDA_TODO(name, Problem)                                                        \
  size_t name##_workspace(fce_handle*, const Problem&) { return 0; }                       \
  void name(fce_handle*, fce_stream_t, const Problem&, Workspace) {                        \
    raise(FCE_STATUS_NOT_IMPLEMENTED, "the CUDA backend of " #name " is not implemented yet"); \
  }
FCE_CUDA_TODO(ce, CeProblem)
FCE_CUDA_TODO(lse, LseProblem)
FCE_CUDA_TODO(softmax, SoftmaxProblem)
FCE_CUDA_TODO(kd, KdProblem)
size_t linear_ce_workspace(fce_handle*, const LinearCeProblem&, bool) { return 0; }
void linear_ce(fce_handle*, fce_stream_t, const LinearCeProblem&, Workspace) {
  raise(FCE_STATUS_NOT_IMPLEMENTED, "the CUDA backend of linear_ce is not implemented yet");
}

}  // namespace fce::cuda
