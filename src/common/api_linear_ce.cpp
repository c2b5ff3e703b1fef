#include "common/api_util.hpp"
#include "common/comm.hpp"

using namespace fce;

namespace {

Mat grad_output(Validator& val, DLTensor* t, const char* name, int64_t rows, int64_t cols) {
  Mat m = val.matrix(t, name, kFloats);
  expect_shape(m, name, rows, cols);
  val.output(name, m.data, Validator::span(m));
  return m;
}

// The calls: the forward, the backward from a saved lse (a shard's too), a shard's records, NCCL mode.
enum class Mode { Fwd, Bwd, Partial, Vp };

LinearCeProblem linear_ce_problem(fce_handle* h, Mode mode, const DLTensor* hidden, const DLTensor* weight,
                                  const DLTensor* bias, const DLTensor* targets, const DLTensor* lse,
                                  const fce_ce_options_t* options, const fce_linear_ce_outputs_t* outputs,
                                  DLTensor* records = nullptr) {
  Validator val(h->backend, h->device_id);
  LinearCeProblem p;
  p.hidden = val.matrix(hidden, "hidden", kFloats);
  p.weight = val.matrix(weight, "weight", kFloats);
  const int64_t N = p.hidden.rows, H = p.hidden.cols, V = p.weight.rows;
  FCE_CHECK(p.weight.cols == H, FCE_STATUS_SHAPE_MISMATCH, "weight has %lld columns; hidden has H = %lld",
            (long long)p.weight.cols, (long long)H);
  FCE_CHECK(p.weight.dtype == p.hidden.dtype, FCE_STATUS_UNSUPPORTED_DTYPE, "weight is %s but hidden is %s",
            dtype_name(p.weight.dtype), dtype_name(p.hidden.dtype));
  val.input("hidden", p.hidden.data, Validator::span(p.hidden));
  val.input("weight", p.weight.data, Validator::span(p.weight));
  if (bias) {
    p.bias = val.vector(bias, "bias", kFloats);
    FCE_CHECK(p.bias.n == V, FCE_STATUS_SHAPE_MISMATCH, "bias has length %lld; V is %lld", (long long)p.bias.n,
              (long long)V);
    FCE_CHECK(p.bias.dtype == p.hidden.dtype, FCE_STATUS_UNSUPPORTED_DTYPE, "bias is %s but hidden is %s",
              dtype_name(p.bias.dtype), dtype_name(p.hidden.dtype));
    val.input("bias", p.bias.data, Validator::span(p.bias));
  }
  p.targets = read_targets(val, targets, "targets", N);
  if (mode == Mode::Partial || mode == Mode::Vp) {
    p.o = sharded_options(val, options, V,
                          mode == Mode::Partial ? "fce_linear_cross_entropy_partial" : "fce_linear_cross_entropy_fwd_vp");
  } else {
    p.o = read_ce_options(options, val, V);
    FCE_CHECK(mode == Mode::Bwd || !p.o.sharded(), FCE_STATUS_INVALID_ARGUMENT,
              "options->vocab_total is set: a shard's forward is fce_linear_cross_entropy_partial (then "
              "fce_cross_entropy_combine), or fce_linear_cross_entropy_fwd_vp over NCCL");
  }
  if (mode == Mode::Partial) {
    p.records = val.matrix(records, "records", kF32);
    FCE_CHECK(p.records.rows == N && ce_record_width_ok(p.records.cols), FCE_STATUS_SHAPE_MISMATCH,
              "records has shape [%lld, %lld]; expected [%lld, K] with K = %lld, %lld or %lld (the record widths)",
              (long long)p.records.rows, (long long)p.records.cols, (long long)N, (long long)kCeRecordLoss,
              (long long)kCeRecordEntropy, (long long)kCeRecordFields);
    val.output("records", p.records.data, Validator::span(p.records));
    return p;
  }
  const fce_linear_ce_outputs_t out = checked_struct(outputs, "outputs");
  const bool bwd = lse != nullptr;
  if (bwd) {
    p.saved_lse = read_saved_lse(val, lse, "lse", N);
    FCE_CHECK(!out.loss && !out.lse && !out.z_loss && !out.argmax && !out.entropy, FCE_STATUS_INVALID_ARGUMENT,
              "the backward writes gradients only: outputs->loss, lse, z_loss, argmax and entropy must be NULL");
    FCE_CHECK(out.dhidden || out.dweight || out.dbias, FCE_STATUS_INVALID_ARGUMENT,
              "the backward needs at least one of outputs->dhidden, dweight, dbias");
  }
  CeStatOutputs s = read_ce_stat_outputs(val, p.o.reduction, N, out.loss, out.lse, out.z_loss, out.argmax,
                                         out.entropy, !bwd);
  take_stat_outputs(p, s);
  if (out.dhidden) p.dhidden = grad_output(val, out.dhidden, "outputs->dhidden", N, H);
  FCE_CHECK(mode != Mode::Bwd || !p.o.sharded() || !p.dhidden || p.dhidden.dtype == DType::F32,
            FCE_STATUS_UNSUPPORTED_DTYPE,
            "outputs->dhidden is %s: a shard's dhidden is its part of a sum over ranks and must be float32 (sum "
            "the parts in fp32, then round once)", dtype_name(p.dhidden.dtype));
  if (mode == Mode::Vp) {
    FCE_CHECK(h->backend == Backend::CUDA, FCE_STATUS_INVALID_ARGUMENT, "NCCL mode needs a CUDA handle");
    p.records_width = out.argmax ? kCeRecordFields
                      : out.entropy || out.grad_entropy ? kCeRecordEntropy
                                                        : kCeRecordLoss;
  }
  if (out.dweight) p.dweight = grad_output(val, out.dweight, "outputs->dweight", V, H);
  if (out.dbias) {
    FCE_CHECK(bias != nullptr, FCE_STATUS_INVALID_ARGUMENT, "outputs->dbias is set but there is no bias");
    p.dbias = val.vector(out.dbias, "outputs->dbias", kFloats);
    FCE_CHECK(p.dbias.n == V, FCE_STATUS_SHAPE_MISMATCH, "outputs->dbias has length %lld; V is %lld",
              (long long)p.dbias.n, (long long)V);
    val.output("outputs->dbias", p.dbias.data, Validator::span(p.dbias));
  }
  FCE_CHECK((out.flags & ~uint64_t(FCE_LINEAR_CE_ACCUMULATE)) == 0, FCE_STATUS_INVALID_ARGUMENT,
            "outputs->flags is 0x%llx: bits other than FCE_LINEAR_CE_ACCUMULATE (0x%x) are not defined",
            (unsigned long long)out.flags, FCE_LINEAR_CE_ACCUMULATE);
  p.accumulate = (out.flags & FCE_LINEAR_CE_ACCUMULATE) != 0;
  if (p.wants_grad()) p.grad_loss = read_grad_loss(val, out.grad_loss, p.o.reduction, N);
  FCE_CHECK(p.wants_grad() || !out.grad_entropy, FCE_STATUS_INVALID_ARGUMENT,
            "outputs->grad_entropy is set without a gradient output (dhidden, dweight or dbias)");
  p.grad_entropy = read_grad_entropy(val, out.grad_entropy, "outputs->grad_entropy", N);
  if (bwd && p.grad_entropy) {
    FCE_CHECK(out.saved_entropy != nullptr, FCE_STATUS_INVALID_ARGUMENT,
              "outputs->grad_entropy is set without outputs->saved_entropy (the forward's entropy output)");
    p.saved_entropy = read_saved_rows(val, out.saved_entropy, "outputs->saved_entropy", N);
  } else {
    FCE_CHECK(!out.saved_entropy || bwd, FCE_STATUS_INVALID_ARGUMENT,
              "outputs->saved_entropy is an input of fce_linear_cross_entropy_bwd; the forward computes it");
  }
  return p;
}

size_t lce_need(fce_handle* h, const LinearCeProblem& p, bool minimum, int64_t ranks = 0) {
  if (h->backend == Backend::CPU) return cpu::linear_ce_workspace(p, minimum);
  return ranks ? cuda::linear_ce_vp_workspace(h, p, ranks, minimum) : cuda::linear_ce_workspace(h, p, minimum);
}


void lce_run(fce_handle* h, fce_stream_t stream, const LinearCeProblem& p, void* ws, size_t ws_bytes) {
  // A caller's workspace may be anything from the one-token minimum up; NULL gets the default size.
  Workspace w = resolve_workspace(h, ws, ws_bytes, lce_need(h, p, ws != nullptr), stream);
  if (h->backend == Backend::CPU) cpu::linear_ce(p, w);
  else cuda::linear_ce(h, stream, p, w);
}

}  // namespace

extern "C" {

FCE_API fce_status_t fce_linear_cross_entropy_fwd(fce_handle_t handle, fce_stream_t stream,
                                                  const DLTensor* hidden, const DLTensor* weight,
                                                  const DLTensor* bias, const DLTensor* targets,
                                                  const fce_ce_options_t* options,
                                                  const fce_linear_ce_outputs_t* outputs, void* workspace,
                                                  size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    lce_run(h, stream, linear_ce_problem(h, Mode::Fwd, hidden, weight, bias, targets, nullptr, options, outputs), workspace,
            workspace_bytes);
  });
}

FCE_API fce_status_t fce_linear_cross_entropy_fwd_workspace_size(
    fce_handle_t handle, const DLTensor* hidden, const DLTensor* weight, const DLTensor* bias,
    const DLTensor* targets, const fce_ce_options_t* options, const fce_linear_ce_outputs_t* outputs,
    size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    write_size(bytes, lce_need(h, linear_ce_problem(h, Mode::Fwd, hidden, weight, bias, targets, nullptr, options, outputs), false));
  });
}

FCE_API fce_status_t fce_linear_cross_entropy_bwd(fce_handle_t handle, fce_stream_t stream,
                                                  const DLTensor* hidden, const DLTensor* weight,
                                                  const DLTensor* bias, const DLTensor* targets,
                                                  const DLTensor* lse, const fce_ce_options_t* options,
                                                  const fce_linear_ce_outputs_t* outputs, void* workspace,
                                                  size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    FCE_CHECK(lse != nullptr, FCE_STATUS_INVALID_ARGUMENT, "lse is NULL");
    lce_run(h, stream, linear_ce_problem(h, Mode::Bwd, hidden, weight, bias, targets, lse, options, outputs), workspace,
            workspace_bytes);
  });
}

FCE_API fce_status_t fce_linear_cross_entropy_bwd_workspace_size(
    fce_handle_t handle, const DLTensor* hidden, const DLTensor* weight, const DLTensor* bias,
    const DLTensor* targets, const DLTensor* lse, const fce_ce_options_t* options,
    const fce_linear_ce_outputs_t* outputs, size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    FCE_CHECK(lse != nullptr, FCE_STATUS_INVALID_ARGUMENT, "lse is NULL");
    write_size(bytes, lce_need(h, linear_ce_problem(h, Mode::Bwd, hidden, weight, bias, targets, lse, options, outputs), false));
  });
}

FCE_API fce_status_t fce_linear_cross_entropy_partial(fce_handle_t handle, fce_stream_t stream,
                                                      const DLTensor* hidden, const DLTensor* weight,
                                                      const DLTensor* bias, const DLTensor* targets,
                                                      const fce_ce_options_t* options, DLTensor* records,
                                                      void* workspace, size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    lce_run(h, stream,
            linear_ce_problem(h, Mode::Partial, hidden, weight, bias, targets, nullptr, options, nullptr, records),
            workspace, workspace_bytes);
  });
}

FCE_API fce_status_t fce_linear_cross_entropy_partial_workspace_size(
    fce_handle_t handle, const DLTensor* hidden, const DLTensor* weight, const DLTensor* bias,
    const DLTensor* targets, const fce_ce_options_t* options, const DLTensor* records, size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    write_size(bytes, lce_need(h,
                               linear_ce_problem(h, Mode::Partial, hidden, weight, bias, targets, nullptr, options,
                                                 nullptr, const_cast<DLTensor*>(records)),
                               false));
  });
}

FCE_API fce_status_t fce_linear_cross_entropy_fwd_vp(fce_handle_t handle, fce_comm_t comm, fce_stream_t stream,
                                                     const DLTensor* hidden, const DLTensor* weight,
                                                     const DLTensor* bias, const DLTensor* targets,
                                                     const fce_ce_options_t* options,
                                                     const fce_linear_ce_outputs_t* outputs, void* workspace,
                                                     size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_comm* c = checked_comm(h, comm);
    const LinearCeProblem p = linear_ce_problem(h, Mode::Vp, hidden, weight, bias, targets, nullptr, options, outputs);
    const Workspace w = resolve_workspace(h, workspace, workspace_bytes,
                                          lce_need(h, p, workspace != nullptr, c->size), stream);
    cuda::linear_ce_vp(h, c, stream, p, w);
  });
}

FCE_API fce_status_t fce_linear_cross_entropy_fwd_vp_workspace_size(
    fce_handle_t handle, fce_comm_t comm, const DLTensor* hidden, const DLTensor* weight, const DLTensor* bias,
    const DLTensor* targets, const fce_ce_options_t* options, const fce_linear_ce_outputs_t* outputs,
    size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_comm* c = checked_comm(h, comm);
    write_size(bytes, lce_need(h,
                               linear_ce_problem(h, Mode::Vp, hidden, weight, bias, targets, nullptr, options, outputs),
                               false, c->size));
  });
}

}  // extern "C"
