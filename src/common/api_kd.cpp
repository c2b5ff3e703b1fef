#include "common/api_util.hpp"
#include "common/comm.hpp"

using namespace fce;

namespace {

// Validates KD options (domain of every field; a shard's vocab_start and vocab_total).
KdOpts read_kd_options(const fce_kd_options_t* options) {
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
  check_vocab_shard(o.vocab_start, o.vocab_total);
  KdOpts r;
  r.divergence = o.divergence;
  r.beta = o.beta;
  r.temperature = o.temperature;
  r.scale_by_t2 = o.scale_by_t2 != 0;
  r.topk_norm = o.topk_norm;
  r.reduction = o.reduction;
  r.ignore_index = o.ignore_index;
  r.vocab_start = o.vocab_start;
  r.vocab_total = o.vocab_total;
  return r;
}

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
  if (options) p.o = read_kd_options(options);
  FCE_CHECK(p.o.vocab_total == 0, FCE_STATUS_INVALID_ARGUMENT,
            "options->vocab_total is %lld: fce_kd_loss takes whole rows (a shard goes through fce_kd_partial, "
            "fce_kd_combine and fce_kd_bwd)", (long long)p.o.vocab_total);
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

// ---- vocabulary-parallel KD ---------------------------------------------------------------------------

// A shard call's options: required, a shard; JSD at beta 0 or 1 becomes the KL it equals.
KdOpts kd_shard_options(const fce_kd_options_t* options, const char* fn) {
  FCE_CHECK(options != nullptr, FCE_STATUS_INVALID_ARGUMENT, "options is NULL: %s needs options->vocab_total", fn);
  KdOpts o = read_kd_options(options);
  FCE_CHECK(o.vocab_total > 0, FCE_STATUS_INVALID_ARGUMENT,
            "options->vocab_total is 0: %s is for a vocabulary shard (set vocab_start and vocab_total)", fn);
  int div = o.divergence;
  if (div == FCE_KD_JSD && o.beta == 0.f) div = FCE_KD_FORWARD_KL;  // KdTerm's convention: exactly KL
  if (div == FCE_KD_JSD && o.beta == 1.f) div = FCE_KD_REVERSE_KL;
  o.divergence = div;
  return o;
}

// The student shard and its teacher: the full logits' shard of the same shape, or a top-K teacher's [N, K]
// global ids and log-probabilities.
void read_shard_pair(Validator& val, const DLTensor* student, const fce_kd_teacher_t* teacher, Mat& s,
                     KdShardTeacher& t, const char* fn) {
  s = val.matrix(student, "student", kFloats);
  val.input("student", s.data, Validator::span(s));
  const fce_kd_teacher_t tt = checked_struct(teacher, "teacher");
  const bool full = tt.logits != nullptr, topk = tt.topk_ids != nullptr || tt.topk_logprobs != nullptr;
  FCE_CHECK(full != topk, FCE_STATUS_INVALID_ARGUMENT,
            "%s: teacher must have either logits or (topk_ids, topk_logprobs), not %s", fn, full ? "both" : "neither");
  if (full) {
    t.logits = val.matrix(tt.logits, "teacher->logits", kFloats);
    expect_shape(t.logits, "teacher->logits", s.rows, s.cols);
    val.input("teacher->logits", t.logits.data, Validator::span(t.logits));
    return;
  }
  FCE_CHECK(tt.topk_ids && tt.topk_logprobs, FCE_STATUS_INVALID_ARGUMENT,
            "teacher->topk_ids and teacher->topk_logprobs must both be set");
  t.topk_ids = val.matrix(tt.topk_ids, "teacher->topk_ids", kInts);
  t.topk_lp = val.matrix(tt.topk_logprobs, "teacher->topk_logprobs", kF32);
  FCE_CHECK(t.topk_ids.rows == s.rows, FCE_STATUS_SHAPE_MISMATCH, "teacher->topk_ids has %lld rows; expected N = %lld",
            (long long)t.topk_ids.rows, (long long)s.rows);
  expect_shape(t.topk_lp, "teacher->topk_logprobs", s.rows, t.topk_ids.cols);
  val.input("teacher->topk_ids", t.topk_ids.data, Validator::span(t.topk_ids));
  val.input("teacher->topk_logprobs", t.topk_lp.data, Validator::span(t.topk_lp));
}

KdPartialProblem kd_partial_problem(fce_handle* h, const DLTensor* student, const fce_kd_teacher_t* teacher,
                                    const fce_kd_options_t* options, DLTensor* records) {
  Validator val(h->backend, h->device_id);
  KdPartialProblem p;
  read_shard_pair(val, student, teacher, p.student, p.teacher, "fce_kd_partial");
  p.o = kd_shard_options(options, "fce_kd_partial");
  p.records = val.matrix(records, "records", kF32);
  expect_shape(p.records, "records", p.student.rows, kKdRecordFields);
  val.output("records", p.records.data, Validator::span(p.records));
  return p;
}

// Row statistics [N, kKdRowStatsFields] fp32 (an output of the combine, an input of the backward).
Mat read_row_stats(Validator& val, const DLTensor* t, int64_t N) {
  Mat m = val.matrix(t, "row_stats", kF32);
  expect_shape(m, "row_stats", N, kKdRowStatsFields);
  return m;
}

KdCombineProblem kd_combine_problem(fce_handle* h, const DLTensor* records, const DLTensor* targets,
                                    const fce_kd_options_t* options, DLTensor* loss, DLTensor* row_stats) {
  Validator val(h->backend, h->device_id);
  KdCombineProblem p;
  int64_t W = 0, N = 0;
  p.records = read_gathered_records(val, records, {kKdRecordFields}, &W, &N);
  p.W = W;
  p.N = N;
  if (targets) p.targets = read_targets(val, targets, "targets", N);
  p.o = kd_shard_options(options, "fce_kd_combine");
  if (p.o.mixture()) {
    FCE_CHECK(loss == nullptr, FCE_STATUS_INVALID_ARGUMENT,
              "loss is set: JSD's loss over shards needs the mixture, a second exchange (pass loss = NULL here and "
              "take it from fce_kd_terms_combine)");
    FCE_CHECK(row_stats != nullptr, FCE_STATUS_INVALID_ARGUMENT,
              "row_stats is NULL: JSD's first combine gives only the rows' statistics, which "
              "fce_kd_terms_partial needs");
  } else if (loss) {
    p.loss = read_ce_stat_outputs(val, p.o.reduction, N, loss, nullptr, nullptr, nullptr, nullptr, true).loss;
  } else {  // a top-K teacher's loss comes from the terms
    FCE_CHECK(row_stats != nullptr, FCE_STATUS_INVALID_ARGUMENT, "loss and row_stats are both NULL: nothing to write");
  }
  if (row_stats) {
    p.row_stats = read_row_stats(val, row_stats, N);
    val.output("row_stats", p.row_stats.data, Validator::span(p.row_stats));
  }
  return p;
}

KdTermsPartialProblem kd_terms_partial_problem(fce_handle* h, const DLTensor* student, const fce_kd_teacher_t* teacher,
                                               const DLTensor* row_stats, const fce_kd_options_t* options,
                                               DLTensor* records) {
  Validator val(h->backend, h->device_id);
  KdTermsPartialProblem p;
  read_shard_pair(val, student, teacher, p.student, p.teacher, "fce_kd_terms_partial");
  p.o = kd_shard_options(options, "fce_kd_terms_partial");
  p.row_stats = read_row_stats(val, row_stats, p.student.rows);
  val.input("row_stats", p.row_stats.data, Validator::span(p.row_stats));
  p.records = val.matrix(records, "records", kF32);
  expect_shape(p.records, "records", p.student.rows, kKdTermsRecordFields);
  val.output("records", p.records.data, Validator::span(p.records));
  return p;
}

KdCombineProblem kd_terms_combine_problem(fce_handle* h, const DLTensor* records, const DLTensor* targets,
                                          const fce_kd_options_t* options, DLTensor* loss, DLTensor* row_stats) {
  Validator val(h->backend, h->device_id);
  KdCombineProblem p;
  p.terms = true;
  int64_t W = 0, N = 0;
  p.records = read_gathered_records(val, records, {kKdTermsRecordFields}, &W, &N);
  p.W = W;
  p.N = N;
  if (targets) p.targets = read_targets(val, targets, "targets", N);
  p.o = kd_shard_options(options, "fce_kd_terms_combine");
  p.loss = read_ce_stat_outputs(val, p.o.reduction, N, loss, nullptr, nullptr, nullptr, nullptr, true).loss;
  FCE_CHECK(row_stats != nullptr, FCE_STATUS_INVALID_ARGUMENT,
            "row_stats is NULL: fce_kd_terms_combine writes the rows' A (field 4) into fce_kd_combine's statistics");
  p.row_stats = read_row_stats(val, row_stats, N);
  val.output("row_stats", p.row_stats.data, Validator::span(p.row_stats));
  return p;
}

KdBwdProblem kd_bwd_problem(fce_handle* h, const DLTensor* student, const fce_kd_teacher_t* teacher,
                            const DLTensor* targets, const DLTensor* row_stats, const fce_kd_options_t* options,
                            const DLTensor* grad_loss, const DLTensor* dstudent) {
  Validator val(h->backend, h->device_id);
  KdBwdProblem p;
  read_shard_pair(val, student, teacher, p.student, p.teacher, "fce_kd_bwd");
  const int64_t N = p.student.rows;
  if (targets) p.targets = read_targets(val, targets, "targets", N);
  p.o = kd_shard_options(options, "fce_kd_bwd");
  p.row_stats = read_row_stats(val, row_stats, N);
  val.input("row_stats", p.row_stats.data, Validator::span(p.row_stats));
  p.grad_loss = read_grad_loss(val, grad_loss, p.o.reduction, N);
  p.dstudent = val.matrix(dstudent, "dstudent", kFloats);
  expect_shape(p.dstudent, "dstudent", N, p.student.cols);
  FCE_CHECK(p.dstudent.dtype == p.student.dtype, FCE_STATUS_UNSUPPORTED_DTYPE,
            "dstudent is %s; it must have the student's dtype %s", dtype_name(p.dstudent.dtype),
            dtype_name(p.student.dtype));
  val.output_allow_exact("dstudent", p.dstudent, p.student, "student");
  FCE_CHECK(!p.teacher.topk() || h->backend == Backend::CPU || p.teacher.topk_ids.cols <= kKdShardTopkMax,
            FCE_STATUS_NOT_IMPLEMENTED, "fce_kd_bwd: a top-K teacher of K = %lld over shards on CUDA (at most %lld)",
            (long long)p.teacher.topk_ids.cols, (long long)kKdShardTopkMax);
  return p;
}

size_t kd_combine_need(fce_handle* h, const KdCombineProblem& p) {
  return h->backend == Backend::CPU ? 0 : cuda::kd_combine_workspace(h, p);
}
size_t kd_bwd_need(fce_handle* h, const KdBwdProblem& p) {
  return h->backend == Backend::CPU ? 0 : cuda::kd_bwd_workspace(h, p);
}

size_t kd_need(fce_handle* h, const KdProblem& p) {
  return h->backend == Backend::CPU ? cpu::kd_workspace(p) : cuda::kd_workspace(h, p);
}

// A validated NCCL-mode KD call (fce_kd_fwd_vp): its steps and where each keeps its data in the workspace.
struct KdVpCall {
  KdPartialProblem part;
  KdCombineProblem comb;       // the records' combine: the loss with one exchange, the statistics
  KdTermsPartialProblem terms;  // JSD and a top-K teacher: the second exchange
  KdCombineProblem tcomb;
  KdBwdProblem bwd;  // no dstudent: no gradient
  bool two = false;
  size_t gathered = 0, stats = 0, trec = 0, tgathered = 0, comb_ws = 0, bwd_ws = 0, bytes = 0;
};

KdVpCall kd_vp_call(fce_handle* h, const fce_comm* c, const DLTensor* student, const fce_kd_teacher_t* teacher,
                    const DLTensor* targets, const fce_kd_options_t* options, const fce_kd_outputs_t* outputs,
                    const DLTensor* row_stats) {
  const char* fn = "fce_kd_fwd_vp";
  Validator val(h->backend, h->device_id);
  KdVpCall v;
  KdPartialProblem& p = v.part;
  read_shard_pair(val, student, teacher, p.student, p.teacher, fn);
  const int64_t N = p.student.rows, W = c->size;
  p.o = kd_shard_options(options, fn);
  const Vec tg = targets ? read_targets(val, targets, "targets", N) : Vec{};
  const fce_kd_outputs_t out = checked_struct(outputs, "outputs");
  const Vec loss = read_ce_stat_outputs(val, p.o.reduction, N, out.loss, nullptr, nullptr, nullptr, nullptr, true).loss;
  v.two = p.o.mixture() || p.teacher.topk();
  v.comb.W = v.tcomb.W = W;
  v.comb.N = v.tcomb.N = N;
  v.comb.targets = v.tcomb.targets = tg;
  v.comb.o = v.tcomb.o = p.o;
  v.tcomb.terms = true;
  (v.two ? v.tcomb : v.comb).loss = loss;
  if (v.two) {
    v.terms.student = p.student;
    v.terms.teacher = p.teacher;
    v.terms.o = p.o;
  }
  if (out.dstudent) {
    KdBwdProblem& b = v.bwd;
    b.student = p.student;
    b.teacher = p.teacher;
    b.targets = tg;
    b.o = p.o;
    b.grad_loss = read_grad_loss(val, out.grad_loss, p.o.reduction, N);
    b.dstudent = val.matrix(out.dstudent, "outputs->dstudent", kFloats);
    expect_shape(b.dstudent, "outputs->dstudent", N, p.student.cols);
    FCE_CHECK(b.dstudent.dtype == p.student.dtype, FCE_STATUS_UNSUPPORTED_DTYPE,
              "outputs->dstudent is %s; it must have the student's dtype %s", dtype_name(b.dstudent.dtype),
              dtype_name(p.student.dtype));
    val.output_allow_exact("outputs->dstudent", b.dstudent, p.student, "student");
    FCE_CHECK(!p.teacher.topk() || p.teacher.topk_ids.cols <= kKdShardTopkMax, FCE_STATUS_NOT_IMPLEMENTED,
              "%s: a top-K teacher of K = %lld with dstudent (at most %lld)", fn, (long long)p.teacher.topk_ids.cols,
              (long long)kKdShardTopkMax);
  } else {
    FCE_CHECK(!out.grad_loss, FCE_STATUS_INVALID_ARGUMENT, "outputs->grad_loss is set without outputs->dstudent");
  }
  if (row_stats) {
    v.comb.row_stats = read_row_stats(val, row_stats, N);
    val.output("row_stats", v.comb.row_stats.data, Validator::span(v.comb.row_stats));
  }
  // Workspace: this rank's records, every rank's, the rows' statistics (unless the caller's); the terms'
  // records, this rank's and every rank's; then the combines' and the backward's own workspaces.
  size_t all = 0, tall = 0;
  v.gathered = vp_records_bytes(N, kKdRecordFields, W, &all);
  const size_t tbytes = vp_records_bytes(N, kKdTermsRecordFields, W, &tall);
  v.stats = v.gathered + all;
  size_t at = v.stats + (row_stats ? 0 : vp_align(size_t(N) * kKdRowStatsFields * 4));
  v.trec = at;
  v.tgathered = at += v.two ? tbytes : 0;
  at += v.two ? tall : 0;
  v.comb_ws = at;
  at += vp_align(std::max(cuda::kd_combine_workspace(h, v.comb), cuda::kd_combine_workspace(h, v.tcomb)));
  v.bwd_ws = at;
  if (out.dstudent) at += vp_align(cuda::kd_bwd_workspace(h, v.bwd));
  v.bytes = at;
  return v;
}

// Points the steps at the workspace.
void place(KdVpCall& v, const Workspace& w) {
  char* base = static_cast<char*>(w.ptr);
  const int64_t N = v.part.student.rows, W = v.comb.W;
  v.part.records = Mat{base, DType::F32, N, kKdRecordFields, kKdRecordFields};
  v.comb.records = Mat{base + v.gathered, DType::F32, W * N, kKdRecordFields, kKdRecordFields};
  const Mat stats = v.comb.row_stats ? v.comb.row_stats  // the caller's
                                      : Mat{base + v.stats, DType::F32, N, kKdRowStatsFields, kKdRowStatsFields};
  v.comb.row_stats = v.terms.row_stats = v.tcomb.row_stats = v.bwd.row_stats = stats;
  v.terms.records = Mat{base + v.trec, DType::F32, N, kKdTermsRecordFields, kKdTermsRecordFields};
  v.tcomb.records = Mat{base + v.tgathered, DType::F32, W * N, kKdTermsRecordFields, kKdTermsRecordFields};
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

FCE_API fce_status_t fce_kd_partial(fce_handle_t handle, fce_stream_t stream, const DLTensor* student,
                                    const fce_kd_teacher_t* teacher, const fce_kd_options_t* options,
                                    DLTensor* records) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const KdPartialProblem p = kd_partial_problem(h, student, teacher, options, records);
    if (h->backend == Backend::CPU) cpu::kd_partial(p);
    else cuda::kd_partial(h, stream, p);
  });
}

FCE_API fce_status_t fce_kd_combine(fce_handle_t handle, fce_stream_t stream, const DLTensor* records,
                                    const DLTensor* targets, const fce_kd_options_t* options, DLTensor* loss,
                                    DLTensor* row_stats, void* workspace, size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const KdCombineProblem p = kd_combine_problem(h, records, targets, options, loss, row_stats);
    const Workspace w = resolve_workspace(h, workspace, workspace_bytes, kd_combine_need(h, p), stream);
    if (h->backend == Backend::CPU) cpu::kd_combine(p);
    else cuda::kd_combine(h, stream, p, w);
  });
}

FCE_API fce_status_t fce_kd_combine_workspace_size(fce_handle_t handle, const DLTensor* records,
                                                   const DLTensor* targets, const fce_kd_options_t* options,
                                                   const DLTensor* loss, const DLTensor* row_stats, size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    write_size(bytes, kd_combine_need(h, kd_combine_problem(h, records, targets, options,
                                                            const_cast<DLTensor*>(loss),
                                                            const_cast<DLTensor*>(row_stats))));
  });
}

FCE_API fce_status_t fce_kd_terms_partial(fce_handle_t handle, fce_stream_t stream, const DLTensor* student,
                                          const fce_kd_teacher_t* teacher, const DLTensor* row_stats,
                                          const fce_kd_options_t* options, DLTensor* records) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const KdTermsPartialProblem p = kd_terms_partial_problem(h, student, teacher, row_stats, options, records);
    if (h->backend == Backend::CPU) cpu::kd_terms_partial(p);
    else cuda::kd_terms_partial(h, stream, p);
  });
}

FCE_API fce_status_t fce_kd_terms_combine(fce_handle_t handle, fce_stream_t stream, const DLTensor* records,
                                          const DLTensor* targets, const fce_kd_options_t* options, DLTensor* loss,
                                          DLTensor* row_stats, void* workspace, size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const KdCombineProblem p = kd_terms_combine_problem(h, records, targets, options, loss, row_stats);
    const Workspace w = resolve_workspace(h, workspace, workspace_bytes, kd_combine_need(h, p), stream);
    if (h->backend == Backend::CPU) cpu::kd_combine(p);
    else cuda::kd_combine(h, stream, p, w);
  });
}

FCE_API fce_status_t fce_kd_terms_combine_workspace_size(fce_handle_t handle, const DLTensor* records,
                                                         const DLTensor* targets, const fce_kd_options_t* options,
                                                         const DLTensor* loss, const DLTensor* row_stats,
                                                         size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    write_size(bytes, kd_combine_need(h, kd_terms_combine_problem(h, records, targets, options,
                                                                  const_cast<DLTensor*>(loss),
                                                                  const_cast<DLTensor*>(row_stats))));
  });
}

FCE_API fce_status_t fce_kd_bwd(fce_handle_t handle, fce_stream_t stream, const DLTensor* student,
                                const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                const DLTensor* row_stats, const fce_kd_options_t* options,
                                const DLTensor* grad_loss, DLTensor* dstudent, void* workspace,
                                size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const KdBwdProblem p = kd_bwd_problem(h, student, teacher, targets, row_stats, options, grad_loss, dstudent);
    const Workspace w = resolve_workspace(h, workspace, workspace_bytes, kd_bwd_need(h, p), stream);
    if (h->backend == Backend::CPU) cpu::kd_bwd(p);
    else cuda::kd_bwd(h, stream, p, w);
  });
}

FCE_API fce_status_t fce_kd_bwd_workspace_size(fce_handle_t handle, const DLTensor* student,
                                               const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                               const DLTensor* row_stats, const fce_kd_options_t* options,
                                               const DLTensor* grad_loss, const DLTensor* dstudent,
                                               size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    write_size(bytes, kd_bwd_need(h, kd_bwd_problem(h, student, teacher, targets, row_stats, options, grad_loss,
                                                    dstudent)));
  });
}

FCE_API fce_status_t fce_kd_fwd_vp(fce_handle_t handle, fce_comm_t comm, fce_stream_t stream, const DLTensor* student,
                                   const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                   const fce_kd_options_t* options, const fce_kd_outputs_t* outputs,
                                   DLTensor* row_stats, void* workspace, size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_comm* c = checked_comm(h, comm);
    KdVpCall v = kd_vp_call(h, c, student, teacher, targets, options, outputs, row_stats);
    const Workspace w = resolve_workspace(h, workspace, workspace_bytes, v.bytes, stream);
    place(v, w);
    char* base = static_cast<char*>(w.ptr);
    const Workspace comb_ws{base + v.comb_ws, v.bwd_ws - v.comb_ws};
    const size_t N = size_t(v.part.student.rows);
    cuda::kd_partial(h, stream, v.part);
    cuda::comm_all_gather(c, stream, v.part.records.data, v.comb.records.data, N * kKdRecordFields);
    cuda::kd_combine(h, stream, v.comb, comb_ws);
    if (v.two) {
      cuda::kd_terms_partial(h, stream, v.terms);
      cuda::comm_all_gather(c, stream, v.terms.records.data, v.tcomb.records.data, N * kKdTermsRecordFields);
      cuda::kd_combine(h, stream, v.tcomb, comb_ws);
    }
    if (v.bwd.dstudent) cuda::kd_bwd(h, stream, v.bwd, Workspace{base + v.bwd_ws, v.bytes - v.bwd_ws});
  });
}

FCE_API fce_status_t fce_kd_fwd_vp_workspace_size(fce_handle_t handle, fce_comm_t comm, const DLTensor* student,
                                                  const fce_kd_teacher_t* teacher, const DLTensor* targets,
                                                  const fce_kd_options_t* options, const fce_kd_outputs_t* outputs,
                                                  const DLTensor* row_stats, size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_comm* c = checked_comm(h, comm);
    write_size(bytes, kd_vp_call(h, c, student, teacher, targets, options, outputs, row_stats).bytes);
  });
}

}  // extern "C"
