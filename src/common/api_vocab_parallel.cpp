// Vocabulary-parallel cross-entropy: validation of the partial and combine calls (the header's
// "Vocabulary-parallel cross-entropy"); the shard's gradient is fce_cross_entropy_bwd (api_cross_entropy.cpp).
#include <string>

#include "common/api_util.hpp"

using namespace fce;

CeOpts fce::sharded_options(Validator& val, const fce_ce_options_t* options, int64_t V, const char* fn) {
  FCE_CHECK(options != nullptr, FCE_STATUS_INVALID_ARGUMENT, "options is NULL: %s needs options->vocab_total",
            fn);
  CeOpts o = read_ce_options(options, val, V);
  FCE_CHECK(o.sharded(), FCE_STATUS_INVALID_ARGUMENT,
            "options->vocab_total is 0: %s is for a vocabulary shard (set vocab_start and vocab_total)", fn);
  FCE_CHECK(o.vocab_total <= INT32_MAX, FCE_STATUS_INVALID_ARGUMENT,
            "options->vocab_total %lld is above 2^31 - 1 (records hold int32 indices)", (long long)o.vocab_total);
  return o;
}

void fce::check_vocab_shard(int64_t vocab_start, int64_t vocab_total) {
  FCE_CHECK(vocab_total >= 0, FCE_STATUS_INVALID_ARGUMENT, "options->vocab_total %lld is negative",
            (long long)vocab_total);
  if (vocab_total == 0) {
    FCE_CHECK(vocab_start == 0, FCE_STATUS_INVALID_ARGUMENT,
              "options->vocab_start is %lld without a vocab_total (0: not sharded)", (long long)vocab_start);
  } else {
    // vocab_start == vocab_total: a shard of padding alone (Megatron pads a small vocabulary to a multiple
    // of the ranks), whose records are neutral.
    FCE_CHECK(vocab_start >= 0 && vocab_start <= vocab_total, FCE_STATUS_INVALID_ARGUMENT,
              "options->vocab_start %lld is outside [0, vocab_total = %lld]", (long long)vocab_start,
              (long long)vocab_total);
    FCE_CHECK(vocab_total <= INT32_MAX, FCE_STATUS_INVALID_ARGUMENT,
              "options->vocab_total %lld is above 2^31 - 1 (the records hold int32 column indices)",
              (long long)vocab_total);
  }
}

Mat fce::read_gathered_records(Validator& val, const DLTensor* records, std::initializer_list<int64_t> widths,
                               int64_t* W_out, int64_t* N_out) {
  FCE_CHECK(records != nullptr, FCE_STATUS_INVALID_ARGUMENT, "records is NULL");
  FCE_CHECK(records->ndim == 3, FCE_STATUS_SHAPE_MISMATCH, "records must be 3-D [W, N, K], has ndim %d",
            records->ndim);
  FCE_CHECK(records->shape != nullptr, FCE_STATUS_INVALID_ARGUMENT, "records has a NULL shape");
  const int64_t W = records->shape[0], N = records->shape[1], K = records->shape[2];
  bool width = false;
  std::string allowed;
  for (int64_t k : widths) {
    width = width || K == k;
    allowed += (allowed.empty() ? "" : " or ") + std::to_string(k);
  }
  FCE_CHECK(W >= 1 && N >= 1 && width, FCE_STATUS_SHAPE_MISMATCH,
            "records has shape [%lld, %lld, %lld]; expected [W >= 1, N >= 1, K] with K = %s", (long long)W,
            (long long)N, (long long)K, allowed.c_str());
  if (records->strides) {
    const int64_t* st = records->strides;
    FCE_CHECK(st[2] == 1 && (N == 1 || st[1] == K) && (W == 1 || st[0] == N * K), FCE_STATUS_UNSUPPORTED_LAYOUT,
              "records must be contiguous [W, N, K] (strides [%lld, %lld, %lld])", (long long)st[0],
              (long long)st[1], (long long)st[2]);
  }
  FCE_CHECK(W <= INT64_MAX / N, FCE_STATUS_OVERFLOW, "records: W * N overflows");
  DLTensor flat = *records;  // [W * N, K]: every check of a matrix applies
  int64_t shape[2] = {W * N, K};
  flat.ndim = 2;
  flat.shape = shape;
  flat.strides = nullptr;
  Mat m = val.matrix(&flat, "records", kF32);
  val.input("records", m.data, Validator::span(m));
  *W_out = W;
  *N_out = N;
  return m;
}

namespace {

size_t combine_need(fce_handle* h, const CeCombineProblem& p) {
  return h->backend == Backend::CPU ? 0 : cuda::ce_combine_workspace(h, p);
}

CePartialProblem partial_problem(fce_handle* h, const DLTensor* logits, const DLTensor* targets,
                                 const fce_ce_options_t* options, DLTensor* records) {
  Validator val(h->backend, h->device_id);
  CePartialProblem p;
  p.logits = val.matrix(logits, "logits", kFloats);
  val.input("logits", p.logits.data, Validator::span(p.logits));
  const int64_t N = p.logits.rows;
  p.targets = read_targets(val, targets, "targets", N);
  p.o = sharded_options(val, options, p.logits.cols, "fce_cross_entropy_partial");
  p.records = val.matrix(records, "records", kF32);
  FCE_CHECK(p.records.rows == N && ce_record_width_ok(p.records.cols), FCE_STATUS_SHAPE_MISMATCH,
            "records has shape [%lld, %lld]; expected [%lld, K] with K = %lld, %lld or %lld (the record widths)",
            (long long)p.records.rows, (long long)p.records.cols, (long long)N, (long long)kCeRecordLoss,
            (long long)kCeRecordEntropy, (long long)kCeRecordFields);
  val.output("records", p.records.data, Validator::span(p.records));
  return p;
}

CeCombineProblem combine_problem(fce_handle* h, const DLTensor* records, const DLTensor* targets,
                                 const fce_ce_options_t* options, const fce_ce_outputs_t* outputs) {
  Validator val(h->backend, h->device_id);
  CeCombineProblem p;
  int64_t W = 0, N = 0;
  p.records = read_gathered_records(val, records, {kCeRecordLoss, kCeRecordEntropy, kCeRecordFields}, &W, &N);
  const int64_t K = p.records.cols;
  p.W = W;
  p.targets = read_targets(val, targets, "targets", N);
  p.o = sharded_options(val, options, /*V, unused with a shard=*/1, "fce_cross_entropy_combine");
  const fce_ce_outputs_t out = checked_struct(outputs, "outputs");
  FCE_CHECK(!out.dlogits && !out.grad_loss && !out.grad_entropy, FCE_STATUS_INVALID_ARGUMENT,
            "outputs->dlogits, grad_loss and grad_entropy must be NULL: a shard's gradient comes from "
            "fce_cross_entropy_bwd or fce_cross_entropy_bwd_ex "
            "with the combined lse");
  FCE_CHECK(!out.entropy || K >= kCeRecordEntropy, FCE_STATUS_INVALID_ARGUMENT,
            "outputs->entropy needs records of at least %lld fields (these have %lld)", (long long)kCeRecordEntropy,
            (long long)K);
  FCE_CHECK(!out.argmax || K == kCeRecordFields, FCE_STATUS_INVALID_ARGUMENT,
            "outputs->argmax needs records of %lld fields (these have %lld)", (long long)kCeRecordFields,
            (long long)K);
  CeStatOutputs s = read_ce_stat_outputs(val, p.o.reduction, N, out.loss, out.lse, out.z_loss, out.argmax,
                                         out.entropy, true);
  take_stat_outputs(p, s);
  return p;
}

}  // namespace

extern "C" {

FCE_API fce_status_t fce_cross_entropy_record_fields(const fce_ce_options_t* options, int64_t* fields) {
  return guard(__func__, [&] {
    FCE_CHECK(fields != nullptr, FCE_STATUS_INVALID_ARGUMENT, "fields is NULL");
    if (options) ce_option_values(checked_struct(options, "options"));  // the other CE calls' checks
    *fields = kCeRecordFields;
  });
}

FCE_API fce_status_t fce_cross_entropy_partial(fce_handle_t handle, fce_stream_t stream, const DLTensor* logits,
                                               const DLTensor* targets, const fce_ce_options_t* options,
                                               DLTensor* records) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const CePartialProblem p = partial_problem(h, logits, targets, options, records);
    if (h->backend == Backend::CPU) cpu::ce_partial(p);
    else cuda::ce_partial(h, stream, p);
  });
}

FCE_API fce_status_t fce_cross_entropy_combine(fce_handle_t handle, fce_stream_t stream, const DLTensor* records,
                                               const DLTensor* targets, const fce_ce_options_t* options,
                                               const fce_ce_outputs_t* outputs, void* workspace,
                                               size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const CeCombineProblem p = combine_problem(h, records, targets, options, outputs);
    const Workspace w = resolve_workspace(h, workspace, workspace_bytes, combine_need(h, p), stream);
    if (h->backend == Backend::CPU) cpu::ce_combine(p);
    else cuda::ce_combine(h, stream, p, w);
  });
}

FCE_API fce_status_t fce_cross_entropy_combine_workspace_size(fce_handle_t handle, const DLTensor* records,
                                                              const DLTensor* targets,
                                                              const fce_ce_options_t* options,
                                                              const fce_ce_outputs_t* outputs, size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    write_size(bytes, combine_need(h, combine_problem(h, records, targets, options, outputs)));
  });
}

}  // extern "C"
