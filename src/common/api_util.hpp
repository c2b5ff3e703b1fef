// Pieces of argument validation shared by several entry points.
#pragma once
#include <cmath>

#include "common/error.hpp"
#include "common/handle.hpp"
#include "common/ops.hpp"

namespace fce {

// Options/outputs structs start with struct_size; a caller built against a newer header may pass a
// larger struct (its extra fields are ignored), a smaller one is rejected.
template <class T>
const T& checked_struct(const T* p, const char* name) {
  FCE_CHECK(p != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s is NULL", name);
  FCE_CHECK(p->struct_size >= sizeof(T), FCE_STATUS_INVALID_ARGUMENT,
            "%s->struct_size is %u; expected at least %zu (use the _INIT macro)", name, unsigned(p->struct_size),
            sizeof(T));
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
