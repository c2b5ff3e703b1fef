#include <cmath>

#include "common/api_util.hpp"

using namespace fce;

namespace {

Mat prob_output(Validator& val, const DLTensor* t, const char* name, const Mat& logits) {
  Mat m = val.matrix(t, name, kFloats);
  expect_shape(m, name, logits.rows, logits.cols);
  FCE_CHECK(m.dtype == DType::F32 || m.dtype == logits.dtype, FCE_STATUS_UNSUPPORTED_DTYPE,
            "%s is %s; it must be float32 or the logits' dtype %s", name, dtype_name(m.dtype), dtype_name(logits.dtype));
  return m;
}

SoftmaxProblem softmax_problem(fce_handle* h, const DLTensor* logits, const fce_softmax_options_t* options,
                               const DLTensor* probs, const DLTensor* logprobs) {
  Validator val(h->backend, h->device_id);
  SoftmaxProblem p;
  p.logits = val.matrix(logits, "logits", kFloats);
  val.input("logits", p.logits.data, Validator::span(p.logits));
  if (options) {
    const fce_softmax_options_t o = checked_struct(options, "options");
    if (o.temperatures) {
      p.temperatures = val.vector(o.temperatures, "options->temperatures", kF32);
      FCE_CHECK(p.temperatures.n == p.logits.rows, FCE_STATUS_SHAPE_MISMATCH,
                "options->temperatures has length %lld; expected N = %lld", (long long)p.temperatures.n,
                (long long)p.logits.rows);
      val.input("options->temperatures", p.temperatures.data, Validator::span(p.temperatures));
    } else {
      FCE_CHECK(!std::isnan(o.temperature) && o.temperature >= 0.f, FCE_STATUS_INVALID_ARGUMENT,
                "options->temperature %g must be >= 0 (0 = greedy)", o.temperature);
      p.temperature = o.temperature;
    }
    check_vocab_shard(o.vocab_start, o.vocab_total);
    if (o.vocab_total > 0) {  // a shard: the probabilities of whole rows from their lse
      FCE_CHECK(!o.temperatures && std::isfinite(o.temperature) && o.temperature > 0.f,
                FCE_STATUS_NOT_IMPLEMENTED,
                "a vocabulary shard's softmax takes one finite temperature > 0 (per-row, greedy and infinite "
                "temperatures are not implemented over shards)");
      FCE_CHECK(o.lse != nullptr, FCE_STATUS_INVALID_ARGUMENT,
                "options->lse is NULL: a shard's softmax needs the whole rows' lse (fce_logsumexp_combine)");
      p.lse = val.vector(o.lse, "options->lse", kF32);
      FCE_CHECK(p.lse.n == p.logits.rows, FCE_STATUS_SHAPE_MISMATCH, "options->lse has length %lld; expected N = %lld",
                (long long)p.lse.n, (long long)p.logits.rows);
      val.input("options->lse", p.lse.data, Validator::span(p.lse));
      p.vocab_start = o.vocab_start;
      p.vocab_total = o.vocab_total;
    }
  }
  FCE_CHECK(probs || logprobs, FCE_STATUS_INVALID_ARGUMENT, "probs and logprobs are both NULL");
  if (probs) {
    p.probs = prob_output(val, probs, "probs", p.logits);
    val.output_allow_exact("probs", p.probs, p.logits, "logits");
  }
  if (logprobs) {
    p.logprobs = prob_output(val, logprobs, "logprobs", p.logits);
    // In place over the logits only when it is the one output (the header's rule).
    if (probs) val.output("logprobs", p.logprobs.data, Validator::span(p.logprobs));
    else val.output_allow_exact("logprobs", p.logprobs, p.logits, "logits");
  }
  return p;
}

size_t softmax_need(fce_handle* h, const SoftmaxProblem& p) {
  if (p.vocab_total > 0) return 0;  // a shard: one elementwise pass
  return h->backend == Backend::CPU ? cpu::softmax_workspace(p) : cuda::softmax_workspace(h, p);
}

}  // namespace

extern "C" {

FCE_API fce_status_t fce_temp_softmax(fce_handle_t handle, fce_stream_t stream, const DLTensor* logits,
                                      const fce_softmax_options_t* options, DLTensor* probs,
                                      DLTensor* logprobs, void* workspace, size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    SoftmaxProblem p = softmax_problem(h, logits, options, probs, logprobs);
    Workspace w = resolve_workspace(h, workspace, workspace_bytes, softmax_need(h, p), stream);
    if (p.vocab_total > 0) {
      if (h->backend == Backend::CPU) cpu::softmax_shard(p);
      else cuda::softmax_shard(h, stream, p);
    } else if (h->backend == Backend::CPU) {
      cpu::softmax(p, w);
    } else {
      cuda::softmax(h, stream, p, w);
    }
  });
}

FCE_API fce_status_t fce_temp_softmax_workspace_size(fce_handle_t handle, const DLTensor* logits,
                                                     const fce_softmax_options_t* options,
                                                     const DLTensor* probs, const DLTensor* logprobs,
                                                     size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    write_size(bytes, softmax_need(h, softmax_problem(h, logits, options, probs, logprobs)));
  });
}

}  // extern "C"
