// Linear cross-entropy on the CPU: token chunks through BLIS's GEMMs, cross-entropy rows in between.
#include <blis.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/error.hpp"
#include "cpu/ce_row.hpp"

namespace fce::cpu {

namespace {

constexpr int64_t kDefaultChunk = 256;

// The chunk's GEMMs are cut into tiles that the shapes alone decide, spread over OpenMP's threads, each
// one BLIS call on one thread. Whichever thread runs a tile, and however many there are, a tile's bits are
// those of BLIS's single-threaded GEMM of that tile's shape and data: no output depends on a thread count.
// (OpenBLAS, before, was not invariant to its own thread count, nor are BLIS's threads safe on a busy
// machine: their barriers spin.) The logits and dweight: kTile of the V columns / rows per tile, a multiple
// of every BLIS microkernel's tile sides here (6, 8, 12, 16, 24, 32, 48). dhidden reduces over V: slices
// of V (dh_slice), each its own GEMM into its own fp32 buffer, then added in slice order.
constexpr int64_t kTile = 1536;
constexpr int64_t kMinSlice = 2048, kMaxSlices = 16;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
// dhidden's reduction slice: at least kMinSlice of V, at most kMaxSlices slices, a multiple of 256.
int64_t dh_slice(int64_t V) { return std::max(kMinSlice, ceil_div(ceil_div(V, kMaxSlices), 256) * 256); }
int64_t dh_slices(int64_t V) { return std::max<int64_t>(1, ceil_div(V, dh_slice(V))); }

// BLIS's kernels for this CPU. BLIS 0.9 tells its AVX-512 (skx) kernels from its AVX2 (haswell) ones by the
// CPU's count of FMA units, which it reads off the brand string; where that says nothing (a virtual machine's
// "Intel(R) Xeon(R) Processor") it takes haswell's, 1.3-1.4x slower here than skx's. So on a CPU with AVX-512
// F, DQ, BW and VL: skx's, unless BLIS_ARCH_TYPE names a kernel set; else BLIS's own choice.
cntx_t* blis_context() {
  static cntx_t* const context = [] {
    bli_init();
    cntx_t* c = nullptr;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") && !std::getenv("BLIS_ARCH_TYPE"))
      c = bli_gks_lookup_nat_cntx(BLIS_ARCH_SKX);  // null where this BLIS was built without it
#endif
    return c ? c : bli_gks_query_cntx();
  }();
  return context;
}

// C [m, n] = op(A) op(B) + beta C, row-major, op(X) = X^T where t* is set: BLIS on the calling thread alone
// (its serial build by default, meson.build; a threaded one given by -Dblis_dir is held to one thread here,
// per call: no process-wide BLAS setting or BLIS_*_THREADS variable is read or changed). BLIS's
// small-matrix ("sup") code path is off: one path for every shape (its kernels are AVX2, slower here on
// AVX-512).
void gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const float* A, int64_t lda, const float* B,
          int64_t ldb, float beta, float* C, int64_t ldc) {
  rntm_t rntm;
  bli_rntm_init(&rntm);
  bli_rntm_set_num_threads(1, &rntm);
  bli_rntm_disable_l3_sup(&rntm);
  float one = 1.f;
  bli_sgemm_ex(ta ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, tb ? BLIS_TRANSPOSE : BLIS_NO_TRANSPOSE, m, n, k, &one,
               const_cast<float*>(A), lda, 1, const_cast<float*>(B), ldb, 1, &beta, C, ldc, 1, blis_context(), &rntm);
}

// Byte layout of the workspace for a chunk of C rows; fp32 staging only where an operand is not fp32.
struct LceLayout {
  size_t logits = 0, hidden = 0, dhidden = 0, dh_part = 0, weight = 0, dweight = 0, dbias = 0, total = 0;
  LceLayout(const LinearCeProblem& p, int64_t C) {
    const int64_t H = p.hidden.cols, V = p.weight.rows;
    auto take = [&](size_t bytes) {
      const size_t at = total;
      total += (bytes + 255) / 256 * 256;
      return at;
    };
    const bool f32 = p.hidden.dtype == DType::F32;
    logits = take(checked_bytes(checked_mul(C, V, "chunk logits"), 4, "chunk logits"));
    hidden = f32 ? SIZE_MAX : take(checked_bytes(checked_mul(C, H, "chunk hidden"), 4, "chunk hidden"));
    dhidden = (!p.dhidden || p.dhidden.dtype == DType::F32) ? SIZE_MAX : take(size_t(C * H) * 4);
    // dhidden's slices past the first (that one goes to dhidden itself)
    const int64_t S = dh_slices(p.real_rows());
    dh_part = (!p.dhidden || S == 1) ? SIZE_MAX : take(size_t((S - 1) * C * H) * 4);
    weight = f32 ? SIZE_MAX : take(checked_bytes(checked_mul(V, H, "weight"), 4, "weight"));
    dweight = (!p.dweight || p.dweight.dtype == DType::F32) ? SIZE_MAX : take(size_t(V * H) * 4);
    dbias = p.dbias ? take(size_t(V) * 4) : SIZE_MAX;
  }
};

float* at(Workspace w, size_t off) { return reinterpret_cast<float*>(static_cast<char*>(w.ptr) + off); }

}  // namespace

size_t linear_ce_workspace(const LinearCeProblem& p, bool minimum) {
  return LceLayout(p, minimum ? 1 : std::min<int64_t>(p.hidden.rows, kDefaultChunk)).total;
}

void linear_ce(const LinearCeProblem& p, Workspace ws) {
  // A vocabulary shard's padding rows of the weight are never read: V is the real rows from here on.
  const int64_t N = p.hidden.rows, H = p.hidden.cols, V = p.real_rows();
  // The CUDA backend's limit (its BLAS takes 32-bit sizes and leading dimensions), kept here alike.
  for (int64_t d : {N, H, V, p.hidden.ld, p.weight.ld, p.dhidden ? p.dhidden.ld : 0, p.dweight ? p.dweight.ld : 0})
    FCE_CHECK(d <= INT32_MAX, FCE_STATUS_UNSUPPORTED_LAYOUT,
              "extents and row strides beyond 2^31 - 1 elements are not supported by the BLAS path");
  // The default chunk whatever the workspace's size (the handle's cached one varies with its history, and
  // the chunks decide the bits of dweight's sum); a smaller workspace cuts shorter chunks.
  int64_t C = std::min<int64_t>(N, kDefaultChunk);
  while (C > 1 && LceLayout(p, C).total > ws.bytes) C = C > 64 ? C / 2 : C - 1;
  const LceLayout lay(p, C);
  FCE_CHECK(lay.total <= ws.bytes, FCE_STATUS_WORKSPACE_TOO_SMALL, "workspace of %zu bytes is below the %zu needed",
            ws.bytes, lay.total);

  const CeContext c(p.o, p.o.sharded() ? p.o.vocab_total : V);
  const float* cw = c.weights() ? c.weights() + p.o.vocab_start : nullptr;  // the shard's class weights
  const bool bwd = static_cast<bool>(p.saved_lse), grad = p.wants_grad(), partial = static_cast<bool>(p.records);
  const double denom = (grad || p.o.reduction == FCE_REDUCTION_MEAN) ? c.mean_denominator(p.targets) : 0.0;

  // fp32 views of the weight and of the weight-gradient accumulator.
  const float* W = reinterpret_cast<const float*>(p.weight.data);
  int64_t ldw = p.weight.ld;
  if (lay.weight != SIZE_MAX) {
    float* w32 = at(ws, lay.weight);
#pragma omp parallel for schedule(static)
    for (int64_t v = 0; v < V; ++v) load_row(p.weight, v, w32 + size_t(v * H));
    W = w32;
    ldw = H;
  }
  float* dW = nullptr;
  int64_t lddw = H;
  if (p.dweight) {
    dW = lay.dweight != SIZE_MAX ? at(ws, lay.dweight) : reinterpret_cast<float*>(p.dweight.data);
    lddw = lay.dweight != SIZE_MAX ? H : p.dweight.ld;
    if (p.accumulate && lay.dweight != SIZE_MAX)  // the sum starts from the current values, in fp32
#pragma omp parallel for schedule(static)
      for (int64_t v = 0; v < V; ++v) load_row(p.dweight, v, dW + size_t(v * H));
  }
  float* db = p.dbias ? at(ws, lay.dbias) : nullptr;
  if (db)
    for (int64_t v = 0; v < V; ++v)
      db[v] = p.accumulate ? load(p.dbias.data + dtype_size(p.dbias.dtype) * size_t(v), p.dbias.dtype) : 0.f;
  std::vector<float> bias(p.bias ? size_t(V) : 0);
  for (int64_t v = 0; v < int64_t(bias.size()); ++v) bias[size_t(v)] = load(p.bias.data + dtype_size(p.bias.dtype) * size_t(v), p.bias.dtype);

  std::vector<double> row_loss(static_cast<size_t>(N)), row_zl(static_cast<size_t>(N));
  float* L = at(ws, lay.logits);
  for (int64_t r0 = 0; r0 < N; r0 += C) {
    const int64_t rows = std::min(C, N - r0);
    const float* Hc = reinterpret_cast<const float*>(row_ptr(p.hidden, r0));
    int64_t ldh = p.hidden.ld;
    if (lay.hidden != SIZE_MAX) {
      float* h32 = at(ws, lay.hidden);
      for (int64_t r = 0; r < rows; ++r) load_row(p.hidden, r0 + r, h32 + size_t(r * H));
      Hc = h32;
      ldh = H;
    }
#pragma omp parallel for schedule(dynamic)
    for (int64_t t = 0; t < ceil_div(V, kTile); ++t)
      gemm(false, true, rows, std::min(kTile, V - t * kTile), H, Hc, ldh, W + size_t(t * kTile * ldw), ldw, 0.f,
           L + t * kTile, V);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = r0 + r;
      float* x = L + size_t(r * V);
      for (int64_t v = 0; v < int64_t(bias.size()); ++v) x[v] += bias[size_t(v)];
      // Logits take the inputs' dtype, as torch.nn.functional.linear gives them (the header's contract).
      if (p.hidden.dtype != DType::F32)
        for (int64_t j = 0; j < V; ++j) x[j] = round_to(p.hidden.dtype, x[j]);
      const int64_t t = load_index(p.targets.data, p.targets.dtype, i);
      LsePair lse;
      float Hr = 0.f;
      if (bwd) {
        lse = load_lse(p.saved_lse, i);
        if (p.grad_entropy) Hr = load_f32(p.saved_entropy, i);
        simd::transform(c.tf, x, V, x);
      } else if (partial) {
        continue;  // the chunk's records below
      } else {
        const CeRow cr = ce_row_forward(c, x, x, t, static_cast<bool>(p.argmax));  // z overwrites x in place
        lse = cr.pair;
        Hr = cr.entropy;
        row_loss[size_t(i)] = cr.loss;
        row_zl[size_t(i)] = cr.z_loss;
        if (p.lse) store_lse(p.lse, i, cr.pair, cr.lse);
        if (p.entropy) store_f32(p.entropy, i, cr.entropy);
        if (p.argmax) store_index(p.argmax.data, p.argmax.dtype, i, cr.argmax);
        if (p.o.reduction == FCE_REDUCTION_NONE) {
          store_f32(p.loss, i, cr.loss);
          if (p.z_loss) store_f32(p.z_loss, i, cr.z_loss);
        }
      }
      if (grad) {
        const int64_t tl = t >= p.o.vocab_start && t < p.o.vocab_start + V ? t - p.o.vocab_start : -1;
        ce_row_grad(c, x, V, cw, lse, t, p.o.sharded() ? tl : t, c.grad_scale(p.grad_loss, i, denom),
                    entropy_grad(p.grad_entropy, i, Hr), x);  // dlogits in place
        if (p.hidden.dtype != DType::F32)  // and in the inputs' dtype, the backward GEMMs' operand
          for (int64_t j = 0; j < V; ++j) x[j] = round_to(p.hidden.dtype, x[j]);
      }
    }
    if (partial) {
      CePartialProblem part;
      part.logits = Mat{reinterpret_cast<char*>(L), DType::F32, rows, V, V};
      part.targets = p.targets;
      part.targets.data += size_t(r0) * dtype_size(p.targets.dtype);
      part.targets.n = rows;
      part.o = p.o;
      part.records = p.records;
      part.records.data += size_t(r0) * size_t(p.records.ld) * 4;
      part.records.rows = rows;
      ce_partial(part);
    }
    if (!grad) continue;
    if (p.dhidden) {
      const bool direct = lay.dhidden == SIZE_MAX;
      float* dH = direct ? reinterpret_cast<float*>(row_ptr_mut(p.dhidden, r0)) : at(ws, lay.dhidden);
      const int64_t lddh = direct ? p.dhidden.ld : H;
      if (p.accumulate && !direct)
        for (int64_t r = 0; r < rows; ++r) load_row(p.dhidden, r0 + r, dH + size_t(r * H));
      // Slice 0 into dH (onto its values when accumulating), the others into their buffers, then added in
      // order: dH + S_0 + S_1 + ... for every element.
      const int64_t ks = dh_slice(V), S = V == 0 ? 0 : dh_slices(V);
      if (V == 0 && !p.accumulate)  // a shard of padding alone: its part of dhidden is 0
        for (int64_t r = 0; r < rows; ++r) std::fill(dH + size_t(r * lddh), dH + size_t(r * lddh + H), 0.f);
      float* part = S > 1 ? at(ws, lay.dh_part) : nullptr;
#pragma omp parallel for schedule(dynamic)
      for (int64_t s = 0; s < S; ++s)
        gemm(false, false, rows, H, std::min(ks, V - s * ks), L + s * ks, V, W + size_t(s * ks * ldw), ldw,
             s == 0 && p.accumulate ? 1.f : 0.f, s == 0 ? dH : part + size_t((s - 1) * rows * H), s == 0 ? lddh : H);
      if (S > 1) {
#pragma omp parallel for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
          float* d = dH + size_t(r * lddh);
          for (int64_t s = 1; s < S; ++s) {
            const float* q = part + size_t(((s - 1) * rows + r) * H);
            for (int64_t j = 0; j < H; ++j) d[j] += q[j];
          }
        }
      }
      if (!direct)
        for (int64_t r = 0; r < rows; ++r) store_row(p.dhidden, r0 + r, dH + size_t(r * H));
    }
    if (dW)
#pragma omp parallel for schedule(dynamic)
      for (int64_t t = 0; t < ceil_div(V, kTile); ++t)
        gemm(true, false, std::min(kTile, V - t * kTile), H, rows, L + t * kTile, V, Hc, ldh,
             r0 == 0 && !p.accumulate ? 0.f : 1.f, dW + size_t(t * kTile * lddw), lddw);
    if (db) {
#pragma omp parallel for schedule(static)
      for (int64_t v = 0; v < V; ++v)
        for (int64_t r = 0; r < rows; ++r) db[v] += L[size_t(r * V + v)];
    }
  }
  if (dW && lay.dweight != SIZE_MAX)
    for (int64_t v = 0; v < V; ++v) store_row(p.dweight, v, dW + size_t(v * H));
  if (db)
    for (int64_t v = 0; v < V; ++v) store(p.dbias.data + dtype_size(p.dbias.dtype) * size_t(v), p.dbias.dtype, db[v]);
  if (!p.accumulate) {  // a shard's padding rows: 0
    const std::vector<float> zeros(size_t(H), 0.f);
    if (p.dweight)
      for (int64_t v = V; v < p.weight.rows; ++v) store_row(p.dweight, v, zeros.data());
    if (p.dbias)
      for (int64_t v = V; v < p.weight.rows; ++v) store(p.dbias.data + dtype_size(p.dbias.dtype) * size_t(v), p.dbias.dtype, 0.f);
  }

  if (!bwd && !partial) reduce_losses(p.o.reduction, row_loss, row_zl, denom, p.loss, p.z_loss);
}

}  // namespace fce::cpu
