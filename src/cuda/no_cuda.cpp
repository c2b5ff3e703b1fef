// Built when the CUDA backend is disabled: CUDA handles cannot be created.
#include "common/comm.hpp"
#include "common/error.hpp"
#include "common/handle.hpp"

namespace fce::cuda {

void create_device(fce_handle*, int) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
void destroy_device(fce_handle*) {}
void* workspace_alloc(fce_handle*, size_t, fce_stream_t) { raise(FCE_STATUS_NO_DEVICE, "built without CUDA"); }
void workspace_free(fce_handle*, void*, fce_stream_t) {}
void build_versions(int* cudart, int* cublas) { *cudart = *cublas = 0; }

#define FCE_NO_CUDA_OP(name, Problem)                                                        \
  size_t name##_workspace(fce_handle*, const Problem&) { return 0; }                        \
  void name(fce_handle*, fce_stream_t, const Problem&, Workspace) {                         \
    raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");      \
  }
FCE_NO_CUDA_OP(ce, CeProblem)
FCE_NO_CUDA_OP(lse, LseProblem)
FCE_NO_CUDA_OP(softmax, SoftmaxProblem)
FCE_NO_CUDA_OP(kd, KdProblem)
FCE_NO_CUDA_OP(kd_combine, KdCombineProblem)
FCE_NO_CUDA_OP(kd_bwd, KdBwdProblem)
void lse_partial(fce_handle*, fce_stream_t, const LsePartialProblem&) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
void lse_combine(fce_handle*, fce_stream_t, const LseCombineProblem&) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
void softmax_shard(fce_handle*, fce_stream_t, const SoftmaxProblem&) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
void kd_partial(fce_handle*, fce_stream_t, const KdPartialProblem&) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
void kd_terms_partial(fce_handle*, fce_stream_t, const KdTermsPartialProblem&) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
size_t linear_ce_workspace(fce_handle*, const LinearCeProblem&, bool) { return 0; }
size_t ce_combine_workspace(fce_handle*, const CeCombineProblem&) { return 0; }
void ce_partial(fce_handle*, fce_stream_t, const CePartialProblem&) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
void ce_combine(fce_handle*, fce_stream_t, const CeCombineProblem&, Workspace) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
void scale_rows(fce_handle*, fce_stream_t, const ScaleProblem&) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
void linear_ce(fce_handle*, fce_stream_t, const LinearCeProblem&, Workspace) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}

void comm_init(fce_comm*, struct ncclComm*) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
void comm_all_gather(const fce_comm*, fce_stream_t, const void*, void*, size_t) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
void comm_all_reduce_sum(const fce_comm*, fce_stream_t, void*, size_t) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}
size_t linear_ce_vp_workspace(fce_handle*, const LinearCeProblem&, int64_t, bool) { return 0; }
void linear_ce_vp(fce_handle*, const fce_comm*, fce_stream_t, const LinearCeProblem&, Workspace) {
  raise(FCE_STATUS_NO_DEVICE, "this libfusedce was built without the CUDA backend");
}

}  // namespace fce::cuda
