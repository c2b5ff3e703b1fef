// The public header compiles as C++ (-pedantic -Werror), with C linkage for every entry point.
#include <fusedce/fusedce.h>

#include <cstdio>
#include <type_traits>

static_assert(std::is_same<decltype(&fce_cross_entropy_fwd),
                           fce_status_t (*)(fce_handle_t, fce_stream_t, const DLTensor*, const DLTensor*,
                                            const fce_ce_options_t*, const fce_ce_outputs_t*, void*, size_t)>::value,
              "signature");
static_assert(FCE_STATUS_SUCCESS == 0 && FCE_STATUS_INTERNAL_ERROR == 14 && FCE_STATUS_COMMUNICATOR_ERROR == 15 &&
                  FCE_STATUS_HANDLE_BUSY == 16,
              "pinned status values");

int main() {
  fce_ce_options_t ce = FCE_CE_OPTIONS_INIT;
  std::printf("C++ header check: struct_size %u, libfusedce %s\n", ce.struct_size, fce_version_string());
  return ce.struct_size == sizeof ce ? 0 : 1;
}
