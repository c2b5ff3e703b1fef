#include "common/api_util.hpp"

using namespace fce;

namespace {

KdProblem kd_problem(fce_handle* h, const DLTensor* student, const fce_kd_teacher_t* teacher,
                     const DLTensor* targets, const fce_kd_options_t* options, const fce_kd_outputs_t* outputs) {
  Validator val(h->backend, h->device_id);
  KdProblem p;
  p.student = val.matrix(student, "student", kFloats);
  val.input("student", p.student.data, Validator::span(p.student));
  const int64_t N = p.student.rows, V = p.student.cols;
  const fce_kd_teacher_t t = checked_struct(teacher, "teacher");
  const bool full = t.logits != nullptr, topk = t.topk_ids != nullptr || t.topk_logprobs != nullptr;
  FCE_CHECK(full != topk, FCE_STATUS_INVALID_ARGUMENT,
            "teacher must have either logits or (topk_ids, topk_logprobs), not %s", full ? "both" : "neither");
  if (full) {
    p.teacher = val.matrix(t.logits, "teacher->logits", kFloats);
    expect_shape(p.teacher, "teacher->logits", N, V);
    val.input("teacher->logits", p.teacher.data, Validator::span(p.teacher));
  } else {
    FCE_CHECK(t.topk_ids && t.topk_logprobs, FCE_STATUS_INVALID_ARGUMENT,
              "teacher->topk_ids and teacher->topk_logprobs must both be set");
    p.topk_ids = val.matrix(t.topk_ids, "teacher->topk_ids", kInts);
    p.topk_lp = val.matrix(t.topk_logprobs, "teacher->topk_logprobs", kF32);
    FCE_CHECK(p.topk_ids.rows == N, FCE_STATUS_SHAPE_MISMATCH, "teacher->topk_ids has %lld rows; expected N = %lld",
              (long long)p.topk_ids.rows, (long long)N);
    expect_shape(p.topk_lp, "teacher->topk_logprobs", N, p.topk_ids.cols);
    val.input("teacher->topk_ids", p.topk_ids.data, Validator::span(p.topk_ids));
    val.input("teacher->topk_logprobs", p.topk_lp.data, Validator::span(p.topk_lp));
  }
  if (targets) p.targets = read_targets(val, targets, "targets", N);
  if (options) {
    const fce_kd_options_t o = checked_struct(options, "options");
    FCE_CHECK(o.divergence >= FCE_KD_FORWARD_KL && o.divergence <= FCE_KD_JSD, FCE_STATUS_INVALID_ARGUMENT,
              "options->divergence %d is not an fce_kd_divergence_t", o.divergence);
    FCE_CHECK(finite(o.beta) && o.beta >= 0.f && o.beta <= 1.f, FCE_STATUS_INVALID_ARGUMENT,
              "options->beta %g is outside [0, 1]", o.beta);
    FCE_CHECK(o.temperature >= FCE_KD_TEMPERATURE_MIN && o.temperature <= FCE_KD_TEMPERATURE_MAX,
              FCE_STATUS_INVALID_ARGUMENT, "options->temperature %g is outside [%g, %g] (FCE_KD_TEMPERATURE_MIN/MAX)",
              o.temperature, double(FCE_KD_TEMPERATURE_MIN), double(FCE_KD_TEMPERATURE_MAX));
    FCE_CHECK(o.topk_norm == FCE_KD_TOPK_FULL_VOCAB || o.topk_norm == FCE_KD_TOPK_RENORMALIZE,
              FCE_STATUS_INVALID_ARGUMENT, "options->topk_norm %d is not an fce_kd_topk_norm_t", o.topk_norm);
    FCE_CHECK(o.reduction >= FCE_REDUCTION_NONE && o.reduction <= FCE_REDUCTION_MEAN, FCE_STATUS_INVALID_ARGUMENT,
              "options->reduction %d is not an fce_reduction_t", o.reduction);
    p.o.divergence = o.divergence;
    p.o.beta = o.beta;
    p.o.temperature = o.temperature;
    p.o.scale_by_t2 = o.scale_by_t2 != 0;
    p.o.topk_norm = o.topk_norm;
    p.o.reduction = o.reduction;
    p.o.ignore_index = o.ignore_index;
  }
  const fce_kd_outputs_t out = checked_struct(outputs, "outputs");
  CeStatOutputs s = read_ce_stat_outputs(val, p.o.reduction, N, out.loss, nullptr, nullptr, nullptr, nullptr, true);
  p.loss = s.loss;
  if (out.dstudent) {
    p.dstudent = val.matrix(out.dstudent, "outputs->dstudent", kFloats);
    expect_shape(p.dstudent, "outputs->dstudent", N, V);
    FCE_CHECK(p.dstudent.dtype == p.student.dtype, FCE_STATUS_UNSUPPORTED_DTYPE,
              "outputs->dstudent is %s; it must have the student's dtype %s", dtype_name(p.dstudent.dtype),
              dtype_name(p.student.dtype));
    val.output_allow_exact("outputs->dstudent", p.dstudent, p.student, "student");
    p.grad_loss = read_grad_loss(val, out.grad_loss, p.o.reduction, N);
  }
  return p;
}

size_t kd_need(fce_handle* h, const KdProblem& p) {
  return h->backend == Backend::CPU ? cpu::kd_workspace(p) : cuda::kd_workspace(h, p);
}

}  // namespace

extern "C" {

FCE_API fce_status_t fce_kd_loss(fce_handle_t handle, fce_stream_t stream, const DLTensor* student,
                                 const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                 const fce_kd_options_t* options, const fce_kd_outputs_t* outputs,
                                 void* workspace, size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    KdProblem p = kd_problem(h, student, teacher, targets, options, outputs);
    Workspace w = resolve_workspace(h, workspace, workspace_bytes, kd_need(h, p), stream);
    if (h->backend == Backend::CPU) cpu::kd(p, w);
    else cuda::kd(h, stream, p, w);
  });
}

FCE_API fce_status_t fce_kd_loss_workspace_size(fce_handle_t handle, const DLTensor* student,
                                                const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                                const fce_kd_options_t* options,
                                                const fce_kd_outputs_t* outputs, size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    write_size(bytes, kd_need(h, kd_problem(h, student, teacher, targets, options, outputs)));
  });
}

}  // extern "C"
