#include "common/api_util.hpp"

namespace fce {

CeOpts ce_option_values(const fce_ce_options_t& p) {
  CeOpts o;
  FCE_CHECK(p.reduction >= FCE_REDUCTION_NONE && p.reduction <= FCE_REDUCTION_MEAN, FCE_STATUS_INVALID_ARGUMENT,
            "options->reduction %d is not an fce_reduction_t", p.reduction);
  FCE_CHECK(finite(p.label_smoothing) && p.label_smoothing >= 0.f && p.label_smoothing <= 1.f,
            FCE_STATUS_INVALID_ARGUMENT, "options->label_smoothing %g is outside [0, 1]", p.label_smoothing);
  FCE_CHECK(finite(p.z_loss_scale) && p.z_loss_scale >= 0.f, FCE_STATUS_INVALID_ARGUMENT,
            "options->z_loss_scale %g must be finite and >= 0", p.z_loss_scale);
  FCE_CHECK(finite(p.softcap) && p.softcap >= 0.f, FCE_STATUS_INVALID_ARGUMENT,
            "options->softcap %g must be finite and >= 0 (0 = off)", p.softcap);
  FCE_CHECK(finite(p.logit_scale) && p.logit_scale > 0.f, FCE_STATUS_INVALID_ARGUMENT,
            "options->logit_scale %g must be finite and > 0", p.logit_scale);
  o.reduction = p.reduction;
  o.ignore_index = p.ignore_index;
  o.label_smoothing = p.label_smoothing;
  o.z_loss_scale = p.z_loss_scale;
  o.softcap = p.softcap;
  o.logit_scale = p.logit_scale;
  check_vocab_shard(p.vocab_start, p.vocab_total);
  o.vocab_start = p.vocab_start;
  o.vocab_total = p.vocab_total;
  return o;
}

CeOpts read_ce_options(const fce_ce_options_t* options, Validator& val, int64_t V) {
  if (!options) return CeOpts{};
  const fce_ce_options_t p = checked_struct(options, "options");
  CeOpts o = ce_option_values(p);
  const int64_t VW = o.sharded() ? o.vocab_total : V;  // class weights cover the whole vocabulary
  if (p.class_weights) {
    o.class_weights = val.vector(p.class_weights, "options->class_weights", kF32);
    FCE_CHECK(o.class_weights.n == VW, FCE_STATUS_SHAPE_MISMATCH,
              "options->class_weights has length %lld; expected %s = %lld", (long long)o.class_weights.n,
              o.sharded() ? "vocab_total" : "V", (long long)VW);
    val.input("options->class_weights", o.class_weights.data, Validator::span(o.class_weights));
  }
  return o;
}

Vec read_targets(Validator& val, const DLTensor* t, const char* name, int64_t N) {
  Vec v = val.vector(t, name, kInts);
  FCE_CHECK(v.n == N, FCE_STATUS_SHAPE_MISMATCH, "%s has length %lld; expected N = %lld", name, (long long)v.n,
            (long long)N);
  val.input(name, v.data, Validator::span(v));
  return v;
}

void expect_shape(const Mat& m, const char* name, int64_t rows, int64_t cols) {
  FCE_CHECK(m.rows == rows && m.cols == cols, FCE_STATUS_SHAPE_MISMATCH, "%s has shape [%lld, %lld]; expected [%lld, %lld]",
            name, (long long)m.rows, (long long)m.cols, (long long)rows, (long long)cols);
}

static Vec reduced_output(Validator& val, const DLTensor* t, const char* name, int reduction, int64_t N) {
  Vec v;
  if (reduction == FCE_REDUCTION_NONE) {
    v = val.vector(t, name, kF32);
    FCE_CHECK(v.n == N, FCE_STATUS_SHAPE_MISMATCH, "%s has length %lld; expected [N] = %lld with reduction none",
              name, (long long)v.n, (long long)N);
  } else {
    v = val.scalar(t, name, kF32);
  }
  val.output(name, v.data, Validator::span(v));
  return v;
}

static Vec row_output(Validator& val, const DLTensor* t, const char* name, unsigned accept, int64_t N) {
  Vec v = val.vector(t, name, accept);
  FCE_CHECK(v.n == N, FCE_STATUS_SHAPE_MISMATCH, "%s has length %lld; expected N = %lld", name, (long long)v.n,
            (long long)N);
  val.output(name, v.data, Validator::span(v));
  return v;
}

CeStatOutputs read_ce_stat_outputs(Validator& val, int reduction, int64_t N, DLTensor* loss, DLTensor* lse,
                                   DLTensor* z_loss, DLTensor* argmax, DLTensor* entropy, bool loss_required) {
  CeStatOutputs o;
  FCE_CHECK(loss || !loss_required, FCE_STATUS_INVALID_ARGUMENT, "outputs->loss is NULL");
  if (loss) o.loss = reduced_output(val, loss, "outputs->loss", reduction, N);
  if (z_loss) o.z_loss = reduced_output(val, z_loss, "outputs->z_loss", reduction, N);
  if (lse) {
    o.lse = val.lse(lse, "outputs->lse", N);
    val.output("outputs->lse", o.lse.data, Validator::span(o.lse));
  }
  if (argmax) o.argmax = row_output(val, argmax, "outputs->argmax", kInts, N);
  if (entropy) o.entropy = row_output(val, entropy, "outputs->entropy", kF32, N);
  return o;
}

Vec read_grad_loss(Validator& val, const DLTensor* g, int reduction, int64_t N) {
  if (!g) return Vec{};
  Vec v = reduction == FCE_REDUCTION_NONE ? val.scalar_or_vector(g, "grad_loss", kF32, N)
                                          : val.scalar(g, "grad_loss", kF32);
  val.input("grad_loss", v.data, Validator::span(v));
  return v;
}

Vec read_grad_entropy(Validator& val, const DLTensor* g, const char* name, int64_t N) {
  if (!g) return Vec{};
  Vec v = val.scalar_or_vector(g, name, kF32, N);
  val.input(name, v.data, Validator::span(v));
  return v;
}

Vec read_saved_lse(Validator& val, const DLTensor* t, const char* name, int64_t N) {
  Vec v = val.lse(t, name, N);
  val.input(name, v.data, Validator::span(v));
  return v;
}

Vec read_saved_rows(Validator& val, const DLTensor* t, const char* name, int64_t N) {
  Vec v = val.vector(t, name, kF32);
  FCE_CHECK(v.n == N, FCE_STATUS_SHAPE_MISMATCH, "%s has length %lld; expected N = %lld", name, (long long)v.n,
            (long long)N);
  val.input(name, v.data, Validator::span(v));
  return v;
}

void read_fused_dlogits(Validator& val, const fce_ce_outputs_t& out, CeProblem& p) {
  FCE_CHECK(out.dlogits || !out.grad_entropy, FCE_STATUS_INVALID_ARGUMENT,
            "outputs->grad_entropy is set without outputs->dlogits (it only enters the fused gradient)");
  if (!out.dlogits) return;
  p.dlogits = val.matrix(out.dlogits, "outputs->dlogits", kFloats);
  expect_shape(p.dlogits, "outputs->dlogits", p.logits.rows, p.logits.cols);
  FCE_CHECK(p.dlogits.dtype == p.logits.dtype, FCE_STATUS_UNSUPPORTED_DTYPE,
            "outputs->dlogits is %s; it must have the logits' dtype %s", dtype_name(p.dlogits.dtype),
            dtype_name(p.logits.dtype));
  val.output_allow_exact("outputs->dlogits", p.dlogits, p.logits, "logits");
  p.grad_loss = read_grad_loss(val, out.grad_loss, p.o.reduction, p.logits.rows);
  p.grad_entropy = read_grad_entropy(val, out.grad_entropy, "outputs->grad_entropy", p.logits.rows);
}

namespace {

// Validates everything of a forward call; `ce_workspace` and `ce` then run on the result.
CeProblem ce_forward_problem(fce_handle* h, const DLTensor* logits, const DLTensor* targets,
                             const fce_ce_options_t* options, const fce_ce_outputs_t* outputs) {
  Validator val(h->backend, h->device_id);
  CeProblem p;
  p.logits = val.matrix(logits, "logits", kFloats);
  val.input("logits", p.logits.data, Validator::span(p.logits));
  const int64_t N = p.logits.rows, V = p.logits.cols;
  p.targets = read_targets(val, targets, "targets", N);
  p.o = read_ce_options(options, val, V);
  FCE_CHECK(!p.o.sharded(), FCE_STATUS_INVALID_ARGUMENT,
            "options->vocab_total is set: the loss of a vocabulary shard comes from fce_cross_entropy_partial and "
            "fce_cross_entropy_combine");
  const fce_ce_outputs_t out = checked_struct(outputs, "outputs");
  CeStatOutputs s = read_ce_stat_outputs(val, p.o.reduction, N, out.loss, out.lse, out.z_loss, out.argmax,
                                         out.entropy, true);
  take_stat_outputs(p, s);
  read_fused_dlogits(val, out, p);
  return p;
}

// fce_cross_entropy_bwd's arguments as fce_cross_entropy_bwd_ex's inputs.
fce_ce_bwd_inputs_t bwd_inputs(const DLTensor* lse, const DLTensor* grad_loss) {
  fce_ce_bwd_inputs_t in = FCE_CE_BWD_INPUTS_INIT;
  in.lse = lse;
  in.grad_loss = grad_loss;
  return in;
}

CeProblem ce_backward_problem(fce_handle* h, const DLTensor* logits, const DLTensor* targets,
                              const fce_ce_bwd_inputs_t* inputs, const fce_ce_options_t* options,
                              const DLTensor* dlogits, bool ex) {
  Validator val(h->backend, h->device_id);
  CeProblem p;
  p.logits = val.matrix(logits, "logits", kFloats);
  val.input("logits", p.logits.data, Validator::span(p.logits));
  const int64_t N = p.logits.rows, V = p.logits.cols;
  p.targets = read_targets(val, targets, "targets", N);
  p.o = read_ce_options(options, val, V);
  const fce_ce_bwd_inputs_t in = checked_struct(inputs, "inputs");
  const char* lse_name = ex ? "inputs->lse" : "lse";
  FCE_CHECK(in.lse != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s is NULL", lse_name);
  p.saved_lse = read_saved_lse(val, in.lse, lse_name, N);
  p.grad_loss = read_grad_loss(val, in.grad_loss, p.o.reduction, N);
  p.grad_entropy = read_grad_entropy(val, in.grad_entropy, "inputs->grad_entropy", N);
  if (p.grad_entropy) {
    FCE_CHECK(in.entropy != nullptr, FCE_STATUS_INVALID_ARGUMENT,
              "inputs->grad_entropy is set without inputs->entropy (the forward's entropy output)");
    p.saved_entropy = read_saved_rows(val, in.entropy, "inputs->entropy", N);
  }
  FCE_CHECK(dlogits != nullptr, FCE_STATUS_INVALID_ARGUMENT, "dlogits is NULL");
  p.dlogits = val.matrix(dlogits, "dlogits", kFloats);
  expect_shape(p.dlogits, "dlogits", N, V);
  FCE_CHECK(p.dlogits.dtype == p.logits.dtype, FCE_STATUS_UNSUPPORTED_DTYPE,
            "dlogits is %s; it must have the logits' dtype %s", dtype_name(p.dlogits.dtype), dtype_name(p.logits.dtype));
  val.output_allow_exact("dlogits", p.dlogits, p.logits, "logits");
  return p;
}

size_t ce_need(fce_handle* h, const CeProblem& p) {
  return h->backend == Backend::CPU ? cpu::ce_workspace(p) : cuda::ce_workspace(h, p);
}

void ce_run(fce_handle* h, fce_stream_t stream, const CeProblem& p, void* ws, size_t ws_bytes) {
  Workspace w = resolve_workspace(h, ws, ws_bytes, ce_need(h, p), stream);
  if (h->backend == Backend::CPU) cpu::ce(p, w);
  else cuda::ce(h, stream, p, w);
}

}  // namespace
}  // namespace fce

using namespace fce;

extern "C" {

FCE_API fce_status_t fce_cross_entropy_fwd(fce_handle_t handle, fce_stream_t stream, const DLTensor* logits,
                                           const DLTensor* targets, const fce_ce_options_t* options,
                                           const fce_ce_outputs_t* outputs, void* workspace,
                                           size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    ce_run(h, stream, ce_forward_problem(h, logits, targets, options, outputs), workspace, workspace_bytes);
  });
}

FCE_API fce_status_t fce_cross_entropy_fwd_workspace_size(fce_handle_t handle, const DLTensor* logits,
                                                          const DLTensor* targets,
                                                          const fce_ce_options_t* options,
                                                          const fce_ce_outputs_t* outputs, size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    write_size(bytes, ce_need(h, ce_forward_problem(h, logits, targets, options, outputs)));
  });
}

FCE_API fce_status_t fce_cross_entropy_bwd(fce_handle_t handle, fce_stream_t stream, const DLTensor* logits,
                                           const DLTensor* targets, const DLTensor* lse,
                                           const DLTensor* grad_loss, const fce_ce_options_t* options,
                                           DLTensor* dlogits, void* workspace, size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_ce_bwd_inputs_t in = bwd_inputs(lse, grad_loss);
    ce_run(h, stream, ce_backward_problem(h, logits, targets, &in, options, dlogits, false), workspace,
           workspace_bytes);
  });
}

FCE_API fce_status_t fce_cross_entropy_bwd_workspace_size(fce_handle_t handle, const DLTensor* logits,
                                                          const DLTensor* targets, const DLTensor* lse,
                                                          const DLTensor* grad_loss,
                                                          const fce_ce_options_t* options,
                                                          const DLTensor* dlogits, size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_ce_bwd_inputs_t in = bwd_inputs(lse, grad_loss);
    write_size(bytes, ce_need(h, ce_backward_problem(h, logits, targets, &in, options, dlogits, false)));
  });
}

FCE_API fce_status_t fce_cross_entropy_bwd_ex(fce_handle_t handle, fce_stream_t stream, const DLTensor* logits,
                                              const DLTensor* targets, const fce_ce_bwd_inputs_t* inputs,
                                              const fce_ce_options_t* options, DLTensor* dlogits, void* workspace,
                                              size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    ce_run(h, stream, ce_backward_problem(h, logits, targets, inputs, options, dlogits, true), workspace,
           workspace_bytes);
  });
}

FCE_API fce_status_t fce_cross_entropy_bwd_ex_workspace_size(fce_handle_t handle, const DLTensor* logits,
                                                             const DLTensor* targets,
                                                             const fce_ce_bwd_inputs_t* inputs,
                                                             const fce_ce_options_t* options,
                                                             const DLTensor* dlogits, size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    write_size(bytes, ce_need(h, ce_backward_problem(h, logits, targets, inputs, options, dlogits, true)));
  });
}

}  // extern "C"
