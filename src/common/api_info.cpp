// Build information and the struct initializers for callers that cannot use the header's _INIT macros.
#include <cstddef>
#include <cstring>

#include "common/api_util.hpp"

using namespace fce;

namespace {

// Structs grow only at the end: with no tail padding, a newer header's first new field starts at or past
// this library's sizeof, where checked_struct looks for non-zero bytes.
#define FCE_NO_TAIL_PADDING(T, last) \
  static_assert(offsetof(T, last) + sizeof(T::last) == sizeof(T), #T " has tail padding")
FCE_NO_TAIL_PADDING(fce_ce_options_t, vocab_total);
FCE_NO_TAIL_PADDING(fce_ce_outputs_t, grad_entropy);
FCE_NO_TAIL_PADDING(fce_ce_bwd_inputs_t, grad_entropy);
FCE_NO_TAIL_PADDING(fce_lse_options_t, vocab_total);
FCE_NO_TAIL_PADDING(fce_softmax_options_t, lse);
FCE_NO_TAIL_PADDING(fce_kd_options_t, vocab_total);
FCE_NO_TAIL_PADDING(fce_kd_teacher_t, topk_logprobs);
FCE_NO_TAIL_PADDING(fce_kd_outputs_t, grad_loss);
FCE_NO_TAIL_PADDING(fce_linear_ce_outputs_t, saved_entropy);
FCE_NO_TAIL_PADDING(fce_build_info_t, cuda_architectures);
#undef FCE_NO_TAIL_PADDING

#ifndef FCE_CUDA_ARCHS
#define FCE_CUDA_ARCHS ""
#endif

// The fce_*_init functions: this library's defaults in the fields it knows, zeros past them, `size` in
// struct_size.
template <class T>
fce_status_t init(T* out, size_t size, const char* fn) {
  return guard(fn, [&] {
    FCE_CHECK(out != nullptr, FCE_STATUS_INVALID_ARGUMENT, "the struct pointer is NULL");
    checked_struct_size(out, size, "the struct");
    const T d = struct_defaults(out);
    unsigned char* bytes = reinterpret_cast<unsigned char*>(out);
    std::memcpy(bytes, &d, size < sizeof(T) ? size : sizeof(T));
    if (size > sizeof(T)) std::memset(bytes + sizeof(T), 0, size - sizeof(T));
    out->struct_size = uint32_t(size);
  });
}

}  // namespace

extern "C" {

FCE_API fce_status_t fce_build_info(fce_build_info_t* info) {
  return guard(__func__, [&] {
    FCE_CHECK(info != nullptr, FCE_STATUS_INVALID_ARGUMENT, "info is NULL");
    checked_struct_size(info, info->struct_size, "info");
    fce_build_info_t b = FCE_BUILD_INFO_INIT;
    b.version_number = FCE_VERSION_NUMBER;
    b.abi_version = FCE_ABI_VERSION;
#ifdef FCE_HAVE_CUDA
    b.cuda_backend = 1;
#endif
    cuda::build_versions(&b.cuda_runtime_version, &b.cublas_version);
    b.version_string = fce_version_string();
    b.cuda_architectures = FCE_CUDA_ARCHS;
    // Fields this library knows (all of a smaller, older struct's), zeros past them; struct_size kept.
    const uint32_t size = info->struct_size;
    unsigned char* bytes = reinterpret_cast<unsigned char*>(info);
    std::memcpy(bytes, &b, size < sizeof(b) ? size : sizeof(b));
    if (size > sizeof(b)) std::memset(bytes + sizeof(b), 0, size - sizeof(b));
    info->struct_size = size;
  });
}

FCE_API fce_status_t fce_ce_options_init(fce_ce_options_t* o, size_t n) { return init(o, n, __func__); }
FCE_API fce_status_t fce_ce_outputs_init(fce_ce_outputs_t* o, size_t n) { return init(o, n, __func__); }
FCE_API fce_status_t fce_ce_bwd_inputs_init(fce_ce_bwd_inputs_t* o, size_t n) { return init(o, n, __func__); }
FCE_API fce_status_t fce_lse_options_init(fce_lse_options_t* o, size_t n) { return init(o, n, __func__); }
FCE_API fce_status_t fce_softmax_options_init(fce_softmax_options_t* o, size_t n) { return init(o, n, __func__); }
FCE_API fce_status_t fce_kd_options_init(fce_kd_options_t* o, size_t n) { return init(o, n, __func__); }
FCE_API fce_status_t fce_kd_teacher_init(fce_kd_teacher_t* o, size_t n) { return init(o, n, __func__); }
FCE_API fce_status_t fce_kd_outputs_init(fce_kd_outputs_t* o, size_t n) { return init(o, n, __func__); }
FCE_API fce_status_t fce_linear_ce_outputs_init(fce_linear_ce_outputs_t* o, size_t n) {
  return init(o, n, __func__);
}

}  // extern "C"
