#include <cmath>

#include "common/api_util.hpp"
#include "common/comm.hpp"

using namespace fce;

namespace {

Mat prob_output(Validator& val, const DLTensor* t, const char* name, const Mat& logits) {
  Mat m = val.matrix(t, name, kFloats);
  expect_shape(m, name, logits.rows, logits.cols);
  FCE_CHECK(m.dtype == DType::F32 || m.dtype == logits.dtype, FCE_STATUS_UNSUPPORTED_DTYPE,
            "%s is %s; it must be float32 or the logits' dtype %s", name, dtype_name(m.dtype), dtype_name(logits.dtype));
  return m;
}

// `vp`: the NCCL-mode call's name (fce_temp_softmax_vp), whose shard is required and whose lse it computes
// itself (p.lse left unset).
SoftmaxProblem softmax_problem(Validator& val, const DLTensor* logits, const fce_softmax_options_t* options,
                               const DLTensor* probs, const DLTensor* logprobs, const char* vp = nullptr) {
  SoftmaxProblem p;
  p.logits = val.matrix(logits, "logits", kFloats);
  val.input("logits", p.logits.data, Validator::span(p.logits));
  FCE_CHECK(options || !vp, FCE_STATUS_INVALID_ARGUMENT, "options is NULL: %s needs options->vocab_total", vp);
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
    FCE_CHECK(o.vocab_total > 0 || !vp, FCE_STATUS_INVALID_ARGUMENT,
              "options->vocab_total is 0: %s is for a vocabulary shard (set vocab_start and vocab_total)", vp);
    if (o.vocab_total > 0) {  // a shard: the probabilities of whole rows from their lse
      FCE_CHECK(!o.temperatures && std::isfinite(o.temperature) && o.temperature > 0.f,
                FCE_STATUS_NOT_IMPLEMENTED,
                "a vocabulary shard's softmax takes one finite temperature > 0 (per-row, greedy and infinite "
                "temperatures are not implemented over shards)");
      if (vp) {
        FCE_CHECK(o.lse == nullptr, FCE_STATUS_INVALID_ARGUMENT,
                  "options->lse is set: %s computes the whole rows' lse (its `lse` argument receives it)", vp);
      } else {
        FCE_CHECK(o.lse != nullptr, FCE_STATUS_INVALID_ARGUMENT,
                  "options->lse is NULL: a shard's softmax needs the whole rows' lse (fce_logsumexp_combine)");
        p.lse = read_saved_lse(val, o.lse, "options->lse", p.logits.rows);
      }
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

SoftmaxProblem softmax_problem(fce_handle* h, const DLTensor* logits, const fce_softmax_options_t* options,
                               const DLTensor* probs, const DLTensor* logprobs) {
  Validator val(h->backend, h->device_id);
  return softmax_problem(val, logits, options, probs, logprobs);
}

// NCCL mode: the shard's softmax, the lse's exchange (this rank's records, every rank's) and where the lse
// goes (the caller's, or the workspace after the records).
struct SoftmaxVp {
  SoftmaxProblem p;
  LsePartialProblem part;
  LseCombineProblem comb;
  size_t gathered = 0, lse = 0, bytes = 0;
};

SoftmaxVp softmax_vp(fce_handle* h, const fce_comm* c, const DLTensor* logits, const fce_softmax_options_t* options,
                     const DLTensor* probs, const DLTensor* logprobs, const DLTensor* lse) {
  Validator val(h->backend, h->device_id);
  SoftmaxVp v;
  v.p = softmax_problem(val, logits, options, probs, logprobs, "fce_temp_softmax_vp");
  const int64_t N = v.p.logits.rows;
  v.part.x = v.p.logits;
  v.part.scale = 1.f / v.p.temperature;  // the scale fce_temp_softmax's shard path divides by
  v.part.vocab_start = v.p.vocab_start;
  v.part.vocab_total = v.p.vocab_total;
  v.comb = lse_vp_combine(val, c, lse, N, &v.gathered, &v.lse);
  // The rows' pairs after the records, for the shard's softmax (formed from max-shifted values at any T)
  v.bytes = v.lse + vp_align(size_t(N) * 8);
  return v;
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

FCE_API fce_status_t fce_temp_softmax_vp(fce_handle_t handle, fce_comm_t comm, fce_stream_t stream,
                                         const DLTensor* logits, const fce_softmax_options_t* options,
                                         DLTensor* probs, DLTensor* logprobs, DLTensor* lse, void* workspace,
                                         size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_comm* c = checked_comm(h, comm);
    SoftmaxVp v = softmax_vp(h, c, logits, options, probs, logprobs, lse);
    const Workspace w = resolve_workspace(h, workspace, workspace_bytes, v.bytes, stream);
    char* base = static_cast<char*>(w.ptr);
    v.comb.pair = Vec{base + v.lse, DType::F32, v.comb.N, false, true};
    lse_vp_run(h, c, stream, v.part, v.comb, base, v.gathered);
    v.p.lse = v.comb.pair;
    cuda::softmax_shard(h, stream, v.p);
  });
}

FCE_API fce_status_t fce_temp_softmax_vp_workspace_size(fce_handle_t handle, fce_comm_t comm,
                                                        const DLTensor* logits,
                                                        const fce_softmax_options_t* options,
                                                        const DLTensor* probs, const DLTensor* logprobs,
                                                        const DLTensor* lse, size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_comm* c = checked_comm(h, comm);
    write_size(bytes, softmax_vp(h, c, logits, options, probs, logprobs, lse).bytes);
  });
}

}  // extern "C"
