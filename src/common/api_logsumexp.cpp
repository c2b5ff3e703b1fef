#include "common/api_util.hpp"

using namespace fce;

namespace {

LseProblem lse_problem(fce_handle* h, const DLTensor* x, const fce_lse_options_t* options, const DLTensor* lse) {
  Validator val(h->backend, h->device_id);
  LseProblem p;
  p.x = val.matrix(x, "x", kFloats);
  val.input("x", p.x.data, Validator::span(p.x));
  if (options) {
    const fce_lse_options_t o = checked_struct(options, "options");
    FCE_CHECK(finite(o.scale) && o.scale > 0.f, FCE_STATUS_INVALID_ARGUMENT,
              "options->scale %g must be finite and > 0", o.scale);
    p.scale = o.scale;
  }
  p.lse = val.vector(lse, "lse", kF32);
  FCE_CHECK(p.lse.n == p.x.rows, FCE_STATUS_SHAPE_MISMATCH, "lse has length %lld; expected N = %lld",
            (long long)p.lse.n, (long long)p.x.rows);
  val.output("lse", p.lse.data, Validator::span(p.lse));
  return p;
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

}  // extern "C"
