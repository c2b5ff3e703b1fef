// CUDA backend of kd (placeholder until its kernels land).
#include "cuda/common.cuh"

namespace fce::cuda {

size_t kd_workspace(fce_handle*, const KdProblem&) { return 0; }
void kd(fce_handle*, fce_stream_t, const KdProblem&, Workspace) {
  raise(FCE_STATUS_NOT_IMPLEMENTED, "the CUDA backend of kd is not implemented yet");
}

}  // namespace fce::cuda
