// Vocabulary-parallel cross-entropy in NCCL mode (the header's "NCCL mode"): a borrowed communicator, and
// one call that runs the partial, the all-gather of the records on the caller's stream, the combine and the
// shard's gradient, with no host synchronization.
#include <memory>

#include "common/api_util.hpp"
#include "common/comm.hpp"

using namespace fce;

namespace {

// A validated NCCL-mode call: its three steps and where each keeps its data in the workspace.
struct VpCall {
  CePartialProblem part;  // records point into the workspace
  CeCombineProblem comb;  // records: the gathered [W * N, K]
  CeProblem bwd;          // the shard's dlogits from the combined lse (no dlogits: no gradient)
  size_t gathered = 0, lse = 0, ent = 0, comb_ws = 0, bwd_ws = 0, bytes = 0;  // workspace offsets and size
  int64_t K = kCeRecordFields;  // the record's width: only the fields the outputs need cross the wire
};

VpCall vp_call(fce_handle* h, const fce_comm* c, const DLTensor* logits, const DLTensor* targets,
               const fce_ce_options_t* options, const fce_ce_outputs_t* outputs) {
  Validator val(h->backend, h->device_id);
  VpCall v;
  CePartialProblem& p = v.part;
  p.logits = val.matrix(logits, "logits", kFloats);
  val.input("logits", p.logits.data, Validator::span(p.logits));
  const int64_t N = p.logits.rows, V = p.logits.cols, W = c->size;
  p.targets = read_targets(val, targets, "targets", N);
  p.o = sharded_options(val, options, V, "fce_cross_entropy_fwd_vp");
  const fce_ce_outputs_t out = checked_struct(outputs, "outputs");
  CeStatOutputs s = read_ce_stat_outputs(val, p.o.reduction, N, out.loss, out.lse, out.z_loss, out.argmax,
                                         out.entropy, true);
  v.comb.W = W;
  v.comb.targets = p.targets;
  v.comb.o = p.o;
  take_stat_outputs(v.comb, s);
  if (out.dlogits) {
    v.bwd.logits = p.logits;
    v.bwd.targets = p.targets;
    v.bwd.o = p.o;
    read_fused_dlogits(val, out, v.bwd);
  } else {
    FCE_CHECK(!out.grad_loss && !out.grad_entropy, FCE_STATUS_INVALID_ARGUMENT,
              "outputs->%s is set without outputs->dlogits", out.grad_loss ? "grad_loss" : "grad_entropy");
  }
  v.K = out.argmax                               ? kCeRecordFields
        : out.entropy || (v.bwd.dlogits && v.bwd.grad_entropy) ? kCeRecordEntropy
                                                               : kCeRecordLoss;
  // Workspace: this rank's records, every rank's records, the lse when the caller does not keep it and the
  // gradient needs it, then the combine's and the backward's own workspaces.
  size_t all = 0;
  v.gathered = vp_records_bytes(N, v.K, W, &all);
  size_t at = v.gathered + all;
  v.lse = at;  // the rows' pairs for the gradient (LsePair: p_j from max-shifted values)
  if (v.bwd.dlogits && !(v.comb.lse && v.comb.lse.pair)) at += vp_align(size_t(N) * 8);
  v.ent = at;  // the entropy, for the entropy's gradient, when the caller does not keep it
  if (v.bwd.grad_entropy && !v.comb.entropy) at += vp_align(size_t(N) * 4);
  v.comb_ws = at;
  at += vp_align(cuda::ce_combine_workspace(h, v.comb));
  v.bwd_ws = at;
  if (v.bwd.dlogits) {
    CeProblem sizing = v.bwd;
    sizing.saved_lse.data = reinterpret_cast<char*>(&v);  // any non-null pointer: the size of a backward
    sizing.saved_lse.n = N;
    sizing.saved_lse.pair = true;
    if (sizing.grad_entropy) {
      sizing.saved_entropy = sizing.saved_lse;
      sizing.saved_entropy.pair = false;
    }
    at += vp_align(cuda::ce_workspace(h, sizing));
  }
  v.bytes = at;
  return v;
}

// Points the steps at the workspace.
void place(VpCall& v, const Workspace& w) {
  char* base = static_cast<char*>(w.ptr);
  const int64_t N = v.part.logits.rows;
  v.part.records = Mat{base, DType::F32, N, v.K, v.K};
  v.comb.records = Mat{base + v.gathered, DType::F32, v.comb.W * N, v.K, v.K};
  if (v.bwd.dlogits) {
    if (v.comb.lse && v.comb.lse.pair) {
      v.bwd.saved_lse = v.comb.lse;
    } else {
      v.comb.pair = Vec{base + v.lse, DType::F32, N, false, true};
      v.bwd.saved_lse = v.comb.pair;
    }
  }
  if (v.bwd.grad_entropy) {
    v.bwd.saved_entropy = v.comb.entropy ? v.comb.entropy : Vec{base + v.ent, DType::F32, N, false};
    if (!v.comb.entropy) v.comb.entropy = v.bwd.saved_entropy;
  }
}

fce_comm* check_comm(fce_comm_t comm) {
  FCE_CHECK(comm != nullptr, FCE_STATUS_INVALID_ARGUMENT, "comm is NULL");
  return comm;
}

}  // namespace

extern "C" {

FCE_API fce_status_t fce_comm_create(fce_handle_t handle, struct ncclComm* nccl_comm, fce_comm_t* out) {
  return guard(__func__, [&] {
    FCE_CHECK(out != nullptr, FCE_STATUS_INVALID_ARGUMENT, "out is NULL");
    *out = nullptr;
    fce_handle* h = check_handle(handle);
    FCE_CHECK(nccl_comm != nullptr, FCE_STATUS_INVALID_ARGUMENT, "nccl_comm is NULL");
    FCE_CHECK(h->backend == Backend::CUDA, FCE_STATUS_INVALID_ARGUMENT,
              "NCCL mode needs a CUDA handle (this handle is on the CPU)");
    auto c = std::make_unique<fce_comm>();
    cuda::comm_init(c.get(), nccl_comm);
    FCE_CHECK(c->device == h->device_id, FCE_STATUS_DEVICE_MISMATCH,
              "the NCCL communicator is on device %d, the handle on device %d", c->device, h->device_id);
    *out = c.release();
  });
}

FCE_API fce_status_t fce_comm_destroy(fce_comm_t comm) {
  return guard(__func__, [&] { delete comm; });
}

FCE_API fce_status_t fce_comm_info(fce_comm_t comm, int32_t* rank, int32_t* size) {
  return guard(__func__, [&] {
    const fce_comm* c = check_comm(comm);
    FCE_CHECK(rank != nullptr || size != nullptr, FCE_STATUS_INVALID_ARGUMENT, "rank and size are both NULL");
    if (rank) *rank = c->rank;
    if (size) *size = c->size;
  });
}

FCE_API fce_status_t fce_cross_entropy_fwd_vp(fce_handle_t handle, fce_comm_t comm, fce_stream_t stream,
                                              const DLTensor* logits, const DLTensor* targets,
                                              const fce_ce_options_t* options, const fce_ce_outputs_t* outputs,
                                              void* workspace, size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_comm* c = checked_comm(h, comm);
    VpCall v = vp_call(h, c, logits, targets, options, outputs);
    const Workspace w = resolve_workspace(h, workspace, workspace_bytes, v.bytes, stream);
    place(v, w);
    cuda::ce_partial(h, stream, v.part);
    cuda::comm_all_gather(c, stream, v.part.records.data, v.comb.records.data,
                          size_t(v.part.logits.rows) * size_t(v.K));
    char* base = static_cast<char*>(w.ptr);
    cuda::ce_combine(h, stream, v.comb, Workspace{base + v.comb_ws, v.bwd_ws - v.comb_ws});
    if (v.bwd.dlogits) cuda::ce(h, stream, v.bwd, Workspace{base + v.bwd_ws, v.bytes - v.bwd_ws});
  });
}

FCE_API fce_status_t fce_cross_entropy_fwd_vp_workspace_size(fce_handle_t handle, fce_comm_t comm,
                                                             const DLTensor* logits, const DLTensor* targets,
                                                             const fce_ce_options_t* options,
                                                             const fce_ce_outputs_t* outputs, size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_comm* c = checked_comm(h, comm);
    write_size(bytes, vp_call(h, c, logits, targets, options, outputs).bytes);
  });
}

}  // extern "C"
