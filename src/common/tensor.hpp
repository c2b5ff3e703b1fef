// Validated views of borrowed DLTensors, shared by every backend (one validation layer).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "fusedce/fusedce.h"

namespace fce {

enum class DType : int { F32, BF16, F16, I32, I64 };

inline bool is_float(DType t) { return t == DType::F32 || t == DType::BF16 || t == DType::F16; }
size_t dtype_size(DType t);
const char* dtype_name(DType t);

// Device kinds a handle can have.
enum class Backend : int { CPU = kDLCPU, CUDA = kDLCUDA };

// A matrix [rows, cols] with unit column stride and row stride `ld` (elements).
struct Mat {
  char* data = nullptr;  // first element (byte_offset applied)
  DType dtype = DType::F32;
  int64_t rows = 0, cols = 0, ld = 0;
  explicit operator bool() const { return data != nullptr; }
  size_t row_bytes_span() const;  // bytes from first to one past last element
};

// A vector [n] with unit stride, or a scalar (n == 1, `scalar` set); `pair`: an lse tensor [n, 2] fp32,
// contiguous, holding each row's LsePair (src/common/math.hpp).
struct Vec {
  char* data = nullptr;
  DType dtype = DType::F32;
  int64_t n = 0;
  bool scalar = false;
  bool pair = false;
  explicit operator bool() const { return data != nullptr; }
};

// Which dtypes an argument accepts.
enum Accept : unsigned {
  kF32 = 1u << 0,
  kBF16 = 1u << 1,
  kF16 = 1u << 2,
  kI32 = 1u << 3,
  kI64 = 1u << 4,
  kFloats = kF32 | kBF16 | kF16,
  kInts = kI32 | kI64,
};

// Validation context for one call: the handle's device and the list of written ranges for the
// overlap check.
class Validator {
 public:
  Validator(Backend backend, int device_id) : backend_(backend), device_id_(device_id) {}

  // Throws fce::Error with a clear status on anything the op cannot take.
  Mat matrix(const DLTensor* t, const char* name, unsigned accept) const;
  Vec vector(const DLTensor* t, const char* name, unsigned accept) const;  // ndim 1
  Vec scalar(const DLTensor* t, const char* name, unsigned accept) const;  // ndim 0 or [1]
  // ndim 0 / [1] gives a scalar, otherwise [n] expected.
  Vec scalar_or_vector(const DLTensor* t, const char* name, unsigned accept, int64_t n) const;
  // An lse tensor of n rows: [n] fp32 (the plain lse) or [n, 2] fp32 contiguous (each row's LsePair).
  Vec lse(const DLTensor* t, const char* name, int64_t n) const;

  // Registers an output range; fails with ALIASING when it overlaps an input or output already
  // registered, unless it is exactly `may_equal` (same start, same layout).
  void output(const char* name, const void* begin, size_t bytes);
  void input(const char* name, const void* begin, size_t bytes);
  // The output may coincide exactly with input `same` (registered as `same_name`); any other overlap is an
  // error.
  void output_allow_exact(const char* name, const Mat& out, const Mat& same, const char* same_name);

  static size_t span(const Mat& m);
  static size_t span(const Vec& v);

 private:
  void check_device(const DLTensor* t, const char* name) const;
  struct Range {
    const char* name;
    uintptr_t begin, end;
    bool is_output;
  };
  Backend backend_;
  int device_id_;
  std::vector<Range> ranges_;
  void add(const char* name, const void* begin, size_t bytes, bool is_output, const char* exempt);
};

// Checked 64-bit arithmetic (throws OVERFLOW).
int64_t checked_mul(int64_t a, int64_t b, const char* what);
size_t checked_bytes(int64_t elems, size_t elem_size, const char* what);

}  // namespace fce
