// Test support: host tensors with any dtype and row stride, float64 views of their values, outputs
// poisoned before each call, and the same tests run against a CPU or a CUDA handle.
#pragma once
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "fusedce/fusedce.h"

namespace fct {

enum class DT { F32, BF16, F16, I32, I64 };

inline size_t dt_size(DT t) { return t == DT::F32 || t == DT::I32 ? 4 : t == DT::I64 ? 8 : 2; }
inline const char* dt_name(DT t) {
  switch (t) {
    case DT::F32: return "f32";
    case DT::BF16: return "bf16";
    case DT::F16: return "f16";
    case DT::I32: return "i32";
    case DT::I64: return "i64";
  }
  return "?";
}
inline DLDataType dl_dtype(DT t) {
  switch (t) {
    case DT::F32: return {kDLFloat, 32, 1};
    case DT::BF16: return {kDLBfloat, 16, 1};
    case DT::F16: return {kDLFloat, 16, 1};
    case DT::I32: return {kDLInt, 32, 1};
    case DT::I64: return {kDLInt, 64, 1};
  }
  return {kDLFloat, 32, 1};
}

// Conversions written for the tests (fp16 through the compiler's _Float16, bf16 by bit rounding).
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  const uint32_t lsb = (u >> 16) & 1u;
  return uint16_t((u + 0x7fffu + lsb) >> 16);
}
inline float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t to_f16(float f) {
  _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}
inline float from_f16(uint16_t u) {
  _Float16 h;
  std::memcpy(&h, &u, 2);
  return static_cast<float>(h);
}

// Which backend the tests in this executable run against (set by main).
struct Target {
  int32_t device_type = kDLCPU;
  int32_t device_id = 0;
  bool cuda() const { return device_type == kDLCUDA; }
};
Target& target();

// Rows of a "many rows" test: the GPU's multi-block and persistent kernels take their paths only with
// hundreds of rows; the CPU backend's rows are independent iterations of one loop, statically split across
// its threads, and 48 rows take every one of its paths. The CPU executables run four times (the SIMD targets)
// and under ASan: their rows are what the suite's time goes to (docs/testing.md).
inline int64_t many_rows(int64_t gpu_rows) { return target().cuda() ? gpu_rows : std::min<int64_t>(gpu_rows, 48); }

// Device memory hooks: no-ops for the CPU build, cudaMemcpy for the GPU build (tests/common/device_*.cpp).
void* dev_alloc(size_t bytes);
void dev_free(void* p);
void dev_upload(void* dst, const void* src, size_t bytes);
void dev_download(void* dst, const void* src, size_t bytes);
void dev_sync();
fce_stream_t test_stream();

// A tensor of up to 2 dims; host copy always, device copy when the target is CUDA.
class Tensor {
 public:
  Tensor() = default;
  Tensor(DT dt, std::vector<int64_t> shape, int64_t row_stride = 0) : dt_(dt), shape_(std::move(shape)) {
    if (shape_.size() == 2) {
      ld_ = row_stride > 0 ? row_stride : shape_[1];
      strides_ = {ld_, 1};
      elems_ = (shape_[0] - 1) * ld_ + shape_[1];
    } else {
      ld_ = 1;
      elems_ = shape_.empty() ? 1 : shape_[0];
      strides_.assign(shape_.size(), 1);
    }
    host_.assign(size_t(elems_) * dt_size(dt_) + 64, 0);
    dl_.ndim = int32_t(shape_.size());
    dl_.dtype = dl_dtype(dt_);
    dl_.shape = shape_.data();
    dl_.strides = strides_.empty() ? nullptr : strides_.data();
    dl_.byte_offset = 0;
    if (target().cuda()) {
      dev_ = std::shared_ptr<void>(dev_alloc(host_.size()), dev_free);
      dl_.data = dev_.get();
      dl_.device = {kDLCUDA, target().device_id};
    } else {
      dl_.data = host_.data();
      dl_.device = {kDLCPU, 0};
    }
  }
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;
  Tensor(Tensor&& o) noexcept { *this = std::move(o); }
  Tensor& operator=(Tensor&& o) noexcept {
    dt_ = o.dt_; shape_ = std::move(o.shape_); strides_ = std::move(o.strides_); ld_ = o.ld_; elems_ = o.elems_;
    host_ = std::move(o.host_); dev_ = std::move(o.dev_); dl_ = o.dl_;
    dl_.shape = shape_.data();
    dl_.strides = strides_.empty() ? nullptr : strides_.data();
    if (!dev_) dl_.data = host_.data();
    return *this;
  }

  DLTensor* dl() { return &dl_; }
  DT dtype() const { return dt_; }
  int64_t rows() const { return shape_.size() == 2 ? shape_[0] : 1; }
  int64_t cols() const { return shape_.size() == 2 ? shape_[1] : (shape_.empty() ? 1 : shape_[0]); }
  int64_t ld() const { return ld_; }
  int64_t size() const { return rows() * cols(); }

  // Element (r, c) of a matrix, or element c of a vector (r = 0), as double.
  double get(int64_t r, int64_t c = -1) const {
    const int64_t off = c < 0 ? r : r * ld_ + c;
    const uint8_t* p = host_.data() + size_t(off) * dt_size(dt_);
    switch (dt_) {
      case DT::F32: { float f; std::memcpy(&f, p, 4); return f; }
      case DT::BF16: { uint16_t h; std::memcpy(&h, p, 2); return from_bf16(h); }
      case DT::F16: { uint16_t h; std::memcpy(&h, p, 2); return from_f16(h); }
      case DT::I32: { int32_t v; std::memcpy(&v, p, 4); return v; }
      case DT::I64: { int64_t v; std::memcpy(&v, p, 8); return double(v); }
    }
    return 0;
  }
  int64_t get_int(int64_t i) const {
    const uint8_t* p = host_.data() + size_t(i) * dt_size(dt_);
    if (dt_ == DT::I32) { int32_t v; std::memcpy(&v, p, 4); return v; }
    int64_t v; std::memcpy(&v, p, 8); return v;
  }
  // Stores v rounded to the dtype (index dtypes take the integer value).
  void set(int64_t r, int64_t c, double v) { set_flat(c < 0 ? r : r * ld_ + c, v); }
  void set(int64_t i, double v) { set_flat(i, v); }
  void set_int(int64_t i, int64_t v) {
    uint8_t* p = host_.data() + size_t(i) * dt_size(dt_);
    if (dt_ == DT::I32) { int32_t w = int32_t(v); std::memcpy(p, &w, 4); }
    else std::memcpy(p, &v, 8);
  }
  // Fills every byte (padding included) with a pattern that decodes to NaN (floats) or a sentinel (ints).
  void poison() {
    const uint8_t b = (dt_ == DT::I32 || dt_ == DT::I64) ? 0x5a : 0xff;
    std::fill(host_.begin(), host_.end(), b);
  }
  const std::vector<uint8_t>& bytes() const { return host_; }
  uint8_t* raw() { return host_.data(); }  // the host copy's bytes (upload() sends them)
  void upload() { if (dev_) dev_upload(dev_.get(), host_.data(), host_.size()); }
  void download() { if (dev_) { dev_sync(); dev_download(host_.data(), dev_.get(), host_.size()); } }

 private:
  void set_flat(int64_t off, double v) {
    uint8_t* p = host_.data() + size_t(off) * dt_size(dt_);
    switch (dt_) {
      case DT::F32: { float f = float(v); std::memcpy(p, &f, 4); break; }
      case DT::BF16: { uint16_t h = to_bf16(float(v)); std::memcpy(p, &h, 2); break; }
      case DT::F16: { uint16_t h = to_f16(float(v)); std::memcpy(p, &h, 2); break; }
      case DT::I32: { int32_t w = int32_t(v); std::memcpy(p, &w, 4); break; }
      case DT::I64: { int64_t w = int64_t(v); std::memcpy(p, &w, 8); break; }
    }
  }
  DT dt_ = DT::F32;
  std::vector<int64_t> shape_, strides_;
  int64_t ld_ = 1, elems_ = 0;
  std::vector<uint8_t> host_;
  std::shared_ptr<void> dev_;
  DLTensor dl_{};
};

// A scalar fp32 tensor (ndim 0).
inline Tensor scalar_f32(double v) {
  Tensor t(DT::F32, {});
  t.set(0, v);
  t.upload();
  return t;
}

// A [W, N, K] view of a [W * N, K] fp32 tensor: the records of W vocabulary shards in rank order.
struct Records {
  Tensor t;
  int64_t shape[3];
  DLTensor dl;
  Records(int64_t W, int64_t N, int64_t K) : t(DT::F32, {W * N, K}), shape{W, N, K} { view(); }
  Records(Records&& o) noexcept : t(std::move(o.t)), shape{o.shape[0], o.shape[1], o.shape[2]} { view(); }
  Records& operator=(Records&&) = delete;

 private:
  void view() {  // dl points into this object
    dl = *t.dl();
    dl.ndim = 3;
    dl.shape = shape;
    dl.strides = nullptr;
  }
};

// Vocabulary shard r: global columns [start, start + width), stored in `cols` columns (cols - width of
// padding).
struct Shard {
  int64_t start, width, cols;
};

// Splits V into shards of the given widths (the last takes the rest), the last padded by `pad` columns.
inline std::vector<Shard> split_vocabulary(int64_t V, const std::vector<int64_t>& widths, int64_t pad) {
  std::vector<Shard> s;
  int64_t at = 0;
  for (size_t r = 0; r < widths.size(); ++r) {
    const int64_t w = r + 1 == widths.size() ? V - at : widths[r];
    s.push_back({at, w, w + (r + 1 == widths.size() ? pad : 0)});
    at += w;
  }
  return s;
}

// Megatron's split of V over W ranks: ceil(V / W) columns each, the last rank's shard short and padded to the
// same width (as split_vocabulary's widths and pad).
struct EvenSplit {
  std::vector<int64_t> widths;
  int64_t pad;
};
inline EvenSplit megatron_split(int64_t V, int64_t W) {
  const int64_t width = (V + W - 1) / W;
  EvenSplit e{std::vector<int64_t>(size_t(W), width), 0};
  e.pad = width * W - V;
  return e;
}

// RAII handle on the test target.
class Handle {
 public:
  Handle() {
    const fce_status_t s = fce_handle_create(target().device_type, target().device_id, &h_);
    if (s != FCE_STATUS_SUCCESS) ADD_FAILURE() << "fce_handle_create: " << fce_last_error_message();
  }
  ~Handle() { fce_handle_destroy(h_); }
  operator fce_handle_t() const { return h_; }

 private:
  fce_handle_t h_ = nullptr;
};

inline std::mt19937_64& rng() {
  static std::mt19937_64 g(std::random_device{}());
  return g;
}

// Random logits: normal * scale; "peaked" adds a large bump at one random column per row.
inline void fill_logits(Tensor& t, double scale, bool peaked, double bump = 30.0) {
  std::normal_distribution<double> nd(0.0, scale);
  std::uniform_int_distribution<int64_t> col(0, t.cols() - 1);
  for (int64_t r = 0; r < t.rows(); ++r) {
    for (int64_t c = 0; c < t.cols(); ++c) t.set(r, c, nd(rng()));
    if (peaked) { const int64_t c = col(rng()); t.set(r, c, t.get(r, c) + bump); }
  }
  t.upload();
}

// Row-major double copy of a matrix's (dtype-rounded) values.
inline std::vector<double> values(const Tensor& t) {
  std::vector<double> v(size_t(t.rows() * t.cols()));
  for (int64_t r = 0; r < t.rows(); ++r)
    for (int64_t c = 0; c < t.cols(); ++c) v[size_t(r * t.cols() + c)] = t.get(r, c);
  return v;
}

// |got - want| <= atol + rtol*|want|, with NaN matching NaN and equal infinities matching.
inline ::testing::AssertionResult close(double got, double want, double rtol, double atol) {
  if (std::isnan(want) && std::isnan(got)) return ::testing::AssertionSuccess();
  if (std::isinf(want) && got == want) return ::testing::AssertionSuccess();
  if (std::fabs(got - want) <= atol + rtol * std::fabs(want)) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "got " << got << " want " << want << " (diff " << got - want << ")";
}

// Tolerance of values rounded to a dtype.
inline double dtype_rtol(DT t) { return t == DT::BF16 ? 8e-3 : t == DT::F16 ? 1e-3 : 2e-5; }

#define FCE_OK(call)                                                                           \
  do {                                                                                         \
    const fce_status_t s_ = (call);                                                            \
    ASSERT_EQ(s_, FCE_STATUS_SUCCESS) << #call << ": " << fce_status_string(s_) << ": "        \
                                      << fce_last_error_message();                             \
  } while (0)

}  // namespace fct
