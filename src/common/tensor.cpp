#include "common/tensor.hpp"

#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>

#include "common/error.hpp"

namespace fce {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: return 2;
    case DType::I64: return 8;
  }
  return 0;
}

const char* dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
  }
  return "?";
}

int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t r;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) raise(FCE_STATUS_OVERFLOW, "%s overflows int64", what);
  return r;
}

size_t checked_bytes(int64_t elems, size_t elem_size, const char* what) {
  size_t r;
  if (elems < 0 || __builtin_mul_overflow(static_cast<size_t>(elems), elem_size, &r))
    raise(FCE_STATUS_OVERFLOW, "%s: byte count overflows", what);
  return r;
}

namespace {

const char* accepted(unsigned accept) {
  switch (accept) {
    case kFloats: return "float32, bfloat16 or float16";
    case kF32: return "float32";
    case kInts: return "int32 or int64";
    case kFloats | kInts: return "a float or int type";
    default: return "another dtype";
  }
}

// A DLPack dtype as frameworks name it ("float64", "uint8", "bool", "complex64", "float8_e4m3fn"; "float32x4"
// with 4 lanes), or its codes "(code 7, bits 3, lanes 2)" when it has no name. Codes as numbers: DLPack 0.6's
// header, the oldest the library builds with, lacks kDLBool (0.8) and the fp8, fp6 and fp4 codes (1.1).
std::string dtype_name(DLDataType d) {
  const unsigned code = d.code, bits = d.bits, lanes = d.lanes;
  auto sized = [bits](const char* base, std::initializer_list<unsigned> sizes) -> std::string {
    for (unsigned b : sizes)
      if (b == bits) return base + std::to_string(bits);
    return "";
  };
  static const char* const kFloat8[] = {"float8_e3m4",     "float8_e4m3",   "float8_e4m3b11fnuz",
                                        "float8_e4m3fn",   "float8_e4m3fnuz", "float8_e5m2",
                                        "float8_e5m2fnuz", "float8_e8m0fnu"};  // codes 7 to 14
  std::string n;
  if (code == kDLInt) n = sized("int", {8, 16, 32, 64});
  else if (code == kDLUInt) n = sized("uint", {8, 16, 32, 64});
  else if (code == kDLFloat) n = sized("float", {16, 32, 64});
  else if (code == kDLBfloat) n = sized("bfloat", {16});
  else if (code == kDLComplex) n = sized("complex", {32, 64, 128});
  else if (code == 6 && bits == 8) n = "bool";
  else if (code >= 7 && code <= 14 && bits == 8) n = kFloat8[code - 7];
  else if (code == 15 && bits == 6) n = "float6_e2m3fn";
  else if (code == 16 && bits == 6) n = "float6_e3m2fn";
  else if (code == 17 && bits == 4) n = "float4_e2m1fn";
  if (n.empty() || lanes == 0)
    return "(code " + std::to_string(code) + ", bits " + std::to_string(bits) + ", lanes " + std::to_string(lanes) +
           ")";
  return lanes == 1 ? n : n + "x" + std::to_string(lanes);
}

DType parse_dtype(const DLTensor* t, const char* name, unsigned accept) {
  const DLDataType d = t->dtype;
  DType r;
  bool ok = d.lanes == 1;
  if (d.code == kDLFloat && d.bits == 32) r = DType::F32;
  else if (d.code == kDLFloat && d.bits == 16) r = DType::F16;
  else if (d.code == kDLBfloat && d.bits == 16) r = DType::BF16;
  else if (d.code == kDLInt && d.bits == 32) r = DType::I32;
  else if (d.code == kDLInt && d.bits == 64) r = DType::I64;
  else ok = false;
  unsigned bit = ok ? (1u << static_cast<unsigned>(r)) : 0u;
  if (!ok || !(accept & bit))
    raise(FCE_STATUS_UNSUPPORTED_DTYPE, "%s has dtype %s; expected %s", name, dtype_name(d).c_str(),
          accepted(accept));
  return r;
}

char* base_pointer(const DLTensor* t, const char* name, DType dt) {
  FCE_CHECK(t->data != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s has a NULL data pointer", name);
  char* p = static_cast<char*>(t->data) + t->byte_offset;
  FCE_CHECK(reinterpret_cast<uintptr_t>(p) % dtype_size(dt) == 0, FCE_STATUS_UNSUPPORTED_LAYOUT,
            "%s (data + byte_offset) is not aligned to its %zu-byte elements", name, dtype_size(dt));
  return p;
}

}  // namespace

void Validator::check_device(const DLTensor* t, const char* name) const {
  const int dt = t->device.device_type;
  if (backend_ == Backend::CPU) {
    FCE_CHECK(dt == kDLCPU || dt == kDLCUDAHost, FCE_STATUS_DEVICE_MISMATCH,
              "%s is on device type %d but the handle is a CPU handle", name, dt);
  } else {
    FCE_CHECK(dt == kDLCUDA || dt == kDLCUDAManaged, FCE_STATUS_DEVICE_MISMATCH,
              "%s is on device type %d but the handle is a CUDA handle", name, dt);
    FCE_CHECK(t->device.device_id == device_id_, FCE_STATUS_DEVICE_MISMATCH,
              "%s is on CUDA device %d but the handle is on device %d", name, t->device.device_id,
              device_id_);
  }
}

Mat Validator::matrix(const DLTensor* t, const char* name, unsigned accept) const {
  FCE_CHECK(t != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s is NULL", name);
  FCE_CHECK(t->ndim == 2, FCE_STATUS_SHAPE_MISMATCH, "%s must be 2-D, has ndim %d", name, t->ndim);
  FCE_CHECK(t->shape != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s has a NULL shape", name);
  check_device(t, name);
  Mat m;
  m.dtype = parse_dtype(t, name, accept);
  m.rows = t->shape[0];
  m.cols = t->shape[1];
  FCE_CHECK(m.rows > 0 && m.cols > 0, FCE_STATUS_SHAPE_MISMATCH, "%s has shape [%lld, %lld]; both must be >= 1",
            name, (long long)m.rows, (long long)m.cols);
  m.ld = m.cols;
  if (t->strides) {
    const int64_t s0 = t->strides[0], s1 = t->strides[1];
    FCE_CHECK(m.cols == 1 || s1 == 1, FCE_STATUS_UNSUPPORTED_LAYOUT,
              "%s must have unit stride on its last axis (has %lld)", name, (long long)s1);
    if (m.rows > 1) {
      FCE_CHECK(s0 >= m.cols, FCE_STATUS_UNSUPPORTED_LAYOUT,
                "%s row stride %lld is smaller than its row length %lld", name, (long long)s0, (long long)m.cols);
      m.ld = s0;
    }
  }
  checked_mul(m.rows, m.ld, name);
  checked_bytes(checked_mul(m.rows, m.ld, name), dtype_size(m.dtype), name);
  m.data = base_pointer(t, name, m.dtype);
  return m;
}

Vec Validator::vector(const DLTensor* t, const char* name, unsigned accept) const {
  FCE_CHECK(t != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s is NULL", name);
  FCE_CHECK(t->ndim == 1, FCE_STATUS_SHAPE_MISMATCH, "%s must be 1-D, has ndim %d", name, t->ndim);
  FCE_CHECK(t->shape != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s has a NULL shape", name);
  check_device(t, name);
  Vec v;
  v.dtype = parse_dtype(t, name, accept);
  v.n = t->shape[0];
  FCE_CHECK(v.n > 0, FCE_STATUS_SHAPE_MISMATCH, "%s has length %lld; must be >= 1", name, (long long)v.n);
  if (t->strides && v.n > 1)
    FCE_CHECK(t->strides[0] == 1, FCE_STATUS_UNSUPPORTED_LAYOUT, "%s must have unit stride (has %lld)", name,
              (long long)t->strides[0]);
  checked_bytes(v.n, dtype_size(v.dtype), name);
  v.data = base_pointer(t, name, v.dtype);
  return v;
}

Vec Validator::scalar(const DLTensor* t, const char* name, unsigned accept) const {
  FCE_CHECK(t != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s is NULL", name);
  FCE_CHECK(t->ndim == 0 || (t->ndim == 1 && t->shape && t->shape[0] == 1), FCE_STATUS_SHAPE_MISMATCH,
            "%s must be a scalar (ndim 0 or shape [1])", name);
  check_device(t, name);
  Vec v;
  v.dtype = parse_dtype(t, name, accept);
  v.n = 1;
  v.scalar = true;
  v.data = base_pointer(t, name, v.dtype);
  return v;
}

Vec Validator::scalar_or_vector(const DLTensor* t, const char* name, unsigned accept, int64_t n) const {
  FCE_CHECK(t != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s is NULL", name);
  if (t->ndim == 0 || (n != 1 && t->ndim == 1 && t->shape && t->shape[0] == 1)) return scalar(t, name, accept);
  Vec v = vector(t, name, accept);
  FCE_CHECK(v.n == n, FCE_STATUS_SHAPE_MISMATCH, "%s has length %lld; expected %lld or a scalar", name,
            (long long)v.n, (long long)n);
  return v;
}

Vec Validator::lse(const DLTensor* t, const char* name, int64_t n) const {
  FCE_CHECK(t != nullptr, FCE_STATUS_INVALID_ARGUMENT, "%s is NULL", name);
  Vec v;
  if (t->ndim == 2) {
    const Mat m = matrix(t, name, kF32);
    FCE_CHECK(m.rows == n && m.cols == 2, FCE_STATUS_SHAPE_MISMATCH,
              "%s has shape [%lld, %lld]; expected [N] or [N, 2] with N = %lld", name, (long long)m.rows,
              (long long)m.cols, (long long)n);
    FCE_CHECK(m.ld == 2 || m.rows == 1, FCE_STATUS_UNSUPPORTED_LAYOUT,
              "%s [N, 2] must be contiguous (row stride 2, has %lld)", name, (long long)m.ld);
    v.data = m.data;
    v.n = n;
    v.pair = true;
    return v;
  }
  FCE_CHECK(t->ndim == 1, FCE_STATUS_SHAPE_MISMATCH, "%s must be [N] or [N, 2], has ndim %d", name, t->ndim);
  v = vector(t, name, kF32);
  FCE_CHECK(v.n == n, FCE_STATUS_SHAPE_MISMATCH, "%s has length %lld; expected N = %lld", name, (long long)v.n,
            (long long)n);
  return v;
}

size_t Validator::span(const Mat& m) {
  return static_cast<size_t>((m.rows - 1) * m.ld + m.cols) * dtype_size(m.dtype);
}
size_t Validator::span(const Vec& v) { return static_cast<size_t>(v.n) * dtype_size(v.dtype) * (v.pair ? 2 : 1); }

void Validator::add(const char* name, const void* begin, size_t bytes, bool is_output, const char* exempt) {
  const uintptr_t b = reinterpret_cast<uintptr_t>(begin), e = b + bytes;
  for (const Range& r : ranges_) {
    if (!is_output && !r.is_output) continue;  // inputs may share memory freely
    if (b < r.end && r.begin < e) {
      // Only the named in-place partner is exempt, and only over exactly its bytes: never another input
      // or output that happens to share them.
      if (exempt && !r.is_output && std::strcmp(r.name, exempt) == 0 && r.begin == b && r.end == e) continue;
      raise(FCE_STATUS_ALIASING, "%s overlaps %s in memory", name, r.name);
    }
  }
  ranges_.push_back({name, b, e, is_output});
}

void Validator::output(const char* name, const void* begin, size_t bytes) { add(name, begin, bytes, true, nullptr); }
void Validator::input(const char* name, const void* begin, size_t bytes) { add(name, begin, bytes, false, nullptr); }
void Validator::output_allow_exact(const char* name, const Mat& out, const Mat& same, const char* same_name) {
  const bool exact = out.data == same.data && out.ld == same.ld && out.dtype == same.dtype;
  add(name, out.data, span(out), true, exact ? same_name : nullptr);
}

}  // namespace fce
