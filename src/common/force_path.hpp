// FCE_FORCE_PATH=<op>:<path>[,<op>:<path>...] makes an op's planner take the named path wherever that path
// can run the call (tests run every path of every op through it; A/B runs compare paths). Read at each
// call.
#pragma once
#include <cstddef>

namespace fce {

// The index in `names` (the op's paths, `count` of them) of the path FCE_FORCE_PATH forces for `op`, or -1.
// Throws INVALID_ARGUMENT when the variable names a path that `op` does not have.
int forced_path(const char* op, const char* const* names, size_t count);

template <size_t K>
int forced_path(const char* op, const char* const (&names)[K]) {
  return forced_path(op, names, K);
}

}  // namespace fce
