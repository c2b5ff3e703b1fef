#include "common/error.hpp"

#include <cstdio>
#include <cstring>

namespace fce {
namespace {
thread_local std::string t_message;
}

void raise(fce_status_t status, const char* fmt, ...) {
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  throw Error{status, buf};
}

void set_error_message(const std::string& msg) { t_message = msg; }
void clear_error() { t_message.clear(); }

}  // namespace fce

extern "C" {

FCE_API const char* fce_status_string(fce_status_t status) {
  // Read as an int: a C caller may pass a code this build does not know, outside the enum's range.
  int code;
  std::memcpy(&code, &status, sizeof code);
  switch (code) {
    case FCE_STATUS_SUCCESS: return "success";
    case FCE_STATUS_INVALID_ARGUMENT: return "invalid argument";
    case FCE_STATUS_SHAPE_MISMATCH: return "shape mismatch";
    case FCE_STATUS_UNSUPPORTED_DTYPE: return "unsupported dtype";
    case FCE_STATUS_UNSUPPORTED_LAYOUT: return "unsupported layout (strides)";
    case FCE_STATUS_DEVICE_MISMATCH: return "tensor on another device than the handle";
    case FCE_STATUS_ALIASING: return "tensors overlap where aliasing is not allowed";
    case FCE_STATUS_OVERFLOW: return "size overflows 64-bit arithmetic";
    case FCE_STATUS_WORKSPACE_TOO_SMALL: return "workspace too small";
    case FCE_STATUS_NO_DEVICE: return "no usable CUDA device";
    case FCE_STATUS_NOT_IMPLEMENTED: return "not implemented by this backend";
    case FCE_STATUS_OUT_OF_MEMORY: return "out of memory";
    case FCE_STATUS_CUDA_ERROR: return "CUDA error";
    case FCE_STATUS_BLAS_ERROR: return "BLAS error";
    case FCE_STATUS_INTERNAL_ERROR: return "internal error";
    case FCE_STATUS_COMMUNICATOR_ERROR: return "communicator error";
    case FCE_STATUS_HANDLE_BUSY: return "handle in use by another thread";
  }
  return "unknown status";
}

FCE_API const char* fce_last_error_message(void) { return fce::t_message.c_str(); }

#define FCE_STR2(x) #x
#define FCE_STR(x) FCE_STR2(x)
FCE_API unsigned fce_version_number(void) { return FCE_VERSION_NUMBER; }
FCE_API const char* fce_version_string(void) {
  return FCE_STR(FCE_VERSION_MAJOR) "." FCE_STR(FCE_VERSION_MINOR) "." FCE_STR(FCE_VERSION_PATCH);
}
FCE_API unsigned fce_abi_version(void) { return FCE_ABI_VERSION; }

}  // extern "C"
