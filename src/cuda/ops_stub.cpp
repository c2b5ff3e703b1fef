// CUDA linear cross-entropy, not implemented yet: a clear status until their kernels land.
#include "common/error.hpp"
#include "common/handle.hpp"

namespace fce::cuda {

size_t linear_ce_workspace(fce_handle*, const LinearCeProblem&, bool) { return 0; }
void linear_ce(fce_handle*, fce_stream_t, const LinearCeProblem&, Workspace) {
  raise(FCE_STATUS_NOT_IMPLEMENTED, "the CUDA backend of linear_ce is not implemented yet");
}

}  // namespace fce::cuda
