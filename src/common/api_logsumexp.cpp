#include "common/api_util.hpp"
#include "common/comm.hpp"

using namespace fce;

namespace {

// Validated options: scale, and a shard's vocab_start and vocab_total.
fce_lse_options_t read_lse_options(const fce_lse_options_t* options) {
  const fce_lse_options_t o = checked_struct(options, "options");
  FCE_CHECK(finite(o.scale) && o.scale > 0.f, FCE_STATUS_INVALID_ARGUMENT,
            "options->scale %g must be finite and > 0", o.scale);
  check_vocab_shard(o.vocab_start, o.vocab_total);
  return o;
}

// A shard's x and options (fce_logsumexp_partial, fce_logsumexp_vp: `fn`); records left unset.
LsePartialProblem lse_shard_problem(Validator& val, const DLTensor* x, const fce_lse_options_t* options,
                                    const char* fn) {
  LsePartialProblem p;
  p.x = val.matrix(x, "x", kFloats);
  val.input("x", p.x.data, Validator::span(p.x));
  FCE_CHECK(options != nullptr, FCE_STATUS_INVALID_ARGUMENT, "options is NULL: %s needs options->vocab_total", fn);
  const fce_lse_options_t o = read_lse_options(options);
  FCE_CHECK(o.vocab_total > 0, FCE_STATUS_INVALID_ARGUMENT,
            "options->vocab_total is 0: %s is for a vocabulary shard (set vocab_start and vocab_total)", fn);
  p.scale = o.scale;
  p.vocab_start = o.vocab_start;
  p.vocab_total = o.vocab_total;
  return p;
}

LsePartialProblem lse_partial_problem(fce_handle* h, const DLTensor* x, const fce_lse_options_t* options,
                                      DLTensor* records) {
  Validator val(h->backend, h->device_id);
  LsePartialProblem p = lse_shard_problem(val, x, options, "fce_logsumexp_partial");
  p.records = val.matrix(records, "records", kF32);
  expect_shape(p.records, "records", p.x.rows, kLseRecordFields);
  val.output("records", p.records.data, Validator::span(p.records));
  return p;
}

LseCombineProblem lse_combine_problem(fce_handle* h, const DLTensor* records, DLTensor* lse) {
  Validator val(h->backend, h->device_id);
  LseCombineProblem p;
  int64_t W = 0, N = 0;
  p.records = read_gathered_records(val, records, {kLseRecordFields}, &W, &N);
  p.W = W;
  p.N = N;
  p.lse = val.lse(lse, "lse", N);
  val.output("lse", p.lse.data, Validator::span(p.lse));
  return p;
}

LseProblem lse_problem(fce_handle* h, const DLTensor* x, const fce_lse_options_t* options, const DLTensor* lse) {
  Validator val(h->backend, h->device_id);
  LseProblem p;
  p.x = val.matrix(x, "x", kFloats);
  val.input("x", p.x.data, Validator::span(p.x));
  if (options) {
    const fce_lse_options_t o = read_lse_options(options);
    FCE_CHECK(o.vocab_total == 0, FCE_STATUS_INVALID_ARGUMENT,
              "options->vocab_total is %lld: fce_logsumexp takes whole rows (a shard goes through "
              "fce_logsumexp_partial and fce_logsumexp_combine)", (long long)o.vocab_total);
    p.scale = o.scale;
  }
  p.lse = val.vector(lse, "lse", kF32);
  FCE_CHECK(p.lse.n == p.x.rows, FCE_STATUS_SHAPE_MISMATCH, "lse has length %lld; expected N = %lld",
            (long long)p.lse.n, (long long)p.x.rows);
  val.output("lse", p.lse.data, Validator::span(p.lse));
  return p;
}

// NCCL mode: this rank's records, then every rank's ([W * N, kLseRecordFields]) in the workspace.
struct LseVp {
  LsePartialProblem part;
  LseCombineProblem comb;
  size_t gathered = 0, bytes = 0;
};

LseVp lse_vp(fce_handle* h, const fce_comm* c, const DLTensor* x, const fce_lse_options_t* options,
             const DLTensor* lse) {
  Validator val(h->backend, h->device_id);
  LseVp v;
  v.part = lse_shard_problem(val, x, options, "fce_logsumexp_vp");
  FCE_CHECK(lse != nullptr, FCE_STATUS_INVALID_ARGUMENT, "lse is NULL");
  v.comb = lse_vp_combine(val, c, lse, v.part.x.rows, &v.gathered, &v.bytes);
  return v;
}

size_t lse_need(fce_handle* h, const LseProblem& p) {
  return h->backend == Backend::CPU ? cpu::lse_workspace(p) : cuda::lse_workspace(h, p);
}

}  // namespace

extern "C" {

FCE_API fce_status_t fce_logsumexp(fce_handle_t handle, fce_stream_t stream, const DLTensor* x,
                                   const fce_lse_options_t* options, DLTensor* lse, void* workspace,
                                   size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    LseProblem p = lse_problem(h, x, options, lse);
    Workspace w = resolve_workspace(h, workspace, workspace_bytes, lse_need(h, p), stream);
    if (h->backend == Backend::CPU) cpu::lse(p, w);
    else cuda::lse(h, stream, p, w);
  });
}

FCE_API fce_status_t fce_logsumexp_workspace_size(fce_handle_t handle, const DLTensor* x,
                                                  const fce_lse_options_t* options, const DLTensor* lse,
                                                  size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    write_size(bytes, lse_need(h, lse_problem(h, x, options, lse)));
  });
}

FCE_API fce_status_t fce_logsumexp_partial(fce_handle_t handle, fce_stream_t stream, const DLTensor* x,
                                           const fce_lse_options_t* options, DLTensor* records) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const LsePartialProblem p = lse_partial_problem(h, x, options, records);
    if (h->backend == Backend::CPU) cpu::lse_partial(p);
    else cuda::lse_partial(h, stream, p);
  });
}

FCE_API fce_status_t fce_logsumexp_combine(fce_handle_t handle, fce_stream_t stream, const DLTensor* records,
                                           DLTensor* lse) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const LseCombineProblem p = lse_combine_problem(h, records, lse);
    if (h->backend == Backend::CPU) cpu::lse_combine(p);
    else cuda::lse_combine(h, stream, p);
  });
}

FCE_API fce_status_t fce_logsumexp_vp(fce_handle_t handle, fce_comm_t comm, fce_stream_t stream, const DLTensor* x,
                                      const fce_lse_options_t* options, DLTensor* lse, void* workspace,
                                      size_t workspace_bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_comm* c = checked_comm(h, comm);
    LseVp v = lse_vp(h, c, x, options, lse);
    const Workspace w = resolve_workspace(h, workspace, workspace_bytes, v.bytes, stream);
    lse_vp_run(h, c, stream, v.part, v.comb, static_cast<char*>(w.ptr), v.gathered);
  });
}

FCE_API fce_status_t fce_logsumexp_vp_workspace_size(fce_handle_t handle, fce_comm_t comm, const DLTensor* x,
                                                     const fce_lse_options_t* options, const DLTensor* lse,
                                                     size_t* bytes) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    const fce_comm* c = checked_comm(h, comm);
    write_size(bytes, lse_vp(h, c, x, options, lse).bytes);
  });
}

}  // extern "C"
