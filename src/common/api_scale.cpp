// fce_scale_rows: an upstream gradient applied after the fact, rows whose factor is 1 untouched.
#include "common/api_util.hpp"

using namespace fce;

extern "C" {

FCE_API fce_status_t fce_scale_rows(fce_handle_t handle, fce_stream_t stream, DLTensor* x, const DLTensor* factor) {
  return guard(__func__, [&] {
    fce_handle* h = check_handle(handle);
    Validator val(h->backend, h->device_id);
    ScaleProblem p;
    p.x = val.matrix(x, "x", kFloats);
    p.factor = val.scalar_or_vector(factor, "factor", kF32, p.x.rows);
    val.input("factor", p.factor.data, Validator::span(p.factor));
    val.output("x", p.x.data, Validator::span(p.x));
    if (h->backend == Backend::CPU) cpu::scale_rows(p);
    else cuda::scale_rows(h, stream, p);
  });
}

}  // extern "C"
