// CUDA backend of softmax (placeholder until its kernels land).
#include "cuda/common.cuh"

namespace fce::cuda {

size_t softmax_workspace(fce_handle*, const SoftmaxProblem&) { return 0; }
void softmax(fce_handle*, fce_stream_t, const SoftmaxProblem&, Workspace) {
  raise(FCE_STATUS_NOT_IMPLEMENTED, "the CUDA backend of softmax is not implemented yet");
}

}  // namespace fce::cuda
