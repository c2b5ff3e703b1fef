// Pieces of argument validation shared by several entry points.
#pragma once
#include <cmath>

#include "common/error.hpp"
#include "common/handle.hpp"
#include "common/ops.hpp"

namespace fce {

// The C name of each struct that carries a struct_size, for messages.
inline const char* struct_name(const fce_ce_options_t*) { return "fce_ce_options_t"; }
inline const char* struct_name(const fce_ce_outputs_t*) { return "fce_ce_outputs_t"; }
inline const char* struct_name(const fce_lse_options_t*) { return "fce_lse_options_t"; }
inline const char* struct_name(const fce_softmax_options_t*) { return "fce_softmax_options_t"; }
inline const char* struct_name(const fce_kd_options_t*) { return "fce_kd_options_t"; }
inline const char* struct_name(const fce_kd_teacher_t*) { return "fce_kd_teacher_t"; }
inline const char* struct_name(const fce_kd_outputs_t*) { return "fce_kd_outputs_t"; }
inline const char* struct_name(const fce_linear_ce_outputs_t*) { return "fce_linear_ce_outputs_t"; }
inline const char* struct_name(const fce_build_info_t*) { return "fce_build_info_t"; }

// struct_size of a struct the library reads or fills: at least the struct this library knows, at most
// FCE_MAX_STRUCT_SIZE.
template <class T>
uint32_t checked_struct_size(const T* p, const char* name) {
  FCE_CHECK(p != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s is NULL", name);
  const uint32_t size = p->struct_size;
  FCE_CHECK(size >= sizeof(T), FCE_STATUS_INVALID_ARGUMENT,
            "%s->struct_size is %u; %s has %zu bytes in libfusedce %s (initialize it with its _INIT macro or "
            "init function)", name, unsigned(size), struct_name(p), sizeof(T), fce_version_string());
  FCE_CHECK(size <= FCE_MAX_STRUCT_SIZE, FCE_STATUS_INVALID_ARGUMENT,
            "%s->struct_size is %u, above FCE_MAX_STRUCT_SIZE (%d): not a %s", name, unsigned(size),
            FCE_MAX_STRUCT_SIZE, struct_name(p));
  return size;
}

// The header's rule for a struct the library reads (the Linux rule for growing syscall structs): a larger
// struct_size (a caller built against a newer header) only when every byte past this library's struct is
// zero, i.e. the newer fields hold their defaults.
template <class T>
const T& checked_struct(const T* p, const char* name) {
  const uint32_t size = checked_struct_size(p, name);
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(p);
  for (size_t i = sizeof(T); i < size; ++i)
    FCE_CHECK(bytes[i] == 0, FCE_STATUS_INVALID_ARGUMENT,
              "%s->struct_size is %u, larger than the %zu bytes of %s in libfusedce %s, and byte %zu past them "
              "is not zero: it sets an option this library does not have (use a newer libfusedce, or leave "
              "the newer fields at their defaults)", name, unsigned(size), sizeof(T), struct_name(p),
              fce_version_string(), i);
  return *p;
}

inline bool finite(float x) { return std::isfinite(x); }

// Validates cross-entropy options against a vocabulary of V.
CeOpts read_ce_options(const fce_ce_options_t* options, Validator& val, int64_t V);

// Validates the statistic outputs shared by cross-entropy and linear cross-entropy.
struct CeStatOutputs {
  Vec loss, lse, z_loss, argmax, entropy;
};
CeStatOutputs read_ce_stat_outputs(Validator& val, int reduction, int64_t N, DLTensor* loss, DLTensor* lse,
                                   DLTensor* z_loss, DLTensor* argmax, DLTensor* entropy, bool loss_required);

// Upstream gradient: scalar for SUM/MEAN, scalar or [N] for NONE.
Vec read_grad_loss(Validator& val, const DLTensor* g, int reduction, int64_t N);

// The targets vector [N].
Vec read_targets(Validator& val, const DLTensor* t, const char* name, int64_t N);

// Checks that `m` has exactly `rows` x `cols`.
void expect_shape(const Mat& m, const char* name, int64_t rows, int64_t cols);

}  // namespace fce
