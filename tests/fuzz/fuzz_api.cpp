// libFuzzer target for the whole C ABI on a CPU handle (issue 9).
//
// Every input builds one call of one entry point from fuzz bytes: DLTensor descriptors (ndim, shapes
// including zero/negative/huge extents, strides, byte_offset, dtypes, devices, NULL data/shape pointers,
// tensors sharing memory), option and output structs (struct_size, enum values, floats including NaN and
// infinities), workspace pointers and sizes. The harness keeps itself memory safe and lets ASan/UBSan (and
// guard pages, for OpenBLAS which is not instrumented) catch the library:
//   - a tensor whose layout is valid by the header's rules and addresses at most kCapElems elements is
//     backed by a buffer of exactly the bytes it addresses (ASan-checked heap, or a buffer that ends at a
//     PROT_NONE page);
//   - any other tensor (bad ndim/extent/stride/dtype/device, NULL data) is invalid and must be rejected
//     before it is read: it points at a 1-byte heap block;
//   - a valid layout that would address more than kCapElems elements but fits 64-bit arithmetic cannot be
//     backed, so the harness turns it into one whose byte count overflows 64 bits (the library must report
//     FCE_STATUS_OVERFLOW or reject it earlier), or into a negative extent.
// Oracles (each failure calls abort(), which libFuzzer reports as a crash and saves the input):
//   1. a status outside the enum, FCE_STATUS_INTERNAL_ERROR, or a device/CUDA status from a CPU handle;
//   2. on failure: any byte of any buffer changed (outputs, inputs, padding), a size query's output written,
//      an empty fce_last_error_message(); on success: a non-empty message;
//   3. on success: a byte outside the requested outputs' elements changed (inputs, row padding), or an
//      output element left unwritten (outputs are poisoned with signalling-NaN / negative-int patterns
//      that no computation produces);
//   4. on success: two outputs overlap, or an output overlaps an input other than the exact in-place
//      partner the header allows (FCE_STATUS_ALIASING was due);
//   5. a call whose arguments are all valid and consistent by the header fails (validation too strict);
//   6. determinism: the same call run twice from the same bytes writes bitwise identical outputs.
// Library bugs found by this harness (docs/reliability.md, "Findings"), all fixed since; the harness still
// knows how to avoid or tolerate them (FCE_FUZZ_KNOWN_BUGS=0), for fuzzing an older library:
//   F1  fce_status_string() with a value outside the enum's range (0..15): UBSan "invalid enum load";
//       by default only values 0..15 are passed;
//   F2  fce_handle_create(kDLCUDA, negative ordinal) leaks the handle: by default ordinals are >= 0;
//   F3  overlapping outputs accepted (oracle 4): by default reported as "KNOWN" (3 times) and tolerated.
// By default (the bugs fixed) all three are reachable and fatal.
#ifdef FCE_FDP_HEADER
// The replay build (tests/fuzz/replay.cpp) by another compiler than clang, which names clang's header by its
// path: clang's include folder would shadow the compiler's own headers.
#include FCE_FDP_HEADER
#else
#include <fuzzer/FuzzedDataProvider.h>
#endif
#include <sys/mman.h>
#include <unistd.h>

#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "fusedce/fusedce.h"

namespace {

constexpr int64_t kCapElems = 4096;  // largest tensor the harness backs with memory
constexpr size_t kPage = 4096;

[[noreturn]] void die(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::fprintf(stderr, "\n*** fuzz_api oracle failure: ");
  std::vfprintf(stderr, fmt, ap);
  std::fprintf(stderr, "\n*** last error message: \"%s\"\n", fce_last_error_message());
  va_end(ap);
  std::abort();
}

bool known_bugs() {
  static const bool v = [] {
    const char* e = std::getenv("FCE_FUZZ_KNOWN_BUGS");
    return !(e && std::strcmp(e, "0") == 0);
  }();
  return v;
}

// Counters printed at exit (FCE_FUZZ_STATS=1): calls per entry point, outcome, oracle 5 coverage.
struct Stats {
  struct Row {
    unsigned long calls = 0, ok = 0, valid = 0, by_status[16] = {};
  };
  Row rows[32];
  const char* names[32] = {};
  unsigned long grown_zero = 0, grown_nonzero = 0;  // make_opt's growing-struct cases
  int n = 0;
  Row& row(const char* fn) {
    for (int i = 0; i < n; ++i)
      if (std::strcmp(names[i], fn) == 0) return rows[i];
    names[n] = fn;
    return rows[n++];
  }
  ~Stats() {
    const char* e = std::getenv("FCE_FUZZ_STATS");
    if (!e || !*e || *e == '0') return;
    unsigned long calls = 0, ok = 0, bad = 0;
    std::fprintf(stderr, "fuzz_api stats: entry point, calls, succeeded, of which valid-by-header (oracle 5), "
                         "failures by status\n");
    for (int i = 0; i < n; ++i) {
      const Row& r = rows[i];
      calls += r.calls;
      ok += r.ok;
      bad += r.calls - r.ok;
      std::fprintf(stderr, "  %-45s %9lu %9lu %9lu  ", names[i], r.calls, r.ok, r.valid);
      for (int s = 1; s < 16; ++s)
        if (r.by_status[s]) std::fprintf(stderr, " %s=%lu", fce_status_string(fce_status_t(s)), r.by_status[s]);
      std::fprintf(stderr, "\n");
    }
    std::fprintf(stderr, "fuzz_api stats: %lu calls, %lu succeeded, %lu rejected\n", calls, ok, bad);
    std::fprintf(stderr, "fuzz_api stats: structs larger than the library's: %lu with a zero tail, %lu with a "
                         "non-zero byte past the library's size\n", grown_zero, grown_nonzero);
  }
};
Stats g_stats;

void count(const char* fn, fce_status_t s, bool valid) {
  Stats::Row& r = g_stats.row(fn);
  ++r.calls;
  if (s == FCE_STATUS_SUCCESS) ++r.ok;
  if (s == FCE_STATUS_SUCCESS && valid) ++r.valid;
  if (int(s) > 0 && int(s) < 16) ++r.by_status[int(s)];
}

// -------------------------------------------------------------------------------------------------
// dtypes
enum Kind : int { F32, BF16, F16, I32, I64, BAD };

DLDataType dl_of(Kind k) {
  switch (k) {
    case F32: return {kDLFloat, 32, 1};
    case BF16: return {kDLBfloat, 16, 1};
    case F16: return {kDLFloat, 16, 1};
    case I32: return {kDLInt, 32, 1};
    case I64: return {kDLInt, 64, 1};
    default: return {kDLFloat, 64, 1};
  }
}
Kind kind_of(DLDataType d) {
  if (d.lanes != 1) return BAD;
  if (d.code == kDLFloat && d.bits == 32) return F32;
  if (d.code == kDLFloat && d.bits == 16) return F16;
  if (d.code == kDLBfloat && d.bits == 16) return BF16;
  if (d.code == kDLInt && d.bits == 32) return I32;
  if (d.code == kDLInt && d.bits == 64) return I64;
  return BAD;
}
size_t esize(Kind k) { return k == F32 || k == I32 ? 4 : k == I64 ? 8 : 2; }

// Output poison: signalling NaNs (no arithmetic result is one) and negative integers (no index is one).
void poison_elem(uint8_t* p, Kind k) {
  switch (k) {
    case F32: { const uint32_t v = 0x7fa5a5a5u; std::memcpy(p, &v, 4); break; }
    case BF16: { const uint16_t v = 0x7fa5u; std::memcpy(p, &v, 2); break; }
    case F16: { const uint16_t v = 0x7da5u; std::memcpy(p, &v, 2); break; }
    case I32: std::memset(p, 0xa5, 4); break;
    case I64: std::memset(p, 0xa5, 8); break;
    default: break;
  }
}
bool is_poison(const uint8_t* p, Kind k) {
  uint8_t q[8];
  poison_elem(q, k);
  return std::memcmp(p, q, esize(k)) == 0;
}

uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7fc0;
  return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
uint16_t f32_to_f16(float f) {  // round to nearest even (clang 14 has no _Float16 on x86)
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000u);
  const uint32_t a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);
  if (a < 0x38800000u) {  // half subnormal: round(|f| * 2^24), exact scaling
    float v;
    std::memcpy(&v, &a, 4);
    return uint16_t(sign | uint16_t(std::nearbyint(v * 16777216.0f)));
  }
  const uint32_t r = a - 0x38000000u;
  return uint16_t(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
}

// -------------------------------------------------------------------------------------------------
// Tensor arguments and the memory behind them.
enum class Role { In, Out };

struct Arg {
  std::string name;
  Role role = Role::In;
  int partner = -1;  // index of the input this output may exactly coincide with (in-place)
  DLTensor dl{};
  std::unique_ptr<int64_t[]> shape, strides;
  int value_mode = 0;  // how inputs are filled (see fill_input)
  // Harness interpretation (by the header's rules).
  bool valid = false;
  Kind kind = BAD;
  int64_t rows = 0, cols = 0, ld = 0;  // vectors: rows = 1, cols = n; scalars: 1, 1
  size_t touched = 0;                  // bytes from the first element to one past the last
  int buf = -1;
  size_t start = 0;  // offset of the first element in the buffer
};

struct Buf {
  size_t size = 0;
  uint8_t* mem = nullptr;
  uint8_t* map = nullptr;  // guard-page mapping (mem ends at a PROT_NONE page)
  size_t map_len = 0;
  std::vector<uint8_t> snap, after;
  ~Buf() {
    if (map) munmap(map, map_len);
    else std::free(mem);
  }
};

struct Env {
  explicit Env(FuzzedDataProvider& f) : fdp(f) {}
  FuzzedDataProvider& fdp;
  std::vector<Arg> args;
  std::vector<std::unique_ptr<Buf>> bufs;
  bool clean = true;  // every argument valid and consistent by the header (oracle 5)
  uint64_t rng = 0x9e3779b97f4a7c15ull;

  uint64_t next() {  // splitmix64
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  bool coin(unsigned percent) { return fdp.ConsumeIntegralInRange<unsigned>(0, 99) < percent; }
  template <class T>
  T pick(std::initializer_list<T> l) {
    const size_t i = fdp.ConsumeIntegralInRange<size_t>(0, l.size() - 1);
    return *(l.begin() + i);
  }

  float fuzz_float() {
    switch (fdp.ConsumeIntegralInRange(0, 15)) {
      case 0: return NAN;
      case 1: return INFINITY;
      case 2: return -INFINITY;
      case 3: return 0.f;
      case 4: return -0.f;
      case 5: return 1e-45f;
      case 6: return 1e-39f;
      case 7: return 3e38f;
      case 8: return -1.f;
      case 9: return 0.5f;
      case 10: return 1.f;
      case 11: return 30.f;
      case 12: return 1e-4f;
      case 13: return 2.f;
      case 14: { const uint32_t u = fdp.ConsumeIntegral<uint32_t>(); float f; std::memcpy(&f, &u, 4); return f; }
      default: return fdp.ConsumeFloatingPointInRange<float>(-4.f, 4.f);
    }
  }

  // ---------------------------------------------------------------------------------------------
  // Descriptors. `shape_` is the intended shape ({} = scalar ndim 0); a few mutations make it wrong.
  int add(const char* name, Role role, Kind kind, std::vector<int64_t> shp, int partner = -1) {
    Arg a;
    a.name = name;
    a.role = role;
    a.partner = partner;
    int32_t ndim = int32_t(shp.size());
    DLDataType dt = dl_of(kind);
    DLDevice dev{kDLCPU, 0};
    if (coin(5)) dev.device_type = kDLCUDAHost;  // pinned host memory: accepted by a CPU handle
    if (coin(10)) dev.device_id = fdp.ConsumeIntegral<int8_t>();  // ignored for CPU memory
    bool data_null = false, shape_null = false;
    // Intended strides: NULL, explicit row-major, or padded rows; extent-1 axes get arbitrary strides.
    std::vector<int64_t> st;
    const int smode = fdp.ConsumeIntegralInRange(0, 3);
    if (ndim == 2 && smode > 0) {
      int64_t s0 = shp[1] + (smode == 2 ? fdp.ConsumeIntegralInRange<int64_t>(1, 5) : 0), s1 = 1;
      if (smode == 3) s0 = shp[1];
      if (shp[0] == 1 && coin(30)) s0 = pick<int64_t>({0, -7, 1, int64_t(1) << 62, INT64_MIN});
      if (shp[1] == 1 && coin(30)) s1 = pick<int64_t>({0, -1, 3, INT64_MAX});
      st = {s0, s1};
    } else if (ndim == 1 && smode > 0) {
      st = {shp[0] == 1 && coin(30) ? pick<int64_t>({0, -3, 9}) : 1};
    }
    bool has_strides = !st.empty();
    uint64_t boff = 0;
    if (coin(20)) boff = esize(kind) * fdp.ConsumeIntegralInRange<uint64_t>(1, 16);

    // Mutations (each leaves the argument invalid or inconsistent, or at least outside oracle 5).
    if (coin(12)) {
      clean = false;
      switch (fdp.ConsumeIntegralInRange(0, 11)) {
        case 0: ndim = pick<int32_t>({-1, 0, 1, 2, 3, 64, INT32_MAX, INT32_MIN}); break;
        case 1:
          if (!shp.empty()) {
            shp[fdp.ConsumeIntegralInRange<size_t>(0, shp.size() - 1)] = pick<int64_t>(
                {0, -1, INT64_MIN, INT64_MAX, int64_t(1) << 62, int64_t(1) << 61, int64_t(1) << 32,
                 int64_t(3) << 31, int64_t(1) << 40, fdp.ConsumeIntegral<int64_t>()});
            if (shp.size() == 2 && coin(50)) shp[0] = pick<int64_t>({INT64_MAX, int64_t(1) << 33});
          }
          break;
        case 2:
          if (ndim == 2) {
            has_strides = true;
            if (st.size() != 2) st = {shp[1], 1};
            if (coin(50)) st[1] = pick<int64_t>({0, 2, -1, INT64_MAX});
            else st[0] = pick<int64_t>({0, -1, shp[1] - 1, INT64_MAX, INT64_MIN, int64_t(1) << 40,
                                        fdp.ConsumeIntegral<int64_t>()});
          } else if (ndim == 1) {
            has_strides = true;
            st = {pick<int64_t>({0, 2, -1, INT64_MAX})};
          }
          break;
        case 3:
          dt.code = fdp.ConsumeIntegral<uint8_t>() % 8;
          dt.bits = pick<uint8_t>({0, 8, 16, 32, 64, 128, fdp.ConsumeIntegral<uint8_t>()});
          dt.lanes = pick<uint16_t>({1, 1, 2, 0, 4});
          break;
        case 4:
          dt = dl_of(Kind(fdp.ConsumeIntegralInRange(0, 4)));  // an accepted dtype, maybe wrong for the role
          break;
        case 5:
          // Any value of the DLDeviceType enum's range (0..15 for DLPack 0.6); a value outside it is not a
          // DLDeviceType at all (undefined behaviour in C++ before the library sees it).
          dev.device_type = DLDeviceType(pick<int32_t>({kDLCUDA, kDLCUDAManaged, kDLOpenCL, kDLVulkan, kDLMetal,
                                                        kDLROCM, 0, fdp.ConsumeIntegralInRange(0, 15)}));
          break;
        case 6: data_null = true; break;
        case 7: shape_null = true; break;
        case 8:
          if (!shp.empty()) shp[fdp.ConsumeIntegralInRange<size_t>(0, shp.size() - 1)] =
              fdp.ConsumeIntegralInRange<int64_t>(1, 9);
          break;
        case 9: boff += fdp.ConsumeIntegralInRange<uint64_t>(1, 3); break;  // misaligned elements
        case 10:
          if (shp.empty()) { shp = {pick<int64_t>({1, 2, 0})}; ndim = 1; }
          else { shp.clear(); ndim = 0; }
          break;
        default: {  // huge extent that fits int64, the harness makes it overflow (see finalize)
          if (!shp.empty()) shp[0] = int64_t(1) << fdp.ConsumeIntegralInRange(20, 45);
          break;
        }
      }
    }
    // Shape/strides arrays of exactly ndim entries (at most 4 for absurd ndim), so ASan sees any read
    // past them.
    const size_t alloc = size_t(std::min<int64_t>(std::max<int32_t>(ndim, 0), 4));
    a.shape.reset(new int64_t[alloc]);
    for (size_t i = 0; i < alloc; ++i) a.shape[i] = i < shp.size() ? shp[i] : 1;
    if (has_strides) {
      a.strides.reset(new int64_t[alloc]);
      for (size_t i = 0; i < alloc; ++i) a.strides[i] = i < st.size() ? st[i] : 1;
    }
    a.dl.ndim = ndim;
    a.dl.dtype = dt;
    a.dl.device = dev;
    a.dl.shape = shape_null ? nullptr : a.shape.get();
    a.dl.strides = a.strides.get();
    a.dl.byte_offset = boff;
    a.dl.data = data_null ? nullptr : reinterpret_cast<void*>(1);  // placeholder until memory is assigned
    a.value_mode = fdp.ConsumeIntegralInRange(0, 5);
    args.push_back(std::move(a));
    interpret(args.back());
    return int(args.size() - 1);
  }

  // The header's rules, independently of the library: valid layout and the bytes it addresses.
  static bool interpret_layout(Arg& a, unsigned __int128* bytes) {
    const DLTensor& t = a.dl;
    a.kind = kind_of(t.dtype);
    if (a.kind == BAD) return false;
    if (t.device.device_type != kDLCPU && t.device.device_type != kDLCUDAHost) return false;
    if (!t.data) return false;
    const unsigned __int128 es = esize(a.kind);
    if (t.ndim == 0) {
      a.rows = a.cols = a.ld = 1;
      *bytes = es;
      return true;
    }
    if (!t.shape) return false;
    if (t.ndim == 1) {
      const int64_t n = t.shape[0];
      if (n <= 0) return false;
      if (n > 1 && t.strides && t.strides[0] != 1) return false;
      a.rows = 1;
      a.cols = a.ld = n;
      *bytes = (unsigned __int128)n * es;
      return true;
    }
    if (t.ndim == 2) {
      const int64_t r = t.shape[0], c = t.shape[1];
      if (r <= 0 || c <= 0) return false;
      int64_t ld = c;
      if (t.strides) {
        if (c > 1 && t.strides[1] != 1) return false;
        if (r > 1) {
          if (t.strides[0] < c) return false;
          ld = t.strides[0];
        }
      }
      a.rows = r;
      a.cols = c;
      a.ld = ld;
      *bytes = ((unsigned __int128)(r - 1) * (unsigned __int128)ld + (unsigned __int128)c) * es;
      return true;
    }
    if (t.ndim == 3) {  // the records of vocabulary shards: [W, N, K], contiguous (extent-1 axes: any stride)
      const int64_t w = t.shape[0], r = t.shape[1], c = t.shape[2];
      if (w <= 0 || r <= 0 || c <= 0) return false;
      const unsigned __int128 rows = (unsigned __int128)w * (unsigned __int128)r;
      if (rows > (unsigned __int128)INT64_MAX) return false;
      if (t.strides && ((c > 1 && t.strides[2] != 1) || (r > 1 && t.strides[1] != c) ||
                        (w > 1 && (unsigned __int128)t.strides[0] != (unsigned __int128)r * (unsigned __int128)c)))
        return false;
      a.rows = int64_t(rows);
      a.cols = a.ld = c;
      *bytes = rows * (unsigned __int128)c * es;
      return true;
    }
    return false;
  }

  void interpret(Arg& a) {
    unsigned __int128 bytes = 0;
    a.valid = interpret_layout(a, &bytes);
    if (!a.valid) return;
    const unsigned __int128 cap = (unsigned __int128)kCapElems * esize(a.kind);
    if (bytes <= cap) {
      a.touched = size_t(bytes);
      return;
    }
    // Too large to back. Bytes >= 2^64 must be rejected (OVERFLOW); anything in between is a valid tensor
    // we cannot provide, so force an overflow (rows = INT64_MAX, >= 2 columns) or a negative extent.
    clean = false;
    if (bytes >> 64) { a.valid = false; return; }
    if (a.dl.ndim == 2 && a.dl.shape) {
      a.shape[0] = INT64_MAX;
      if (a.shape[1] < 2) a.shape[1] = 2;
      if (a.strides && a.strides[0] < a.shape[1]) a.strides[0] = a.shape[1];
      if (a.strides && a.shape[1] > 1) a.strides[1] = 1;
    } else if (a.dl.ndim == 1 && a.dl.shape) {
      a.shape[0] = a.kind == F32 || a.kind == I32 || a.kind == I64 ? INT64_MAX : -1;
    }
    unsigned __int128 again = 0;
    if (interpret_layout(a, &again) && !(again >> 64)) a.shape[0] = -1;  // still representable: negative
    a.valid = false;
  }

  // ---------------------------------------------------------------------------------------------
  // Memory: buffers sized by the arguments that use them; some arguments share memory on purpose.
  void place() {
    for (size_t i = 0; i < args.size(); ++i) {
      Arg& a = args[i];
      if (!a.dl.data) continue;
      if (!a.valid) {  // never to be read: a 1-byte heap block
        auto b = std::make_unique<Buf>();
        b->size = 1;
        b->mem = static_cast<uint8_t*>(std::malloc(1));
        b->mem[0] = 0xcd;
        a.buf = int(bufs.size());
        a.start = 0;
        a.dl.data = b->mem;
        a.dl.byte_offset = 0;
        bufs.push_back(std::move(b));
        continue;
      }
      // Share memory with an earlier valid argument: exactly (in-place), or at some offset.
      int share = -1;
      if (coin(a.partner >= 0 ? 40 : 8)) {
        share = a.partner >= 0 && coin(70) ? a.partner : fdp.ConsumeIntegralInRange<int>(0, int(i));
        if (share == int(i) || !args[size_t(share)].valid || args[size_t(share)].buf < 0 ||
            !args[size_t(share)].dl.data)
          share = -1;
      }
      if (share >= 0) {
        const Arg& s = args[size_t(share)];
        a.buf = s.buf;
        a.start = coin(60) ? s.start : s.start + fdp.ConsumeIntegralInRange<size_t>(0, s.touched);
        if (!(share == a.partner && a.start == s.start && a.kind == s.kind && a.rows == s.rows &&
              a.cols == s.cols && a.ld == s.ld))
          clean = false;
      } else {
        a.buf = int(bufs.size());
        a.start = size_t(a.dl.byte_offset);
        bufs.push_back(std::make_unique<Buf>());
        bufs.back()->size = 0;
      }
      Buf& b = *bufs[size_t(a.buf)];
      b.size = std::max(b.size, a.start + a.touched);
    }
    for (auto& bp : bufs) {
      Buf& b = *bp;
      if (b.mem) continue;
      if (coin(25)) {  // ends at a PROT_NONE page: catches over-reads in uninstrumented code (OpenBLAS)
        const size_t pages = (b.size + kPage - 1) / kPage;
        b.map_len = (pages + 1) * kPage;
        void* m = mmap(nullptr, b.map_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (m == MAP_FAILED) std::abort();
        b.map = static_cast<uint8_t*>(m);
        mprotect(b.map + pages * kPage, kPage, PROT_NONE);
        b.mem = b.map + pages * kPage - b.size;
      } else {
        b.mem = static_cast<uint8_t*>(std::malloc(std::max<size_t>(b.size, 1)));
      }
      std::memset(b.mem, 0xcd, b.size);  // padding pattern
    }
    for (Arg& a : args) {
      if (!a.valid || !a.dl.data) continue;
      uint8_t* first = bufs[size_t(a.buf)]->mem + a.start;
      // The first element is data + byte_offset; split the offset between the two fields.
      const size_t off = std::min<size_t>(size_t(a.dl.byte_offset), a.start);
      a.dl.data = first - off;
      a.dl.byte_offset = off;
    }
  }

  template <class F>
  void each_elem(const Arg& a, F&& f) {
    const size_t es = esize(a.kind);
    uint8_t* base = bufs[size_t(a.buf)]->mem + a.start;
    for (int64_t r = 0; r < a.rows; ++r)
      for (int64_t c = 0; c < a.cols; ++c) f(base + (size_t(r) * size_t(a.ld) + size_t(c)) * es, r, c);
  }

  // Input values: ranges that exercise the numerics, plus NaN/inf/-inf/subnormals sprinkled in.
  void fill_input(const Arg& a, int64_t V, bool nonneg) {
    const int mode = a.value_mode;
    each_elem(a, [&](uint8_t* p, int64_t, int64_t) {
      const uint64_t r = next();
      if (a.kind == I32 || a.kind == I64) {
        int64_t v;
        switch (mode) {
          case 0: case 1: case 2: v = V > 0 ? int64_t(r % uint64_t(V)) : int64_t(r % 8); break;
          case 3: v = (r & 3) == 0 ? -100 : (r & 3) == 1 ? -1 : V > 0 ? int64_t((r >> 8) % uint64_t(V)) : 0; break;
          case 4: v = (r & 7) == 0 ? V : (r & 7) == 1 ? INT32_MIN : (r & 7) == 2 ? INT64_MAX : int64_t(r >> 40) - 8; break;
          default: v = int64_t(r); break;
        }
        if (a.kind == I32) { const int32_t w = int32_t(v); std::memcpy(p, &w, 4); }
        else std::memcpy(p, &v, 8);
        return;
      }
      float f;
      const double u = double(r >> 11) * 0x1.0p-53;  // [0, 1)
      switch (mode) {
        case 0: case 1: f = float(u * 16 - 8); break;
        case 2: f = float(u * 2e4 - 1e4); break;
        case 3: f = float((u - 0.5) * 1e-6); break;
        case 4: { const uint32_t w = uint32_t(r); std::memcpy(&f, &w, 4); break; }  // NaN, inf, anything
        default: f = (r & 15) == 0 ? -INFINITY : float(u * 6 - 3); break;
      }
      if (nonneg) f = std::isnan(f) ? 1.f : std::fabs(f);
      if (mode != 4 && (r >> 60) == 0) {  // 1/16: a special value
        static const float sp[] = {NAN, INFINITY, -INFINITY, 0.f, -0.f, 1e-45f, 3.4e38f, -3.4e38f};
        f = sp[(r >> 8) % 8];
        if (nonneg) f = std::isnan(f) ? 0.f : std::fabs(f);
      }
      uint32_t bits;
      std::memcpy(&bits, &f, 4);
      if (bits == 0x7fa5a5a5u) f = NAN;  // never the output poison
      switch (a.kind) {
        case F32: std::memcpy(p, &f, 4); break;
        case BF16: { uint16_t h = f32_to_bf16(f); if (h == 0x7fa5u) h = 0x7fc0u; std::memcpy(p, &h, 2); break; }
        case F16: { uint16_t h = f32_to_f16(f); if (h == 0x7da5u) h = 0x7e00u; std::memcpy(p, &h, 2); break; }
        default: break;
      }
    });
  }

  // Outputs poisoned first, inputs written over them (an in-place output holds its input's values).
  void fill(int64_t V, const std::vector<int>& nonneg_inputs = {}) {
    for (Arg& a : args)
      if (a.valid && a.dl.data && a.role == Role::Out) each_elem(a, [&](uint8_t* p, int64_t, int64_t) { poison_elem(p, a.kind); });
    for (size_t i = 0; i < args.size(); ++i) {
      const Arg& a = args[i];
      if (!a.valid || !a.dl.data || a.role != Role::In) continue;
      bool nn = false;
      for (int k : nonneg_inputs) nn |= k == int(i);
      fill_input(a, V, nn);
    }
    for (auto& b : bufs) b->snap.assign(b->mem, b->mem + b->size);
  }

  DLTensor* t(int i) { return i < 0 ? nullptr : &args[size_t(i)].dl; }

  // ---------------------------------------------------------------------------------------------
  // Oracles after the call.
  void check_unchanged(const char* fn, fce_status_t s, bool query = false) {
    for (size_t k = 0; k < bufs.size(); ++k) {
      const Buf& b = *bufs[k];
      if (std::memcmp(b.mem, b.snap.data(), b.size) != 0) {
        size_t at = 0;
        while (at < b.size && b.mem[at] == b.snap[at]) ++at;
        std::string who;
        for (const Arg& a : args)
          if (a.buf == int(k)) who += " " + a.name;
        if (query) die("%s_workspace_size wrote byte %zu of a buffer used by%s", fn, at, who.c_str());
        die("%s failed with %d (%s) but wrote byte %zu of a buffer used by%s", fn, int(s), fce_status_string(s), at,
            who.c_str());
      }
    }
  }

  // On success: bytes outside output elements unchanged; every output element written; outputs do not
  // overlap each other or inputs other than their exact in-place partner.
  void check_success(const char* fn) {
    std::vector<std::vector<uint8_t>> writable(bufs.size());
    for (size_t k = 0; k < bufs.size(); ++k) writable[k].assign(bufs[k]->size, 0);
    for (const Arg& a : args)
      if (a.role == Role::Out && a.dl.data) {
        if (!a.valid) die("%s succeeded with an invalid output %s", fn, a.name.c_str());
        each_elem(a, [&](uint8_t* p, int64_t, int64_t) {
          const size_t off = size_t(p - bufs[size_t(a.buf)]->mem);
          std::memset(&writable[size_t(a.buf)][off], 1, esize(a.kind));
        });
      }
    for (size_t k = 0; k < bufs.size(); ++k) {
      const Buf& b = *bufs[k];
      for (size_t i = 0; i < b.size; ++i)
        if (!writable[k][i] && b.mem[i] != b.snap[i]) {
          std::string who;
          for (const Arg& a : args)
            if (a.buf == int(k)) who += " " + a.name;
          die("%s succeeded and wrote byte %zu outside the output elements (buffer used by%s)", fn, i, who.c_str());
        }
    }
    for (size_t i = 0; i < args.size(); ++i) {
      const Arg& a = args[i];
      if (a.role != Role::Out || !a.dl.data) continue;
      bool overlaps_input = false;
      for (const Arg& b : args)
        if (&b != &a && b.role == Role::In && b.dl.data && b.valid && b.buf == a.buf && b.start < a.start + a.touched &&
            a.start < b.start + b.touched)
          overlaps_input = true;
      if (!overlaps_input)
        each_elem(a, [&](uint8_t* p, int64_t r, int64_t c) {
          if (is_poison(p, a.kind))
            die("%s succeeded but left element (%lld, %lld) of %s unwritten", fn, (long long)r, (long long)c,
                a.name.c_str());
        });
    }
    // Aliasing (oracle 4).
    for (size_t i = 0; i < args.size(); ++i) {
      const Arg& a = args[i];
      if (a.role != Role::Out || !a.dl.data) continue;
      for (size_t j = 0; j < args.size(); ++j) {
        const Arg& b = args[j];
        if (j == i || !b.dl.data || !b.valid || b.buf != a.buf) continue;
        if (!(b.start < a.start + a.touched && a.start < b.start + b.touched)) continue;
        if (b.role == Role::Out && j < i) continue;  // reported once per pair
        const bool exact_partner = b.role == Role::In && int(j) == a.partner && a.start == b.start &&
                                   a.kind == b.kind && a.rows == b.rows && a.cols == b.cols && a.ld == b.ld;
        if (exact_partner) continue;
        // F3's signature: the library exempts from the overlap check any range identical to the in-place
        // partner's, so only overlaps of identical byte ranges (the output, the other tensor and some input
        // all spanning the same bytes) are tolerated; any other overlap is fatal even without
        // FCE_FUZZ_KNOWN_BUGS.
        const auto same_range = [](const Arg& x, const Arg& y) {
          return x.buf == y.buf && x.start == y.start && x.touched == y.touched;
        };
        bool f3 = same_range(a, b);
        if (f3) {
          bool input_there = false;
          for (const Arg& x : args) input_there |= x.role == Role::In && x.dl.data && x.valid && same_range(a, x);
          f3 = input_there;
        }
        if (known_bugs() || !f3)
          die("%s succeeded although output %s overlaps %s %s (FCE_STATUS_ALIASING was due)", fn, a.name.c_str(),
              b.role == Role::Out ? "output" : "input", b.name.c_str());
        static auto* seen = new std::vector<std::string>;  // each distinct case reported once
        const std::string key = std::string(fn) + ": output " + a.name + " overlapping " +
                                (b.role == Role::Out ? "output " : "input ") + b.name;
        bool known = false;
        for (const std::string& k : *seen) known |= k == key;
        if (!known) {
          seen->push_back(key);
          std::fprintf(stderr, "KNOWN F3 (aliasing not reported): %s\n", key.c_str());
        }
      }
    }
  }

  void save_after() {
    for (auto& b : bufs) b->after.assign(b->mem, b->mem + b->size);
  }
  void restore() {
    for (auto& b : bufs) std::memcpy(b->mem, b->snap.data(), b->size);
  }
  void check_same_as_after(const char* fn) {
    for (auto& b : bufs)
      if (std::memcmp(b->mem, b->after.data(), b->size) != 0) die("%s: second identical call wrote different bytes", fn);
  }
};

// Options structs on the heap with exactly struct_size bytes (clamped to FCE_MAX_STRUCT_SIZE, which the
// library refuses before reading), so a read past the struct is an ASan report. A struct larger than the
// library's (a newer header's) is valid when the bytes past it are zero, and invalid with a non-zero byte
// there (the header's growing-struct rule).
template <class T>
struct Opt {
  std::unique_ptr<uint8_t[]> mem;
  T* get() { return reinterpret_cast<T*>(mem.get()); }
};
template <class T>
Opt<T> make_opt(Env& e, const T& v, bool* ok) {
  uint32_t size = sizeof(T);
  if (e.coin(6)) {
    size = e.pick<uint32_t>({0, 4, uint32_t(sizeof(T) - 4), uint32_t(sizeof(T) + 8), uint32_t(sizeof(T) + 64),
                             FCE_MAX_STRUCT_SIZE, FCE_MAX_STRUCT_SIZE + 1, 0xffffffffu,
                             e.fdp.ConsumeIntegralInRange<uint32_t>(0, 2 * sizeof(T))});
  }
  if (size < sizeof(T) || size > FCE_MAX_STRUCT_SIZE) *ok = false;
  const size_t alloc = std::max<size_t>(4, size <= FCE_MAX_STRUCT_SIZE ? size : sizeof(T) + 16);
  Opt<T> o;
  o.mem.reset(new uint8_t[alloc]);
  std::memset(o.mem.get(), 0, alloc);
  T copy = v;
  copy.struct_size = size;
  std::memcpy(o.mem.get(), &copy, std::min(alloc, sizeof(T)));
  if (alloc > sizeof(T) && size <= FCE_MAX_STRUCT_SIZE) {
    if (e.coin(3)) {  // a newer option set to a non-default value: refused
      o.mem[e.fdp.ConsumeIntegralInRange<size_t>(sizeof(T), alloc - 1)] = e.fdp.ConsumeIntegralInRange<uint8_t>(1, 255);
      *ok = false;
      ++g_stats.grown_nonzero;
    } else {
      ++g_stats.grown_zero;
    }
  }
  return o;
}

// -------------------------------------------------------------------------------------------------
// Status checks shared by every call.
void check_status(const char* fn, fce_status_t s) {
  if (int(s) < 0 || int(s) > FCE_STATUS_HANDLE_BUSY) die("%s returned %d, not an fce_status_t", fn, int(s));
  if (s == FCE_STATUS_INTERNAL_ERROR) die("%s returned FCE_STATUS_INTERNAL_ERROR", fn);
  // One thread: a busy handle is a call that never gave its handle back.
  if (s == FCE_STATUS_HANDLE_BUSY) die("%s returned FCE_STATUS_HANDLE_BUSY with one thread: %s", fn, fce_last_error_message());
  if (s == FCE_STATUS_NO_DEVICE || s == FCE_STATUS_CUDA_ERROR)
    die("%s returned %s on a CPU handle", fn, fce_status_string(s));
  const char* m = fce_last_error_message();
  if (!m) die("%s: fce_last_error_message() is NULL", fn);
  if (s == FCE_STATUS_SUCCESS && m[0] != '\0') die("%s succeeded but the message is \"%s\"", fn, m);
  if (s != FCE_STATUS_SUCCESS && m[0] == '\0') die("%s failed with %d but the message is empty", fn, int(s));
  if (!fce_status_string(s)) die("fce_status_string(%d) is NULL", int(s));
}

// Static "<fn>_workspace_size" names for the counters.
const char* qname(const char* fn) {
  static auto* names = new std::vector<std::string*>;  // never destroyed: the counters print at exit
  for (std::string* n : *names)
    if (n->compare(0, std::strlen(fn), fn) == 0 && n->size() == std::strlen(fn) + 15) return n->c_str();
  names->push_back(new std::string(std::string(fn) + "_workspace_size"));
  return names->back()->c_str();
}

constexpr size_t kSizePoison = 0xa5a5a5a5a5a5a5a5ull;

// Runs `call` (the op) and `query` (its _workspace_size with the same arguments), applying every oracle.
template <class Call, class Query>
void run(Env& e, const char* fn, Call&& call, Query&& query, bool expect_success) {
  constexpr bool has_query = !std::is_same_v<std::decay_t<Query>, std::nullptr_t>;  // nullptr: an op without one
  const int which = has_query ? e.fdp.ConsumeIntegralInRange(0, 2) : 0;  // 0: the op, 1: the query, 2: both
  if constexpr (has_query) if (which != 0) {
    size_t bytes = kSizePoison;
    const bool null_bytes = e.coin(5);
    const fce_status_t s = query(null_bytes ? nullptr : &bytes);
    check_status(fn, s);
    count(qname(fn), s, expect_success && !null_bytes);
    e.check_unchanged(fn, s, true);  // a query never writes a tensor
    if (s != FCE_STATUS_SUCCESS && bytes != kSizePoison) die("%s_workspace_size failed but wrote *bytes", fn);
    if (s == FCE_STATUS_SUCCESS && null_bytes) die("%s_workspace_size succeeded with bytes == NULL", fn);
    if (s == FCE_STATUS_SUCCESS && bytes == kSizePoison) die("%s_workspace_size succeeded without writing", fn);
    if (s != FCE_STATUS_SUCCESS && expect_success && !null_bytes)
      die("%s_workspace_size rejected a valid call: %s", fn, fce_status_string(s));
  }
  if (which == 1) return;
  // Workspace: NULL (the handle's cache) or a 256-aligned caller buffer of fuzzed size.
  std::unique_ptr<uint8_t, void (*)(void*)> ws(nullptr, std::free);
  size_t ws_bytes = 0;
  if (e.coin(40)) {
    ws_bytes = e.pick<size_t>({0, 16, 256, 4096, e.fdp.ConsumeIntegralInRange<size_t>(0, 1 << 20)});
    ws.reset(static_cast<uint8_t*>(std::aligned_alloc(256, (std::max<size_t>(ws_bytes, 1) + 255) / 256 * 256)));
  } else if (e.coin(5)) {
    ws_bytes = e.fdp.ConsumeIntegral<size_t>();  // ignored with a NULL workspace
  }
  const fce_status_t s = call(ws.get(), ws_bytes);
  check_status(fn, s);
  count(fn, s, expect_success && !ws);
  if (s != FCE_STATUS_SUCCESS) {
    e.check_unchanged(fn, s);
    if (expect_success && !ws && s != FCE_STATUS_OUT_OF_MEMORY)
      die("%s rejected a call that is valid by the header: %s", fn, fce_status_string(s));
    return;
  }
  e.check_success(fn);
  if (e.coin(30)) {  // determinism
    e.save_after();
    e.restore();
    const fce_status_t s2 = call(ws.get(), ws_bytes);
    if (s2 != s) die("%s: second identical call returned %d", fn, int(s2));
    e.check_same_as_after(fn);
  }
}

// -------------------------------------------------------------------------------------------------
// Options from fuzz bytes; `ok` tracks whether they are inside the header's domain.
fce_ce_options_t fuzz_ce_options(Env& e, bool* ok) {
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  if (e.coin(50)) o.reduction = e.coin(90) ? e.fdp.ConsumeIntegralInRange(0, 2) : e.fdp.ConsumeIntegral<int32_t>();
  if (e.coin(30)) o.ignore_index = e.pick<int64_t>({-100, -1, 0, 1, INT64_MIN, e.fdp.ConsumeIntegral<int64_t>()});
  if (e.coin(30)) o.label_smoothing = e.coin(70) ? e.fdp.ConsumeFloatingPointInRange(0.f, 1.f) : e.fuzz_float();
  if (e.coin(30)) o.z_loss_scale = e.coin(70) ? e.fdp.ConsumeFloatingPointInRange(0.f, 1e-2f) : e.fuzz_float();
  if (e.coin(30)) o.softcap = e.coin(70) ? e.fdp.ConsumeFloatingPointInRange(0.f, 50.f) : e.fuzz_float();
  if (e.coin(30)) o.logit_scale = e.coin(70) ? e.fdp.ConsumeFloatingPointInRange(0.1f, 3.f) : e.fuzz_float();
  const auto fin = [](float x) { return std::isfinite(x); };
  if (!(o.reduction >= 0 && o.reduction <= 2)) *ok = false;
  if (!(fin(o.label_smoothing) && o.label_smoothing >= 0 && o.label_smoothing <= 1)) *ok = false;
  if (!(fin(o.z_loss_scale) && o.z_loss_scale >= 0)) *ok = false;
  if (!(fin(o.softcap) && o.softcap >= 0)) *ok = false;
  if (!(fin(o.logit_scale) && o.logit_scale > 0)) *ok = false;
  return o;
}

struct Dims {
  int64_t N, V, H, K;
};

Dims fuzz_dims(Env& e) {
  Dims d;
  d.N = e.fdp.ConsumeIntegralInRange<int64_t>(1, 8);
  d.V = e.coin(70) ? e.fdp.ConsumeIntegralInRange<int64_t>(1, 40) : e.fdp.ConsumeIntegralInRange<int64_t>(1, 500);
  d.H = e.fdp.ConsumeIntegralInRange<int64_t>(1, 8);
  d.K = e.fdp.ConsumeIntegralInRange<int64_t>(1, std::min<int64_t>(d.V + 2, 8));
  return d;
}

Kind fkind(Env& e) { return Kind(e.fdp.ConsumeIntegralInRange(0, 2)); }
Kind ikind(Env& e) { return e.coin(50) ? I32 : I64; }

std::vector<int64_t> reduced_shape(Env& e, int red, int64_t N) {
  if (red == FCE_REDUCTION_NONE) return {N};
  return e.coin(70) ? std::vector<int64_t>{} : std::vector<int64_t>{1};
}

fce_handle_t pick_handle(Env& e, fce_handle_t h, bool* ok) {
  if (e.coin(3)) { *ok = false; return nullptr; }
  return h;
}

// -------------------------------------------------------------------------------------------------
void fuzz_cross_entropy(Env& e, fce_handle_t h0, bool backward) {
  const Dims d = fuzz_dims(e);
  bool ok = true;
  fce_handle_t h = pick_handle(e, h0, &ok);
  const fce_ce_options_t ov = fuzz_ce_options(e, &ok);
  const bool use_opts = e.coin(85);
  const int red = use_opts ? ov.reduction : FCE_REDUCTION_MEAN;
  const Kind lk = fkind(e);
  const int logits = e.add("logits", Role::In, lk, {d.N, d.V});
  const int targets = e.add("targets", Role::In, ikind(e), {d.N});
  const int weights = use_opts && e.coin(25) ? e.add("class_weights", Role::In, F32, {d.V}) : -1;
  const bool none = red == FCE_REDUCTION_NONE;
  int loss = -1, lse = -1, zl = -1, amax = -1, ent = -1, dl = -1, gl = -1, ge = -1;
  const bool ex = backward && e.coin(50);  // the backward through fce_cross_entropy_bwd_ex
  const auto row_or_scalar = [&] { return e.coin(60) ? std::vector<int64_t>{d.N} : std::vector<int64_t>{}; };
  if (!backward) {
    if (e.coin(97)) loss = e.add("loss", Role::Out, F32, reduced_shape(e, red, d.N));
    else ok = false;
    if (e.coin(40)) lse = e.add("lse", Role::Out, F32, {d.N});
    if (e.coin(25)) zl = e.add("z_loss", Role::Out, F32, reduced_shape(e, red, d.N));
    if (e.coin(30)) amax = e.add("argmax", Role::Out, ikind(e), {d.N});
    if (e.coin(30)) ent = e.add("entropy", Role::Out, F32, {d.N});
    if (e.coin(50)) {
      dl = e.add("dlogits", Role::Out, lk, {d.N, d.V}, logits);
      if (e.coin(40)) gl = e.add("grad_loss", Role::In, F32, none && e.coin(60) ? std::vector<int64_t>{d.N} : std::vector<int64_t>{});
      if (e.coin(25)) ge = e.add("grad_entropy", Role::In, F32, row_or_scalar());
    } else if (e.coin(5)) {
      ge = e.add("grad_entropy", Role::In, F32, row_or_scalar());  // without dlogits: refused
      ok = false;
    }
  } else {
    lse = e.add("lse", Role::In, F32, {d.N});
    if (e.coin(50)) gl = e.add("grad_loss", Role::In, F32, none && e.coin(60) ? std::vector<int64_t>{d.N} : std::vector<int64_t>{});
    if (ex && e.coin(50)) {
      ge = e.add("grad_entropy", Role::In, F32, row_or_scalar());
      if (e.coin(90)) ent = e.add("entropy", Role::In, F32, {d.N});
      else ok = false;  // grad_entropy without the saved entropy: refused
    }
    if (e.coin(97)) dl = e.add("dlogits", Role::Out, lk, {d.N, d.V}, logits);
    else ok = false;
  }
  e.place();
  e.fill(d.V, {weights});
  fce_ce_options_t o = ov;
  o.class_weights = e.t(weights);
  Opt<fce_ce_options_t> opt = make_opt(e, o, &ok);
  fce_ce_options_t* op = use_opts ? opt.get() : nullptr;
  const bool clean = ok && e.clean;
  if (!backward) {
    fce_ce_outputs_t ou = FCE_CE_OUTPUTS_INIT;
    ou.loss = e.t(loss); ou.lse = e.t(lse); ou.z_loss = e.t(zl); ou.argmax = e.t(amax); ou.entropy = e.t(ent);
    ou.dlogits = e.t(dl); ou.grad_loss = e.t(gl); ou.grad_entropy = e.t(ge);
    bool ook = true;
    Opt<fce_ce_outputs_t> out = make_opt(e, ou, &ook);
    fce_ce_outputs_t* outp = e.coin(2) ? nullptr : out.get();
    const bool expect = clean && ook && outp;
    run(e, "fce_cross_entropy_fwd",
        [&](void* ws, size_t wb) { return fce_cross_entropy_fwd(h, nullptr, e.t(logits), e.t(targets), op, outp, ws, wb); },
        [&](size_t* b) { return fce_cross_entropy_fwd_workspace_size(h, e.t(logits), e.t(targets), op, outp, b); },
        expect);
  } else if (ex) {
    fce_ce_bwd_inputs_t iv = FCE_CE_BWD_INPUTS_INIT;
    iv.lse = e.t(lse); iv.grad_loss = e.t(gl); iv.entropy = e.t(ent); iv.grad_entropy = e.t(ge);
    bool iok = true;
    Opt<fce_ce_bwd_inputs_t> in = make_opt(e, iv, &iok);
    const fce_ce_bwd_inputs_t* ip = e.coin(2) ? nullptr : in.get();
    run(e, "fce_cross_entropy_bwd_ex",
        [&](void* ws, size_t wb) {
          return fce_cross_entropy_bwd_ex(h, nullptr, e.t(logits), e.t(targets), ip, op, e.t(dl), ws, wb);
        },
        [&](size_t* b) { return fce_cross_entropy_bwd_ex_workspace_size(h, e.t(logits), e.t(targets), ip, op, e.t(dl), b); },
        clean && iok && ip);
  } else {
    run(e, "fce_cross_entropy_bwd",
        [&](void* ws, size_t wb) {
          return fce_cross_entropy_bwd(h, nullptr, e.t(logits), e.t(targets), e.t(lse), e.t(gl), op, e.t(dl), ws, wb);
        },
        [&](size_t* b) {
          return fce_cross_entropy_bwd_workspace_size(h, e.t(logits), e.t(targets), e.t(lse), e.t(gl), op, e.t(dl), b);
        },
        clean);
  }
}

// A shard's (vocab_start, vocab_total) around V, mostly valid; `ok` false when not.
void fuzz_shard(Env& e, const Dims& d, int64_t* start, int64_t* total, bool* ok) {
  *total = e.coin(90) ? d.V + e.fdp.ConsumeIntegralInRange<int64_t>(-d.V + 1, 3 * d.V) : e.fdp.ConsumeIntegral<int64_t>();
  *start = e.coin(90) ? e.fdp.ConsumeIntegralInRange<int64_t>(0, std::max<int64_t>(*total, 1) - 1)
                      : e.fdp.ConsumeIntegral<int64_t>();
  // The header: 0 <= vocab_start <= vocab_total <= 2^31 - 1 (start == total: a shard of padding alone).
  if (!(*total > 0 && *start >= 0 && *start <= *total && *total <= INT32_MAX)) *ok = false;
}

// Logsumexp: whole rows, or a shard's records (fce_logsumexp_partial), or their combine.
void fuzz_logsumexp(Env& e, fce_handle_t h0) {
  const Dims d = fuzz_dims(e);
  bool ok = true;
  fce_handle_t h = pick_handle(e, h0, &ok);
  fce_lse_options_t ov = FCE_LSE_OPTIONS_INIT;
  if (e.coin(40)) ov.scale = e.coin(60) ? e.fdp.ConsumeFloatingPointInRange(0.01f, 4.f) : e.fuzz_float();
  const int mode = e.fdp.ConsumeIntegralInRange(0, 3);  // 0-1 whole rows, 2 partial, 3 combine
  if (mode == 3) {
    const int64_t W = e.fdp.ConsumeIntegralInRange<int64_t>(1, 3);
    const int rec = e.add("records", Role::In, F32, {W, d.N, FCE_LSE_RECORD_FIELDS});
    const int lse = e.coin(97) ? e.add("lse", Role::Out, F32, {d.N}) : (ok = false, -1);
    e.place();
    e.fill(d.V);
    run(e, "fce_logsumexp_combine", [&](void*, size_t) { return fce_logsumexp_combine(h, nullptr, e.t(rec), e.t(lse)); },
        nullptr, ok && e.clean);
    return;
  }
  if (mode == 2) {
    fuzz_shard(e, d, &ov.vocab_start, &ov.vocab_total, &ok);
    if (!(std::isfinite(ov.scale) && ov.scale > 0)) ok = false;
    const int x = e.add("x", Role::In, fkind(e), {d.N, d.V});
    const int rec = e.add("records", Role::Out, F32, {d.N, FCE_LSE_RECORD_FIELDS});
    e.place();
    e.fill(d.V);
    Opt<fce_lse_options_t> opt = make_opt(e, ov, &ok);
    const fce_lse_options_t* op = e.coin(3) ? (ok = false, nullptr) : opt.get();
    run(e, "fce_logsumexp_partial", [&](void*, size_t) { return fce_logsumexp_partial(h, nullptr, e.t(x), op, e.t(rec)); },
        nullptr, ok && e.clean);
    return;
  }
  const bool use_opts = e.coin(80);
  if (use_opts && !(std::isfinite(ov.scale) && ov.scale > 0)) ok = false;
  const int x = e.add("x", Role::In, fkind(e), {d.N, d.V});
  const int lse = e.coin(97) ? e.add("lse", Role::Out, F32, {d.N}) : (ok = false, -1);
  e.place();
  e.fill(d.V);
  bool sok = true;
  Opt<fce_lse_options_t> opt = make_opt(e, ov, &sok);
  fce_lse_options_t* op = use_opts ? opt.get() : nullptr;
  if (use_opts && !sok) ok = false;
  run(e, "fce_logsumexp", [&](void* ws, size_t wb) { return fce_logsumexp(h, nullptr, e.t(x), op, e.t(lse), ws, wb); },
      [&](size_t* b) { return fce_logsumexp_workspace_size(h, e.t(x), op, e.t(lse), b); }, ok && e.clean);
}

void fuzz_softmax(Env& e, fce_handle_t h0) {
  const Dims d = fuzz_dims(e);
  bool ok = true;
  fce_handle_t h = pick_handle(e, h0, &ok);
  fce_softmax_options_t ov = FCE_SOFTMAX_OPTIONS_INIT;
  if (e.coin(50)) ov.temperature = e.coin(50) ? e.fdp.ConsumeFloatingPointInRange(0.f, 4.f) : e.fuzz_float();
  const Kind lk = fkind(e);
  const int logits = e.add("logits", Role::In, lk, {d.N, d.V});
  const bool use_opts = e.coin(85);
  const int temps = use_opts && e.coin(30) ? e.add("temperatures", Role::In, F32, {d.N}) : -1;
  if (use_opts && temps < 0 && !(!std::isnan(ov.temperature) && ov.temperature >= 0)) ok = false;
  int lse = -1;
  if (use_opts && e.coin(25)) {  // a vocabulary shard: one finite temperature > 0 and the rows' lse
    fuzz_shard(e, d, &ov.vocab_start, &ov.vocab_total, &ok);
    if (temps >= 0 || !(std::isfinite(ov.temperature) && ov.temperature > 0)) ok = false;
    if (e.coin(95)) lse = e.add("lse", Role::In, F32, {d.N});
    else ok = false;
  }
  const int pmode = e.fdp.ConsumeIntegralInRange(0, 3);  // 0 probs, 1 logprobs, 2 both, 3 neither
  int probs = -1, logp = -1;
  if (pmode == 0 || pmode == 2) probs = e.add("probs", Role::Out, e.coin(50) ? F32 : lk, {d.N, d.V}, logits);
  if (pmode == 1 || pmode == 2) logp = e.add("logprobs", Role::Out, e.coin(50) ? F32 : lk, {d.N, d.V}, pmode == 1 ? logits : -1);
  if (pmode == 3) ok = false;
  e.place();
  e.fill(d.V);
  fce_softmax_options_t o = ov;
  o.temperatures = e.t(temps);
  o.lse = e.t(lse);
  Opt<fce_softmax_options_t> opt = make_opt(e, o, &ok);
  fce_softmax_options_t* op = use_opts ? opt.get() : nullptr;
  run(e, "fce_temp_softmax",
      [&](void* ws, size_t wb) { return fce_temp_softmax(h, nullptr, e.t(logits), op, e.t(probs), e.t(logp), ws, wb); },
      [&](size_t* b) { return fce_temp_softmax_workspace_size(h, e.t(logits), op, e.t(probs), e.t(logp), b); },
      ok && e.clean);
}

void fuzz_kd(Env& e, fce_handle_t h0) {
  const Dims d = fuzz_dims(e);
  bool ok = true;
  fce_handle_t h = pick_handle(e, h0, &ok);
  fce_kd_options_t ov = FCE_KD_OPTIONS_INIT;
  if (e.coin(50)) ov.divergence = e.coin(90) ? e.fdp.ConsumeIntegralInRange(0, 2) : e.fdp.ConsumeIntegral<int32_t>();
  if (e.coin(40)) ov.beta = e.coin(70) ? e.pick<float>({0.f, 1.f, e.fdp.ConsumeFloatingPointInRange(0.f, 1.f)}) : e.fuzz_float();
  if (e.coin(40)) ov.temperature = e.coin(70) ? e.fdp.ConsumeFloatingPointInRange(0.1f, 5.f) : e.fuzz_float();
  if (e.coin(30)) ov.scale_by_t2 = e.fdp.ConsumeIntegral<int32_t>();
  if (e.coin(40)) ov.topk_norm = e.coin(90) ? e.fdp.ConsumeIntegralInRange(0, 1) : e.fdp.ConsumeIntegral<int32_t>();
  if (e.coin(40)) ov.reduction = e.coin(90) ? e.fdp.ConsumeIntegralInRange(0, 2) : e.fdp.ConsumeIntegral<int32_t>();
  if (e.coin(30)) ov.ignore_index = e.pick<int64_t>({-100, -1, 0, e.fdp.ConsumeIntegral<int64_t>()});
  const bool use_opts = e.coin(85);
  if (use_opts) {
    if (!(ov.divergence >= 0 && ov.divergence <= 2)) ok = false;
    if (!(std::isfinite(ov.beta) && ov.beta >= 0 && ov.beta <= 1)) ok = false;
    if (!(ov.temperature >= FCE_KD_TEMPERATURE_MIN && ov.temperature <= FCE_KD_TEMPERATURE_MAX)) ok = false;
    if (!(ov.topk_norm == 0 || ov.topk_norm == 1)) ok = false;
    if (!(ov.reduction >= 0 && ov.reduction <= 2)) ok = false;
  }
  const int red = use_opts ? ov.reduction : FCE_REDUCTION_MEAN;
  const Kind sk = fkind(e);
  const int student = e.add("student", Role::In, sk, {d.N, d.V});
  const int tmode = e.fdp.ConsumeIntegralInRange(0, 9);  // 0-4 full, 5-8 top-K, 9 broken
  int tlogits = -1, ids = -1, lp = -1;
  if (tmode <= 4) {
    tlogits = e.add("teacher->logits", Role::In, fkind(e), {d.N, d.V});
  } else {
    ids = e.add("teacher->topk_ids", Role::In, ikind(e), {d.N, d.K});
    lp = e.add("teacher->topk_logprobs", Role::In, F32, {d.N, d.K});
  }
  if (tmode == 9) {  // both teachers, or half a top-K teacher
    ok = false;
    if (e.coin(50)) tlogits = e.add("teacher->logits", Role::In, fkind(e), {d.N, d.V});
    else lp = -1;
  }
  const int targets = e.coin(40) ? e.add("targets", Role::In, ikind(e), {d.N}) : -1;
  int loss = -1, ds = -1, gl = -1;
  if (e.coin(97)) loss = e.add("loss", Role::Out, F32, reduced_shape(e, red, d.N));
  else ok = false;
  if (e.coin(50)) {
    ds = e.add("dstudent", Role::Out, sk, {d.N, d.V}, student);
    if (e.coin(40)) gl = e.add("grad_loss", Role::In, F32, red == FCE_REDUCTION_NONE && e.coin(60) ? std::vector<int64_t>{d.N} : std::vector<int64_t>{});
  }
  e.place();
  e.fill(d.V);
  fce_kd_teacher_t tv = FCE_KD_TEACHER_INIT;
  tv.logits = e.t(tlogits); tv.topk_ids = e.t(ids); tv.topk_logprobs = e.t(lp);
  Opt<fce_kd_teacher_t> teacher = make_opt(e, tv, &ok);
  fce_kd_teacher_t* tp = e.coin(2) ? (ok = false, nullptr) : teacher.get();
  Opt<fce_kd_options_t> opt = make_opt(e, ov, &ok);
  fce_kd_options_t* op = use_opts ? opt.get() : nullptr;
  fce_kd_outputs_t ou = FCE_KD_OUTPUTS_INIT;
  ou.loss = e.t(loss); ou.dstudent = e.t(ds); ou.grad_loss = e.t(gl);
  Opt<fce_kd_outputs_t> out = make_opt(e, ou, &ok);
  fce_kd_outputs_t* outp = e.coin(2) ? (ok = false, nullptr) : out.get();
  run(e, "fce_kd_loss",
      [&](void* ws, size_t wb) { return fce_kd_loss(h, nullptr, e.t(student), tp, e.t(targets), op, outp, ws, wb); },
      [&](size_t* b) { return fce_kd_loss_workspace_size(h, e.t(student), tp, e.t(targets), op, outp, b); },
      ok && e.clean);
}

// Vocabulary-parallel KD: a shard's records, their combine ([W, N, K] records), a shard's dstudent.
void fuzz_kd_vp(Env& e, fce_handle_t h0) {
  const Dims d = fuzz_dims(e);
  bool ok = true;
  fce_handle_t h = pick_handle(e, h0, &ok);
  fce_kd_options_t ov = FCE_KD_OPTIONS_INIT;
  ov.divergence = e.coin(90) ? e.fdp.ConsumeIntegralInRange(0, 2) : e.fdp.ConsumeIntegral<int32_t>();
  if (e.coin(40)) ov.beta = e.pick<float>({0.f, 1.f, 0.5f});
  if (e.coin(40)) ov.temperature = e.coin(70) ? e.fdp.ConsumeFloatingPointInRange(0.1f, 5.f) : e.fuzz_float();
  if (e.coin(30)) ov.scale_by_t2 = e.fdp.ConsumeIntegral<int32_t>();
  if (e.coin(40)) ov.reduction = e.coin(90) ? e.fdp.ConsumeIntegralInRange(0, 2) : e.fdp.ConsumeIntegral<int32_t>();
  fuzz_shard(e, d, &ov.vocab_start, &ov.vocab_total, &ok);
  const int div = ov.divergence == 2 && ov.beta == 0.f ? 0 : ov.divergence == 2 && ov.beta == 1.f ? 1 : ov.divergence;
  if (!(div == 0 || div == 1)) ok = false;  // JSD: not implemented; others invalid
  if (!(ov.temperature >= FCE_KD_TEMPERATURE_MIN && ov.temperature <= FCE_KD_TEMPERATURE_MAX)) ok = false;
  if (!(ov.reduction >= 0 && ov.reduction <= 2)) ok = false;
  const int mode = e.fdp.ConsumeIntegralInRange(0, 2);  // 0 partial, 1 bwd, 2 combine
  const Kind sk = fkind(e);
  const int64_t W = e.fdp.ConsumeIntegralInRange<int64_t>(1, 3);
  int student = -1, tlogits = -1, rec = -1, targets = -1, loss = -1, stats = -1, gl = -1, ds = -1;
  if (mode != 2) {
    student = e.add("student", Role::In, sk, {d.N, d.V});
    tlogits = e.add("teacher->logits", Role::In, fkind(e), {d.N, d.V});
  }
  if (mode != 0 && e.coin(50)) targets = e.add("targets", Role::In, ikind(e), {d.N});
  if (mode == 0) rec = e.add("records", Role::Out, F32, {d.N, FCE_KD_RECORD_FIELDS});
  if (mode == 1) {
    stats = e.add("row_stats", Role::In, F32, {d.N, FCE_KD_ROW_STATS_FIELDS});
    if (e.coin(40)) gl = e.add("grad_loss", Role::In, F32, ov.reduction == FCE_REDUCTION_NONE && e.coin(60) ? std::vector<int64_t>{d.N} : std::vector<int64_t>{});
    ds = e.add("dstudent", Role::Out, sk, {d.N, d.V}, student);
  }
  if (mode == 2) {
    rec = e.add("records", Role::In, F32, {W, d.N, FCE_KD_RECORD_FIELDS});
    loss = e.add("loss", Role::Out, F32, reduced_shape(e, ov.reduction, d.N));
    if (e.coin(60)) stats = e.add("row_stats", Role::Out, F32, {d.N, FCE_KD_ROW_STATS_FIELDS});
  }
  e.place();
  e.fill(d.V);
  fce_kd_teacher_t tv = FCE_KD_TEACHER_INIT;
  tv.logits = e.t(tlogits);
  Opt<fce_kd_teacher_t> teacher = make_opt(e, tv, &ok);
  Opt<fce_kd_options_t> opt = make_opt(e, ov, &ok);
  const fce_kd_options_t* op = e.coin(3) ? (ok = false, nullptr) : opt.get();
  const bool clean = ok && e.clean;
  if (mode == 0) {
    run(e, "fce_kd_partial", [&](void*, size_t) {
      return fce_kd_partial(h, nullptr, e.t(student), teacher.get(), op, e.t(rec));
    }, nullptr, clean);
  } else if (mode == 1) {
    run(e, "fce_kd_bwd",
        [&](void* ws, size_t wb) {
          return fce_kd_bwd(h, nullptr, e.t(student), teacher.get(), e.t(targets), e.t(stats), op, e.t(gl), e.t(ds), ws, wb);
        },
        [&](size_t* b) {
          return fce_kd_bwd_workspace_size(h, e.t(student), teacher.get(), e.t(targets), e.t(stats), op, e.t(gl), e.t(ds), b);
        },
        clean);
  } else {
    run(e, "fce_kd_combine",
        [&](void* ws, size_t wb) {
          return fce_kd_combine(h, nullptr, e.t(rec), e.t(targets), op, e.t(loss), e.t(stats), ws, wb);
        },
        [&](size_t* b) { return fce_kd_combine_workspace_size(h, e.t(rec), e.t(targets), op, e.t(loss), e.t(stats), b); },
        clean);
  }
}

void fuzz_linear_ce(Env& e, fce_handle_t h0, bool backward) {
  Dims d = fuzz_dims(e);
  d.V = std::min<int64_t>(d.V, 64);
  bool ok = true;
  fce_handle_t h = pick_handle(e, h0, &ok);
  const fce_ce_options_t ov = fuzz_ce_options(e, &ok);
  const bool use_opts = e.coin(85);
  const int red = use_opts ? ov.reduction : FCE_REDUCTION_MEAN;
  const Kind k = fkind(e);
  const int hidden = e.add("hidden", Role::In, k, {d.N, d.H});
  const int weight = e.add("weight", Role::In, k, {d.V, d.H});
  const int bias = e.coin(40) ? e.add("bias", Role::In, k, {d.V}) : -1;
  const int targets = e.add("targets", Role::In, ikind(e), {d.N});
  // A vocabulary shard (the weight's rows): the forward refuses it; the backward takes it, with an fp32 dhidden
  // and class weights of vocab_total.
  const bool shard = use_opts && e.coin(25);
  int64_t vs = 0, vt = 0;
  if (shard) fuzz_shard(e, d, &vs, &vt, &ok);
  if (shard && !backward) ok = false;
  const int weights = use_opts && e.coin(20) ? e.add("class_weights", Role::In, F32, {d.V}) : -1;
  if (shard && weights >= 0 && vt != d.V) ok = false;
  const int lse_in = backward ? (e.coin(97) ? e.add("lse", Role::In, F32, {d.N}) : (ok = false, -1)) : -1;
  int loss = -1, lse = -1, zl = -1, amax = -1, ent = -1;
  if (!backward || e.coin(5)) {
    if (backward) ok = false;
    if (backward || e.coin(97)) loss = e.add("loss", Role::Out, F32, reduced_shape(e, red, d.N));
    else ok = false;
    if (e.coin(30)) lse = e.add("outputs->lse", Role::Out, F32, {d.N});
    if (e.coin(20)) zl = e.add("z_loss", Role::Out, F32, reduced_shape(e, red, d.N));
    if (e.coin(20)) amax = e.add("argmax", Role::Out, ikind(e), {d.N});
    if (e.coin(20)) ent = e.add("entropy", Role::Out, F32, {d.N});
  }
  int dh = -1, dw = -1, db = -1, gl = -1;
  const auto gk = [&] { return e.coin(50) ? F32 : Kind(e.fdp.ConsumeIntegralInRange(0, 2)); };
  if (e.coin(backward ? 70 : 40)) {
    const Kind dk = gk();
    dh = e.add("dhidden", Role::Out, dk, {d.N, d.H});
    if (shard && dk != F32) ok = false;
  }
  if (e.coin(backward ? 60 : 30)) dw = e.add("dweight", Role::Out, gk(), {d.V, d.H});
  if (e.coin(20)) {
    db = e.add("dbias", Role::Out, gk(), {d.V});
    if (bias < 0) ok = false;
  }
  if (backward && dh < 0 && dw < 0 && db < 0) ok = false;
  if ((dh >= 0 || dw >= 0 || db >= 0) && e.coin(40))
    gl = e.add("grad_loss", Role::In, F32, red == FCE_REDUCTION_NONE && e.coin(60) ? std::vector<int64_t>{d.N} : std::vector<int64_t>{});
  int ge = -1, sent = -1;  // grad_entropy, and the backward's saved entropy
  if ((dh >= 0 || dw >= 0 || db >= 0) && e.coin(20)) {
    ge = e.add("grad_entropy", Role::In, F32, e.coin(60) ? std::vector<int64_t>{d.N} : std::vector<int64_t>{});
    if (backward) {
      if (e.coin(90)) sent = e.add("saved_entropy", Role::In, F32, {d.N});
      else ok = false;
    }
  }
  e.place();
  e.fill(d.V, {weights});
  fce_ce_options_t o = ov;
  o.class_weights = e.t(weights);
  o.vocab_start = vs;
  o.vocab_total = vt;
  Opt<fce_ce_options_t> opt = make_opt(e, o, &ok);
  fce_ce_options_t* op = use_opts ? opt.get() : nullptr;
  fce_linear_ce_outputs_t ou = FCE_LINEAR_CE_OUTPUTS_INIT;
  ou.loss = e.t(loss); ou.lse = e.t(lse); ou.z_loss = e.t(zl); ou.argmax = e.t(amax); ou.entropy = e.t(ent);
  ou.dhidden = e.t(dh); ou.dweight = e.t(dw); ou.dbias = e.t(db); ou.grad_loss = e.t(gl);
  ou.grad_entropy = e.t(ge); ou.saved_entropy = e.t(sent);
  Opt<fce_linear_ce_outputs_t> out = make_opt(e, ou, &ok);
  fce_linear_ce_outputs_t* outp = e.coin(2) ? (ok = false, nullptr) : out.get();
  if (!backward)
    run(e, "fce_linear_cross_entropy_fwd",
        [&](void* ws, size_t wb) {
          return fce_linear_cross_entropy_fwd(h, nullptr, e.t(hidden), e.t(weight), e.t(bias), e.t(targets), op, outp, ws, wb);
        },
        [&](size_t* b) {
          return fce_linear_cross_entropy_fwd_workspace_size(h, e.t(hidden), e.t(weight), e.t(bias), e.t(targets), op, outp, b);
        },
        ok && e.clean);
  else
    run(e, "fce_linear_cross_entropy_bwd",
        [&](void* ws, size_t wb) {
          return fce_linear_cross_entropy_bwd(h, nullptr, e.t(hidden), e.t(weight), e.t(bias), e.t(targets), e.t(lse_in),
                                              op, outp, ws, wb);
        },
        [&](size_t* b) {
          return fce_linear_cross_entropy_bwd_workspace_size(h, e.t(hidden), e.t(weight), e.t(bias), e.t(targets),
                                                             e.t(lse_in), op, outp, b);
        },
        ok && e.clean);
}

// A shard of the LM head's records (fce_linear_cross_entropy_partial).
void fuzz_linear_partial(Env& e, fce_handle_t h0) {
  Dims d = fuzz_dims(e);
  d.V = std::min<int64_t>(d.V, 64);
  bool ok = true;
  fce_handle_t h = pick_handle(e, h0, &ok);
  fce_ce_options_t o = fuzz_ce_options(e, &ok);
  fuzz_shard(e, d, &o.vocab_start, &o.vocab_total, &ok);
  const Kind k = fkind(e);
  const int hidden = e.add("hidden", Role::In, k, {d.N, d.H});
  const int weight = e.add("weight", Role::In, k, {d.V, d.H});
  const int bias = e.coin(40) ? e.add("bias", Role::In, k, {d.V}) : -1;
  const int targets = e.add("targets", Role::In, ikind(e), {d.N});
  const int weights = e.coin(20) ? e.add("class_weights", Role::In, F32, {d.V}) : -1;
  if (weights >= 0 && o.vocab_total != d.V) ok = false;
  int64_t K = e.pick<int64_t>({FCE_CE_RECORD_FIELDS_LOSS, FCE_CE_RECORD_FIELDS_ENTROPY, FCE_CE_RECORD_FIELDS_ALL});
  if (e.coin(5)) K = e.fdp.ConsumeIntegralInRange<int64_t>(1, 9);
  if (K != FCE_CE_RECORD_FIELDS_LOSS && K != FCE_CE_RECORD_FIELDS_ENTROPY && K != FCE_CE_RECORD_FIELDS_ALL) ok = false;
  const int rec = e.add("records", Role::Out, F32, {d.N, K});
  e.place();
  e.fill(d.V, {weights});
  o.class_weights = e.t(weights);
  Opt<fce_ce_options_t> opt = make_opt(e, o, &ok);
  const fce_ce_options_t* op = e.coin(3) ? (ok = false, nullptr) : opt.get();
  run(e, "fce_linear_cross_entropy_partial",
      [&](void* ws, size_t wb) {
        return fce_linear_cross_entropy_partial(h, nullptr, e.t(hidden), e.t(weight), e.t(bias), e.t(targets), op,
                                                e.t(rec), ws, wb);
      },
      [&](size_t* b) {
        return fce_linear_cross_entropy_partial_workspace_size(h, e.t(hidden), e.t(weight), e.t(bias), e.t(targets),
                                                               op, e.t(rec), b);
      },
      ok && e.clean);
}

// Handles, statuses, version.
void fuzz_misc(Env& e) {
  const int32_t dt = e.pick<int32_t>({kDLCPU, kDLCUDA, kDLCUDAHost, kDLOpenCL, 0, -1, e.fdp.ConsumeIntegral<int32_t>()});
  int32_t id = e.pick<int32_t>({0, 1, -1, INT32_MAX, e.fdp.ConsumeIntegral<int32_t>()});
  if (!known_bugs() && dt == kDLCUDA && id < 0) id = 0;  // F2
  fce_handle_t poison = reinterpret_cast<fce_handle_t>(uintptr_t(0xa5a5a5a5a5a5a5a5ull));
  fce_handle_t h = poison;
  const bool null_out = e.coin(10);
  const fce_status_t s = fce_handle_create(dt, id, null_out ? nullptr : &h);
  count("fce_handle_create", s, dt == kDLCPU && !null_out);
  if (int(s) < 0 || int(s) > FCE_STATUS_HANDLE_BUSY || s == FCE_STATUS_INTERNAL_ERROR)
    die("fce_handle_create returned %d", int(s));
  const char* m = fce_last_error_message();
  if (!m || (s == FCE_STATUS_SUCCESS) != (m[0] == '\0')) die("fce_handle_create: message/status disagree");
  if (s != FCE_STATUS_SUCCESS && h != poison) die("fce_handle_create failed but wrote *out");
  if (s == FCE_STATUS_SUCCESS && dt != kDLCPU && dt != kDLCUDA) die("fce_handle_create accepted device type %d", dt);
  if (null_out && s == FCE_STATUS_SUCCESS) die("fce_handle_create succeeded with out == NULL");
  if (dt == kDLCUDA && s == FCE_STATUS_SUCCESS) die("a CUDA handle from a build without CUDA");
  if (dt == kDLCUDA && id >= 0 && !null_out && s != FCE_STATUS_NO_DEVICE) die("CUDA handle: %d, not NO_DEVICE", int(s));
  if (s == FCE_STATUS_SUCCESS) {
    int32_t t = -7, i = -7;
    const int which = e.fdp.ConsumeIntegralInRange(0, 3);
    if (fce_handle_get_device(h, which & 1 ? nullptr : &t, which & 2 ? nullptr : &i) != FCE_STATUS_SUCCESS)
      die("fce_handle_get_device failed");
    if (!(which & 1) && t != kDLCPU) die("get_device: type %d", t);
    if (!(which & 2) && i != 0) die("get_device: id %d", i);
    if (fce_handle_destroy(h) != FCE_STATUS_SUCCESS) die("fce_handle_destroy failed");
  }
  int32_t t = -7, i = -7;
  if (fce_handle_get_device(nullptr, &t, &i) != FCE_STATUS_INVALID_ARGUMENT || t != -7 || i != -7)
    die("fce_handle_get_device(NULL) misbehaved");
  if (fce_handle_destroy(nullptr) != FCE_STATUS_SUCCESS) die("fce_handle_destroy(NULL) failed");
  const int code = known_bugs() ? e.fdp.ConsumeIntegral<int32_t>() : e.fdp.ConsumeIntegralInRange(0, 16);  // F1
  const char* str = fce_status_string(fce_status_t(code));
  if (!str || !str[0]) die("fce_status_string(%d) is NULL or empty", code);
  if ((code < 0 || code > FCE_STATUS_HANDLE_BUSY) && std::strcmp(str, "unknown status") != 0)
    die("fce_status_string(%d) = \"%s\"", code, str);
  if (fce_version_number() != FCE_VERSION_NUMBER || fce_abi_version() != FCE_ABI_VERSION || !fce_version_string())
    die("version mismatch");
  // NCCL mode from a CPU handle or without a communicator: refused, nothing written, nothing dereferenced.
  fce_handle_t cpu = nullptr;
  if (fce_handle_create(kDLCPU, 0, &cpu) != FCE_STATUS_SUCCESS) die("cannot create a CPU handle");
  fce_comm_t c = reinterpret_cast<fce_comm_t>(uintptr_t(0x5a5a5a5a5a5a5a5aull));
  const uintptr_t fake = e.pick<uintptr_t>({0, 1, 0x1000, uintptr_t(e.fdp.ConsumeIntegral<uint64_t>())});
  const fce_status_t cs = fce_comm_create(e.coin(4) ? nullptr : cpu, reinterpret_cast<struct ncclComm*>(fake),
                                          e.coin(8) ? nullptr : &c);
  count("fce_comm_create", cs, false);
  if (cs != FCE_STATUS_INVALID_ARGUMENT) die("fce_comm_create on a CPU handle returned %d", int(cs));
  if (c != nullptr && c != reinterpret_cast<fce_comm_t>(uintptr_t(0x5a5a5a5a5a5a5a5aull)))
    die("fce_comm_create failed but wrote a communicator");
  int32_t rank = -7, size = -7;
  if (fce_comm_info(nullptr, &rank, &size) != FCE_STATUS_INVALID_ARGUMENT || rank != -7 || size != -7)
    die("fce_comm_info(NULL) misbehaved");
  if (fce_comm_destroy(nullptr) != FCE_STATUS_SUCCESS) die("fce_comm_destroy(NULL) failed");
  size_t bytes = 77;
  if (fce_cross_entropy_fwd_vp(cpu, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0) !=
          FCE_STATUS_INVALID_ARGUMENT ||
      fce_cross_entropy_fwd_vp_workspace_size(cpu, nullptr, nullptr, nullptr, nullptr, nullptr, &bytes) !=
          FCE_STATUS_INVALID_ARGUMENT || bytes != 77)
    die("fce_cross_entropy_fwd_vp without a communicator was not refused cleanly");
  if (fce_logsumexp_vp(cpu, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0) != FCE_STATUS_INVALID_ARGUMENT ||
      fce_logsumexp_vp_workspace_size(cpu, nullptr, nullptr, nullptr, nullptr, &bytes) != FCE_STATUS_INVALID_ARGUMENT ||
      fce_temp_softmax_vp(cpu, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0) !=
          FCE_STATUS_INVALID_ARGUMENT ||
      fce_temp_softmax_vp_workspace_size(cpu, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &bytes) !=
          FCE_STATUS_INVALID_ARGUMENT ||
      bytes != 77)
    die("fce_logsumexp_vp / fce_temp_softmax_vp without a communicator were not refused cleanly");
  if (fce_kd_fwd_vp(cpu, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0) !=
          FCE_STATUS_INVALID_ARGUMENT ||
      fce_kd_fwd_vp_workspace_size(cpu, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, &bytes) !=
          FCE_STATUS_INVALID_ARGUMENT ||
      fce_linear_cross_entropy_fwd_vp(cpu, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                      nullptr, 0) != FCE_STATUS_INVALID_ARGUMENT ||
      fce_linear_cross_entropy_fwd_vp_workspace_size(cpu, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
                                                     nullptr, &bytes) != FCE_STATUS_INVALID_ARGUMENT ||
      bytes != 77)
    die("fce_kd_fwd_vp / fce_linear_cross_entropy_fwd_vp without a communicator were not refused cleanly");
  fce_handle_destroy(cpu);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider fdp(data, size);
  Env e(fdp);
  e.rng ^= fdp.ConsumeIntegral<uint64_t>();
  fce_handle_t h = nullptr;
  if (fce_handle_create(kDLCPU, fdp.ConsumeIntegral<int8_t>(), &h) != FCE_STATUS_SUCCESS || !h)
    die("cannot create a CPU handle");
  switch (fdp.ConsumeIntegralInRange(0, 10)) {
    case 0: fuzz_cross_entropy(e, h, false); break;
    case 1: fuzz_cross_entropy(e, h, true); break;
    case 2: fuzz_logsumexp(e, h); break;
    case 3: fuzz_softmax(e, h); break;
    case 4: fuzz_kd(e, h); break;
    case 5: fuzz_linear_ce(e, h, false); break;
    case 6: fuzz_linear_ce(e, h, true); break;
    case 7: fuzz_kd_vp(e, h); break;
    case 8: fuzz_linear_partial(e, h); break;
    default: fuzz_misc(e); break;
  }
  if (fce_handle_destroy(h) != FCE_STATUS_SUCCESS) die("fce_handle_destroy failed");
  return 0;
}
