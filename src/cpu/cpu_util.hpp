// Host-side element access for the CPU backend.
#pragma once
#include <cstdint>
#include <cstring>

#include "common/tensor.hpp"
#include "cpu/simd.hpp"

namespace fce::cpu {

inline float bf16_to_float(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);                                         // round to nearest even
  return uint16_t(u >> 16);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal: normalize
    int e = -1;
    do {
      ++e;
      man <<= 1;
    } while (!(man & 0x400u));
    u = sign | (uint32_t(112 - e) << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_half(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  u &= 0x7fffffffu;
  if (u > 0x7f800000u) return uint16_t(sign | 0x7e00u);   // NaN
  if (u >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // overflow (>= 65520 rounds to inf)
  if (u < 0x38800000u) {                                  // subnormal or zero in half
    if (u < 0x33000000u) return sign;                     // below half the smallest subnormal
    const uint32_t e = u >> 23, man = (u & 0x7fffffu) | 0x800000u;
    const uint32_t s = 126u - e;  // value = man * 2^(e-150) = (man >> s) * 2^-24, s in 14..24
    uint32_t r = man >> s;
    const uint32_t rem = man & ((1u << s) - 1u), halfway = 1u << (s - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return uint16_t(sign | r);
  }
  uint32_t r = ((u >> 13) - (112u << 10));
  const uint32_t rem = u & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return uint16_t(sign | r);
}

inline float load(const char* p, DType t) {
  switch (t) {
    case DType::F32: { float f; std::memcpy(&f, p, 4); return f; }
    case DType::BF16: { uint16_t h; std::memcpy(&h, p, 2); return bf16_to_float(h); }
    case DType::F16: { uint16_t h; std::memcpy(&h, p, 2); return half_to_float(h); }
    default: return 0.f;
  }
}

inline void store(char* p, DType t, float v) {
  switch (t) {
    case DType::F32: std::memcpy(p, &v, 4); break;
    case DType::BF16: { uint16_t h = float_to_bf16(v); std::memcpy(p, &h, 2); break; }
    case DType::F16: { uint16_t h = float_to_half(v); std::memcpy(p, &h, 2); break; }
    default: break;
  }
}

// v rounded to dtype t and back (round to nearest even).
inline float round_to(DType t, float v) {
  if (t == DType::F32) return v;
  char b[4];
  store(b, t, v);
  return load(b, t);
}

inline int64_t load_index(const char* base, DType t, int64_t i) {
  if (t == DType::I32) { int32_t v; std::memcpy(&v, base + 4 * i, 4); return v; }
  int64_t v; std::memcpy(&v, base + 8 * i, 8); return v;
}

inline void store_index(char* base, DType t, int64_t i, int64_t v) {
  if (t == DType::I32) { int32_t w = int32_t(v); std::memcpy(base + 4 * i, &w, 4); }
  else std::memcpy(base + 8 * i, &v, 8);
}

inline const char* row_ptr(const Mat& m, int64_t r) {
  return m.data + static_cast<size_t>(r) * static_cast<size_t>(m.ld) * dtype_size(m.dtype);
}
inline char* row_ptr_mut(const Mat& m, int64_t r) { return const_cast<char*>(row_ptr(m, r)); }

// Converts one row to fp32, and back (round to nearest even).
inline void load_row(const Mat& m, int64_t r, float* out) { simd::to_f32(row_ptr(m, r), m.dtype, m.cols, out); }
inline void store_row(const Mat& m, int64_t r, const float* in) { simd::from_f32(in, m.cols, m.dtype, row_ptr_mut(m, r)); }

// Row r as fp32 without a copy where m is fp32: the row itself, else `buf` holding it converted.
inline const float* row_in(const Mat& m, int64_t r, float* buf) {
  if (m.dtype == DType::F32) return reinterpret_cast<const float*>(row_ptr(m, r));
  load_row(m, r, buf);
  return buf;
}
// Where to form row r of an output: the row itself where m is fp32, else `buf`, which row_out_done stores.
inline float* row_out(const Mat& m, int64_t r, float* buf) {
  return m.dtype == DType::F32 ? reinterpret_cast<float*>(row_ptr_mut(m, r)) : buf;
}
inline void row_out_done(const Mat& m, int64_t r, const float* buf) {
  if (m.dtype != DType::F32) store_row(m, r, buf);
}

inline float load_f32(const Vec& v, int64_t i) { return load(v.data + 4 * size_t(v.scalar ? 0 : i), DType::F32); }
inline void store_f32(const Vec& v, int64_t i, float x) { std::memcpy(v.data + 4 * size_t(i), &x, 4); }

// Row i's lse from an [N] fp32 tensor (the pair (lse, 0)) or an [N, 2] one (the pair itself, LsePair).
inline LsePair load_lse(const Vec& v, int64_t i) {
  if (!v.pair) return {load_f32(v, i), 0.f};
  LsePair p;
  std::memcpy(&p.hi, v.data + 8 * size_t(i), 4);
  std::memcpy(&p.lo, v.data + 8 * size_t(i) + 4, 4);
  return p;
}
// Stores row i's lse: the pair into an [N, 2] tensor, else the value `lse`.
inline void store_lse(const Vec& v, int64_t i, LsePair p, float lse) {
  if (!v.pair) return store_f32(v, i, lse);
  std::memcpy(v.data + 8 * size_t(i), &p.hi, 4);
  std::memcpy(v.data + 8 * size_t(i) + 4, &p.lo, 4);
}

}  // namespace fce::cpu
