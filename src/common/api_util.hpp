// Pieces of argument validation shared by several entry points.
#pragma once
#include <cmath>
#include <cstddef>
#include <cstring>
#include <initializer_list>

#include "common/error.hpp"
#include "common/handle.hpp"
#include "common/ops.hpp"

namespace fce {

// Per struct with a struct_size: its C name (for messages), its defaults (the header's _INIT macro) and its
// first published size, the smallest struct_size the library takes (a struct that grows keeps its old
// size here; every struct still has its first layout).
#define FCE_STRUCT_TRAITS(T, INIT)                                          \
  inline const char* struct_name(const T*) { return #T; }                  \
  inline T struct_defaults(const T*) { return T(INIT); }                   \
  constexpr size_t struct_first_size(const T*) { return sizeof(T); }
FCE_STRUCT_TRAITS(fce_ce_bwd_inputs_t, FCE_CE_BWD_INPUTS_INIT)
FCE_STRUCT_TRAITS(fce_kd_teacher_t, FCE_KD_TEACHER_INIT)
FCE_STRUCT_TRAITS(fce_kd_outputs_t, FCE_KD_OUTPUTS_INIT)
// Grown in 0.2.0 (vocab_start, vocab_total): 0.1.0's struct ends at class_weights.
inline const char* struct_name(const fce_ce_options_t*) { return "fce_ce_options_t"; }
inline fce_ce_options_t struct_defaults(const fce_ce_options_t*) { return fce_ce_options_t(FCE_CE_OPTIONS_INIT); }
constexpr size_t struct_first_size(const fce_ce_options_t*) { return offsetof(fce_ce_options_t, vocab_start); }
// Grown in 0.2.0 (grad_entropy): 0.1.0's struct ends at grad_loss.
inline const char* struct_name(const fce_ce_outputs_t*) { return "fce_ce_outputs_t"; }
inline fce_ce_outputs_t struct_defaults(const fce_ce_outputs_t*) { return fce_ce_outputs_t(FCE_CE_OUTPUTS_INIT); }
constexpr size_t struct_first_size(const fce_ce_outputs_t*) { return offsetof(fce_ce_outputs_t, grad_entropy); }
// Grown in 0.2.0 (flags, grad_entropy, saved_entropy): 0.1.0's struct ends at grad_loss.
inline const char* struct_name(const fce_linear_ce_outputs_t*) { return "fce_linear_ce_outputs_t"; }
inline fce_linear_ce_outputs_t struct_defaults(const fce_linear_ce_outputs_t*) {
  return fce_linear_ce_outputs_t(FCE_LINEAR_CE_OUTPUTS_INIT);
}
constexpr size_t struct_first_size(const fce_linear_ce_outputs_t*) { return offsetof(fce_linear_ce_outputs_t, flags); }
// Grown in 0.2.0 (vocab_start, vocab_total): 0.1.0's struct ends at scale.
inline const char* struct_name(const fce_lse_options_t*) { return "fce_lse_options_t"; }
inline fce_lse_options_t struct_defaults(const fce_lse_options_t*) { return fce_lse_options_t(FCE_LSE_OPTIONS_INIT); }
constexpr size_t struct_first_size(const fce_lse_options_t*) { return offsetof(fce_lse_options_t, vocab_start); }
// Grown in 0.2.0 (vocab_start, vocab_total, lse): 0.1.0's struct ends at temperatures.
inline const char* struct_name(const fce_softmax_options_t*) { return "fce_softmax_options_t"; }
inline fce_softmax_options_t struct_defaults(const fce_softmax_options_t*) {
  return fce_softmax_options_t(FCE_SOFTMAX_OPTIONS_INIT);
}
constexpr size_t struct_first_size(const fce_softmax_options_t*) {
  return offsetof(fce_softmax_options_t, vocab_start);
}
// Grown in 0.2.0 (vocab_start, vocab_total): 0.1.0's struct ends at ignore_index.
inline const char* struct_name(const fce_kd_options_t*) { return "fce_kd_options_t"; }
inline fce_kd_options_t struct_defaults(const fce_kd_options_t*) { return fce_kd_options_t(FCE_KD_OPTIONS_INIT); }
constexpr size_t struct_first_size(const fce_kd_options_t*) { return offsetof(fce_kd_options_t, vocab_start); }
FCE_STRUCT_TRAITS(fce_build_info_t, FCE_BUILD_INFO_INIT)
#undef FCE_STRUCT_TRAITS

// A struct_size the library takes for T: from T's first published size up to FCE_MAX_STRUCT_SIZE.
template <class T>
uint32_t checked_struct_size(const T* p, size_t size, const char* name) {
  FCE_CHECK(size >= struct_first_size(p), FCE_STATUS_INVALID_ARGUMENT,
            "%s->struct_size is %zu, below the %zu bytes of %s (initialize it with its _INIT macro or init "
            "function)", name, size, struct_first_size(p), struct_name(p));
  FCE_CHECK(size <= FCE_MAX_STRUCT_SIZE, FCE_STATUS_INVALID_ARGUMENT,
            "%s->struct_size is %zu, above FCE_MAX_STRUCT_SIZE (%d): not a %s", name, size, FCE_MAX_STRUCT_SIZE,
            struct_name(p));
  return uint32_t(size);
}

// The header's rule for a struct the library reads (the rule Linux applies to growing syscall structs): a
// smaller struct_size (an older header) gets the defaults for the fields it lacks; a larger one (a newer
// header) only when every byte past this library's struct is zero, i.e. the newer fields hold their
// defaults. Returns the struct as this library knows it.
template <class T>
T checked_struct(const T* p, const char* name) {
  FCE_CHECK(p != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s is NULL", name);
  const uint32_t size = checked_struct_size(p, p->struct_size, name);
  // A smaller struct is an older header's: exactly one of its published sizes, never one that cuts a field
  // (half a pointer would be read as an address).
  FCE_CHECK(size >= sizeof(T) || size == struct_first_size(p), FCE_STATUS_INVALID_ARGUMENT,
            "%s->struct_size is %u: not a size %s has had (%zu in its first release, %zu now)", name, unsigned(size),
            struct_name(p), struct_first_size(p), sizeof(T));
  const unsigned char* bytes = reinterpret_cast<const unsigned char*>(p);
  for (size_t i = sizeof(T); i < size; ++i)
    FCE_CHECK(bytes[i] == 0, FCE_STATUS_INVALID_ARGUMENT,
              "%s->struct_size is %u, larger than the %zu bytes of %s in libfusedce %s, and byte %zu past them "
              "is not zero: it sets an option this library does not have (use a newer libfusedce, or leave "
              "the newer fields at their defaults)", name, unsigned(size), sizeof(T), struct_name(p),
              fce_version_string(), i);
  T r = struct_defaults(p);
  std::memcpy(&r, p, size < sizeof(T) ? size : sizeof(T));
  r.struct_size = uint32_t(sizeof(T));
  return r;
}

inline bool finite(float x) { return std::isfinite(x); }

// Validates cross-entropy options against a vocabulary of V: ce_option_values, then the class weights.
CeOpts read_ce_options(const fce_ce_options_t* options, Validator& val, int64_t V);
// Validates the values of cross-entropy options (struct_size already checked by checked_struct): every option
// but the class-weights tensor, whose device and length only a call with tensors can check.
CeOpts ce_option_values(const fce_ce_options_t& options);

// Validates the statistic outputs shared by cross-entropy and linear cross-entropy.
struct CeStatOutputs {
  Vec loss, lse, z_loss, argmax, entropy;
};
CeStatOutputs read_ce_stat_outputs(Validator& val, int reduction, int64_t N, DLTensor* loss, DLTensor* lse,
                                   DLTensor* z_loss, DLTensor* argmax, DLTensor* entropy, bool loss_required);
// Copies the statistic outputs into a problem (CeProblem, LinearCeProblem, CeCombineProblem).
template <class P>
void take_stat_outputs(P& p, const CeStatOutputs& s) {
  p.loss = s.loss;
  p.lse = s.lse;
  p.z_loss = s.z_loss;
  p.argmax = s.argmax;
  p.entropy = s.entropy;
}

// Upstream gradient: scalar for SUM/MEAN, scalar or [N] for NONE.
Vec read_grad_loss(Validator& val, const DLTensor* g, int reduction, int64_t N);
// Upstream gradient of the entropy (`name`): fp32 scalar or [N]; empty for NULL.
Vec read_grad_entropy(Validator& val, const DLTensor* g, const char* name, int64_t N);
// A saved [N] fp32 input (`name`): the forward's entropy.
Vec read_saved_rows(Validator& val, const DLTensor* t, const char* name, int64_t N);
// A saved lse (`name`): [N] fp32 or its pairs [N, 2] (Validator::lse).
Vec read_saved_lse(Validator& val, const DLTensor* t, const char* name, int64_t N);
// A forward's fused gradient (outputs->dlogits, of the logits' shape and dtype, in place allowed) and its
// grad_loss, into p (p.logits, p.o set); nothing when outputs->dlogits is NULL.
void read_fused_dlogits(Validator& val, const fce_ce_outputs_t& out, CeProblem& p);
// The options of a vocabulary-shard call `fn`: options required, vocab_total set and at most 2^31 - 1 (the
// records hold int32 indices).
CeOpts sharded_options(Validator& val, const fce_ce_options_t* options, int64_t V, const char* fn);

// A vocabulary shard's options->vocab_start and vocab_total: 0 <= vocab_start <= vocab_total <= 2^31 - 1
// (vocab_start == vocab_total: a shard of padding alone), or both 0 (no shard).
void check_vocab_shard(int64_t vocab_start, int64_t vocab_total);

// Every rank's records of a vocabulary-parallel combine: a contiguous [W, N, K] fp32 tensor with K one of
// `widths` (W, N >= 1), as the [W * N, K] matrix it is (an input).
Mat read_gathered_records(Validator& val, const DLTensor* records, std::initializer_list<int64_t> widths, int64_t* W,
                          int64_t* N);

// The targets vector [N].
Vec read_targets(Validator& val, const DLTensor* t, const char* name, int64_t N);

// Checks that `m` has exactly `rows` x `cols`.
void expect_shape(const Mat& m, const char* name, int64_t rows, int64_t cols);

}  // namespace fce
