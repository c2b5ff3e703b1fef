// Vocabulary-parallel losses over NCCL, one process per GPU (tests/multi/run_vp_nccl.sh starts the
// ranks); besides the KD, logsumexp/softmax and linear CE cases below: fce_cross_entropy_fwd_vp on each rank's shard against the one-device emulation of the same shards
// (fce_cross_entropy_partial on every shard, fce_cross_entropy_combine, fce_cross_entropy_bwd_ex), bitwise;
// the ranks' outputs bitwise equal to each other; a NaN in one rank's shard reaches every rank; a CUDA graph
// of the call replays to the same bits; validation leaves the outputs untouched. With --bench, the timings
// of docs/benchmarks.md (CUDA events, median of 20 calls).
//   vp_nccl RANK WORLD ID_FILE [--bench]      exit 77: fewer GPUs than ranks, or no NCCL
// With --bench, also one `@result {json}` line per timing for benchmarks/plot_scaling.py.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <memory>
#include <thread>
#include <vector>

#include "fusedce/fusedce.h"

namespace {

// NCCL's C ABI for the test's own communicator (nccl.h: ncclUniqueId is 128 bytes, ncclInt8 = 0).
struct NcclId {
  char internal[128];
};
struct Nccl {
  int (*get_unique_id)(NcclId*);
  int (*comm_init_rank)(ncclComm**, int, NcclId, int);
  int (*comm_destroy)(ncclComm*);
  int (*all_gather)(const void*, void*, size_t, int, ncclComm*, cudaStream_t);
  int (*all_reduce)(const void*, void*, size_t, int, int, ncclComm*, cudaStream_t);
};

int g_fail = 0, g_rank = 0;
#define CHECK(cond, ...)                                      \
  do {                                                        \
    if (!(cond)) {                                            \
      std::fprintf(stderr, "rank %d: FAIL %s:%d: ", g_rank, __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                      \
      std::fprintf(stderr, "\n");                             \
      ++g_fail;                                               \
    }                                                         \
  } while (0)

void ck(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "rank %d: %s: %s\n", g_rank, what, cudaGetErrorString(e));
    std::exit(1);
  }
}
void ok(fce_status_t s, const char* what) {
  if (s != FCE_STATUS_SUCCESS) {
    std::fprintf(stderr, "rank %d: %s: %s\n", g_rank, what, fce_last_error_message());
    std::exit(1);
  }
}

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// A device buffer with a DLTensor view of up to 3 dims.
struct Buf {
  void* p = nullptr;
  size_t bytes = 0;
  int64_t shape[3] = {0, 0, 0};
  DLTensor t{};
  Buf(std::vector<int64_t> s, DLDataType dt, int dev) {
    size_t n = 1;
    for (size_t i = 0; i < s.size(); ++i) shape[i] = s[i], n *= size_t(s[i]);
    bytes = n * size_t(dt.bits / 8);
    ck(cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
    t.data = p;
    t.device = {kDLCUDA, dev};
    t.ndim = int32_t(s.size());
    t.dtype = dt;
    t.shape = shape;
  }
  ~Buf() { cudaFree(p); }
  Buf(const Buf&) = delete;
  // These wait for the device: cudaMemcpy / cudaMemset run on the legacy stream, which the tests'
  // non-blocking stream neither waits for nor makes wait (a poison landing after the call it precedes, a
  // download before the call it follows ends).
  void upload(const void* h) {
    ck(cudaMemcpy(p, h, bytes, cudaMemcpyHostToDevice), "upload");
    ck(cudaDeviceSynchronize(), "sync");
  }
  std::vector<uint8_t> download() const {
    ck(cudaDeviceSynchronize(), "sync");
    std::vector<uint8_t> h(bytes);
    ck(cudaMemcpy(h.data(), p, bytes, cudaMemcpyDeviceToHost), "download");
    return h;
  }
  void poison() {
    ck(cudaMemset(p, 0xff, bytes), "poison");
    ck(cudaDeviceSynchronize(), "sync");
  }
};

const DLDataType kF32{kDLFloat, 32, 1}, kBF16{kDLBfloat, 16, 1}, kI64{kDLInt, 64, 1};

// Columns of rank r: ceil(V / W) per rank, the last one short, every shard padded to the same width.
struct Split {
  int64_t V, W, width;
  int64_t start(int64_t r) const { return r * width; }
  int64_t real(int64_t r) const { return std::max<int64_t>(0, std::min(width, V - r * width)); }
};

struct Case {
  int64_t N, V;
  bool bf16;
  int reduction;
  float smoothing, zloss;
  bool nan_row;  // a NaN in the last rank's shard of row 1
  bool grad_entropy = false;  // the entropy's upstream gradient too (fce_cross_entropy_bwd_ex in the emulation)
};

// Host logits [N, V] as fp32 values (bf16-representable when bf16), targets with ignored and random rows.
void make_inputs(const Case& c, std::vector<float>& x, std::vector<int64_t>& t) {
  std::mt19937_64 g(uint64_t(c.N * 1000003 + c.V * 7 + (c.bf16 ? 1 : 0)));
  std::normal_distribution<float> nd(0.f, 2.f);
  x.resize(size_t(c.N * c.V));
  for (auto& v : x) {
    v = nd(g);
    if (c.bf16) {
      const uint32_t u = uint32_t(to_bf16(v)) << 16;
      std::memcpy(&v, &u, 4);
    }
  }
  t.resize(size_t(c.N));
  for (int64_t i = 0; i < c.N; ++i) t[size_t(i)] = int64_t(g() % uint64_t(c.V));
  if (c.N > 2) t[2] = -100;  // ignored
  if (c.nan_row && c.N > 1) x[size_t(1 * c.V + c.V - 3)] = NAN;
}

// Shard r of the logits as the case's dtype, [N, width], padding past V filled with NaN (never read).
std::vector<uint8_t> shard_bytes(const Case& c, const Split& s, int64_t r, const std::vector<float>& x) {
  const size_t es = c.bf16 ? 2 : 4;
  std::vector<uint8_t> out(size_t(c.N * s.width) * es);
  for (int64_t i = 0; i < c.N; ++i)
    for (int64_t j = 0; j < s.width; ++j) {
      const int64_t col = s.start(r) + j;
      const float v = col < c.V ? x[size_t(i * c.V + col)] : NAN;
      uint8_t* p = out.data() + size_t(i * s.width + j) * es;
      if (c.bf16) {
        const uint16_t h = to_bf16(v);
        std::memcpy(p, &h, 2);
      } else {
        std::memcpy(p, &v, 4);
      }
    }
  return out;
}

size_t first_difference(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

// Captures `call` (which returns its status) into a CUDA graph on `st` and replays it `times` times (the
// caller then compares the outputs); false, with a failure counted, when the capture failed.
template <class Call>
bool replayed(cudaStream_t st, const char* name, int times, Call&& call) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ck(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), "begin capture");
  const fce_status_t cs = call();
  ck(cudaStreamEndCapture(st, &graph), "end capture");
  CHECK(cs == FCE_STATUS_SUCCESS, "%s: capture: %s", name, fce_last_error_message());
  if (cs == FCE_STATUS_SUCCESS) {
    ck(cudaGraphInstantiate(&exec, graph, 0), "instantiate");
    for (int k = 0; k < times; ++k) ck(cudaGraphLaunch(exec, st), "graph launch");
    ck(cudaStreamSynchronize(st), "sync");
    cudaGraphExecDestroy(exec);
  }
  cudaGraphDestroy(graph);
  return cs == FCE_STATUS_SUCCESS;
}

fce_ce_options_t options_of(const Case& c, const Split& s, int64_t r) {
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = fce_reduction_t(c.reduction);
  o.label_smoothing = c.smoothing;
  o.z_loss_scale = c.zloss;
  o.vocab_start = s.start(r);
  o.vocab_total = c.V;
  return o;
}

struct Outs {
  Buf loss, lse, zl, am, ent, dl;
  Outs(const Case& c, const Split& s, int dev)
      : loss(c.reduction == FCE_REDUCTION_NONE ? std::vector<int64_t>{c.N} : std::vector<int64_t>{}, kF32, dev),
        lse({c.N}, kF32, dev),
        zl(c.reduction == FCE_REDUCTION_NONE ? std::vector<int64_t>{c.N} : std::vector<int64_t>{}, kF32, dev),
        am({c.N}, kI64, dev),
        ent({c.N}, kF32, dev),
        dl({c.N, s.width}, c.bf16 ? kBF16 : kF32, dev) {}
  void poison() {
    for (Buf* b : {&loss, &lse, &zl, &am, &ent, &dl}) b->poison();
  }
  fce_ce_outputs_t view(bool grad) {
    fce_ce_outputs_t o = FCE_CE_OUTPUTS_INIT;
    o.loss = &loss.t;
    o.lse = &lse.t;
    o.z_loss = &zl.t;
    o.argmax = &am.t;
    o.entropy = &ent.t;
    o.dlogits = grad ? &dl.t : nullptr;
    return o;
  }
  // The output holding byte `at` of bytes().
  const char* which(size_t at) const {
    const char* names[] = {"loss", "lse", "z_loss", "argmax", "entropy", "dlogits"};
    const Buf* bufs[] = {&loss, &lse, &zl, &am, &ent, &dl};
    for (int k = 0; k < 6; ++k) {
      if (at < bufs[k]->bytes) return names[k];
      at -= bufs[k]->bytes;
    }
    return "none";
  }
  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> all;
    for (const Buf* b : {&loss, &lse, &zl, &am, &ent, &dl}) {
      const auto h = b->download();
      all.insert(all.end(), h.begin(), h.end());
    }
    return all;
  }
};

void run_case(const Case& c, int W, int dev, fce_handle_t h, fce_comm_t comm, const Nccl& nccl, ncclComm* nc,
              cudaStream_t st) {
  const Split s{c.V, W, (c.V + W - 1) / W};
  std::vector<float> x;
  std::vector<int64_t> t;
  make_inputs(c, x, t);
  const DLDataType xt = c.bf16 ? kBF16 : kF32;
  Buf logits({c.N, s.width}, xt, dev), targets({c.N}, kI64, dev);
  logits.upload(shard_bytes(c, s, g_rank, x).data());
  targets.upload(t.data());
  const fce_ce_options_t o = options_of(c, s, g_rank);
  const fce_stream_t fs = reinterpret_cast<fce_stream_t>(st);

  // The entropy's upstream gradient, [N] (the same on every rank).
  Buf ge({c.N}, kF32, dev);
  {
    std::vector<float> g(size_t(c.N));
    for (int64_t i = 0; i < c.N; ++i) g[size_t(i)] = 0.5f - 0.01f * float(i % 97);
    ge.upload(g.data());
  }

  // NCCL mode.
  Outs got(c, s, dev);
  got.poison();
  fce_ce_outputs_t ov = got.view(true);
  if (c.grad_entropy) ov.grad_entropy = &ge.t;
  ok(fce_cross_entropy_fwd_vp(h, comm, fs, &logits.t, &targets.t, &o, &ov, nullptr, 0), "fce_cross_entropy_fwd_vp");
  ck(cudaStreamSynchronize(st), "sync");
  const std::vector<uint8_t> mine = got.bytes();

  // The one-device emulation: every shard's records on this GPU, the combine, this shard's backward.
  Buf recs({int64_t(W), c.N, 7}, kF32, dev);
  for (int r = 0; r < W; ++r) {
    Buf sh({c.N, s.width}, xt, dev);
    sh.upload(shard_bytes(c, s, r, x).data());
    const fce_ce_options_t orr = options_of(c, s, r);
    DLTensor view = recs.t;
    int64_t vshape[2] = {c.N, 7};
    view.ndim = 2;
    view.shape = vshape;
    view.byte_offset = uint64_t(r) * uint64_t(c.N) * 7 * 4;
    ok(fce_cross_entropy_partial(h, fs, &sh.t, &targets.t, &orr, &view), "fce_cross_entropy_partial");
  }
  Outs emu(c, s, dev);
  emu.poison();
  fce_ce_outputs_t ev = emu.view(false);
  ok(fce_cross_entropy_combine(h, fs, &recs.t, &targets.t, &o, &ev, nullptr, 0), "fce_cross_entropy_combine");
  fce_ce_bwd_inputs_t bin = FCE_CE_BWD_INPUTS_INIT;
  bin.lse = &emu.lse.t;
  bin.entropy = &emu.ent.t;
  bin.grad_entropy = c.grad_entropy ? &ge.t : nullptr;
  ok(fce_cross_entropy_bwd_ex(h, fs, &logits.t, &targets.t, &bin, &o, &emu.dl.t, nullptr, 0),
     "fce_cross_entropy_bwd_ex");
  ck(cudaStreamSynchronize(st), "sync");
  const std::vector<uint8_t> ref = emu.bytes();
  char name[160];
  std::snprintf(name, sizeof name, "N=%lld V=%lld %s reduction=%d smoothing=%g zloss=%g%s%s", (long long)c.N,
                (long long)c.V, c.bf16 ? "bf16" : "fp32", c.reduction, c.smoothing, c.zloss,
                c.nan_row ? " NaN row" : "", c.grad_entropy ? " grad_entropy" : "");
  CHECK(mine == ref, "%s: NCCL mode differs from the one-device emulation (first at byte %zu of %zu: %s)", name,
        first_difference(mine, ref), mine.size(), got.which(first_difference(mine, ref)));

  // Every rank's outputs, gathered by the test's own NCCL: the same bits everywhere.
  Buf mine_d({int64_t(mine.size())}, DLDataType{kDLUInt, 8, 1}, dev);
  Buf all_d({int64_t(mine.size()) * W}, DLDataType{kDLUInt, 8, 1}, dev);
  mine_d.upload(mine.data());
  if (nccl.all_gather(mine_d.p, all_d.p, mine.size(), 0, nc, st) != 0) CHECK(false, "test all-gather failed");
  ck(cudaStreamSynchronize(st), "sync");
  const auto all = all_d.download();
  for (int r = 1; r < W; ++r)
    CHECK(std::memcmp(all.data(), all.data() + size_t(r) * mine.size(), mine.size() - got.dl.bytes) == 0,
          "%s: rank %d's loss/lse/z-loss/argmax/entropy differ from rank 0's", name, r);

  if (c.nan_row && c.N > 1 && c.reduction == FCE_REDUCTION_NONE) {  // the NaN of the last rank's shard
    float l1 = 0, e1 = 0;
    ck(cudaMemcpy(&l1, static_cast<float*>(got.loss.p) + 1, 4, cudaMemcpyDeviceToHost), "copy");
    ck(cudaMemcpy(&e1, static_cast<float*>(got.lse.p) + 1, 4, cudaMemcpyDeviceToHost), "copy");
    CHECK(std::isnan(l1) && std::isnan(e1), "%s: row 1's NaN did not reach rank %d (loss %g, lse %g)", name,
          g_rank, l1, e1);
  }

  // A CUDA graph of the call (the caller's workspace: the handle's cache cannot grow during capture).
  size_t wsb = 0;
  ok(fce_cross_entropy_fwd_vp_workspace_size(h, comm, &logits.t, &targets.t, &o, &ov, &wsb), "workspace size");
  void* ws = nullptr;
  ck(cudaMalloc(&ws, wsb ? wsb : 1), "cudaMalloc");
  got.poison();
  if (replayed(st, name, 2, [&] { return fce_cross_entropy_fwd_vp(h, comm, fs, &logits.t, &targets.t, &o, &ov, ws, wsb); }))
    CHECK(got.bytes() == mine, "%s: the graph's replay differs from the eager call", name);
  cudaFree(ws);
  std::printf("rank %d: %s: ok\n", g_rank, name);
}

// Logsumexp and temperature softmax in NCCL mode (fce_logsumexp_vp, fce_temp_softmax_vp) against the
// one-device emulation (fce_logsumexp_partial of every shard, fce_logsumexp_combine, fce_temp_softmax of this
// shard with that lse), bitwise; the lse the same on every rank; a NaN reaches every rank; a graph replays to
// the same bits; refused calls leave the outputs untouched.
void lse_case(const Case& c, float T, int W, int dev, fce_handle_t h, fce_comm_t comm, const Nccl& nccl, ncclComm* nc,
              cudaStream_t st) {
  const Split s{c.V, W, (c.V + W - 1) / W};
  std::vector<float> x;
  std::vector<int64_t> t;
  make_inputs(c, x, t);
  const DLDataType xt = c.bf16 ? kBF16 : kF32;
  Buf logits({c.N, s.width}, xt, dev);
  logits.upload(shard_bytes(c, s, g_rank, x).data());
  const fce_stream_t fs = reinterpret_cast<fce_stream_t>(st);
  fce_lse_options_t lo = FCE_LSE_OPTIONS_INIT;
  lo.scale = 1.f / T;
  lo.vocab_start = s.start(g_rank);
  lo.vocab_total = c.V;
  fce_softmax_options_t so = FCE_SOFTMAX_OPTIONS_INIT;
  so.temperature = T;
  so.vocab_start = lo.vocab_start;
  so.vocab_total = c.V;
  struct Outs {
    Buf lse_a, lse_b, probs, logprobs;
    Outs(const Case& c, const Split& s, DLDataType xt, int dev)
        : lse_a({c.N}, kF32, dev), lse_b({c.N}, kF32, dev), probs({c.N, s.width}, kF32, dev),
          logprobs({c.N, s.width}, xt, dev) {}
    void poison() {
      for (Buf* b : {&lse_a, &lse_b, &probs, &logprobs}) b->poison();
    }
    std::vector<uint8_t> bytes() const {
      std::vector<uint8_t> all;
      for (const Buf* b : {&lse_a, &lse_b, &probs, &logprobs}) {
        const auto hb = b->download();
        all.insert(all.end(), hb.begin(), hb.end());
      }
      return all;
    }
  };
  Outs got(c, s, xt, dev);
  got.poison();
  ok(fce_logsumexp_vp(h, comm, fs, &logits.t, &lo, &got.lse_a.t, nullptr, 0), "fce_logsumexp_vp");
  ok(fce_temp_softmax_vp(h, comm, fs, &logits.t, &so, &got.probs.t, &got.logprobs.t, &got.lse_b.t, nullptr, 0),
     "fce_temp_softmax_vp");
  ck(cudaStreamSynchronize(st), "sync");
  const std::vector<uint8_t> mine = got.bytes();

  Buf recs({int64_t(W), c.N, FCE_LSE_RECORD_FIELDS}, kF32, dev);
  for (int r = 0; r < W; ++r) {
    Buf sh({c.N, s.width}, xt, dev);
    sh.upload(shard_bytes(c, s, r, x).data());
    fce_lse_options_t orr = lo;
    orr.vocab_start = s.start(r);
    DLTensor view = recs.t;
    int64_t vshape[2] = {c.N, FCE_LSE_RECORD_FIELDS};
    view.ndim = 2;
    view.shape = vshape;
    view.byte_offset = uint64_t(r) * uint64_t(c.N) * FCE_LSE_RECORD_FIELDS * 4;
    ok(fce_logsumexp_partial(h, fs, &sh.t, &orr, &view), "fce_logsumexp_partial");
  }
  Outs emu(c, s, xt, dev);
  emu.poison();
  ok(fce_logsumexp_combine(h, fs, &recs.t, &emu.lse_a.t), "fce_logsumexp_combine");
  ck(cudaMemcpyAsync(emu.lse_b.p, emu.lse_a.p, emu.lse_a.bytes, cudaMemcpyDeviceToDevice, st), "copy");
  fce_softmax_options_t se = so;
  se.lse = &emu.lse_a.t;
  ok(fce_temp_softmax(h, fs, &logits.t, &se, &emu.probs.t, &emu.logprobs.t, nullptr, 0), "fce_temp_softmax");
  ck(cudaStreamSynchronize(st), "sync");
  const std::vector<uint8_t> ref = emu.bytes();
  char name[160];
  std::snprintf(name, sizeof name, "lse/softmax N=%lld V=%lld %s T=%g%s", (long long)c.N, (long long)c.V,
                c.bf16 ? "bf16" : "fp32", double(T), c.nan_row ? " NaN row" : "");
  CHECK(mine == ref, "%s: NCCL mode differs from the one-device emulation (first at byte %zu of %zu)", name,
        first_difference(mine, ref), mine.size());

  // The lse on every rank: the same bits (all-gathered by the test's own NCCL).
  Buf all_d({int64_t(got.lse_a.bytes) * W}, DLDataType{kDLUInt, 8, 1}, dev);
  if (nccl.all_gather(got.lse_a.p, all_d.p, got.lse_a.bytes, 0, nc, st) != 0) CHECK(false, "test all-gather failed");
  ck(cudaStreamSynchronize(st), "sync");
  const auto all = all_d.download();
  for (int r = 1; r < W; ++r)
    CHECK(std::memcmp(all.data(), all.data() + size_t(r) * got.lse_a.bytes, got.lse_a.bytes) == 0,
          "%s: rank %d's lse differs from rank 0's", name, r);
  if (c.nan_row && c.N > 1) {
    float l1 = 0;
    ck(cudaMemcpy(&l1, static_cast<float*>(got.lse_a.p) + 1, 4, cudaMemcpyDeviceToHost), "copy");
    CHECK(std::isnan(l1), "%s: row 1's NaN did not reach rank %d (lse %g)", name, g_rank, l1);
  }

  // A graph of the softmax with its lse in the caller's workspace.
  size_t wsb = 0;
  ok(fce_temp_softmax_vp_workspace_size(h, comm, &logits.t, &so, &got.probs.t, &got.logprobs.t, nullptr, &wsb), "ws");
  void* ws = nullptr;
  ck(cudaMalloc(&ws, wsb ? wsb : 1), "cudaMalloc");
  got.poison();
  ck(cudaMemcpy(got.lse_a.p, ref.data(), got.lse_a.bytes, cudaMemcpyHostToDevice), "upload");
  ck(cudaMemcpy(got.lse_b.p, ref.data(), got.lse_b.bytes, cudaMemcpyHostToDevice), "upload");
  if (replayed(st, name, 2, [&] {
        return fce_temp_softmax_vp(h, comm, fs, &logits.t, &so, &got.probs.t, &got.logprobs.t, nullptr, ws, wsb);
      }))
    CHECK(got.bytes() == ref, "%s: the graph's replay differs from the emulation", name);
  cudaFree(ws);

  // Refused calls write nothing: options->lse set, per-row temperatures, no shard, NULL comm.
  got.poison();
  const std::vector<uint8_t> before = got.bytes();
  fce_softmax_options_t bad = so;
  bad.lse = &got.lse_a.t;
  CHECK(fce_temp_softmax_vp(h, comm, fs, &logits.t, &bad, &got.probs.t, nullptr, &got.lse_b.t, nullptr, 0) ==
            FCE_STATUS_INVALID_ARGUMENT, "%s: options->lse accepted", name);
  bad = so;
  bad.temperatures = &got.lse_a.t;
  CHECK(fce_temp_softmax_vp(h, comm, fs, &logits.t, &bad, &got.probs.t, nullptr, nullptr, nullptr, 0) ==
            FCE_STATUS_NOT_IMPLEMENTED, "%s: per-row temperatures accepted", name);
  fce_lse_options_t whole = lo;
  whole.vocab_start = whole.vocab_total = 0;
  CHECK(fce_logsumexp_vp(h, comm, fs, &logits.t, &whole, &got.lse_a.t, nullptr, 0) == FCE_STATUS_INVALID_ARGUMENT,
        "%s: fce_logsumexp_vp without a shard accepted", name);
  CHECK(fce_logsumexp_vp(h, nullptr, fs, &logits.t, &lo, &got.lse_a.t, nullptr, 0) == FCE_STATUS_INVALID_ARGUMENT,
        "%s: NULL comm accepted", name);
  CHECK(got.bytes() == before, "%s: a refused call wrote an output", name);
  std::printf("rank %d: %s: ok\n", g_rank, name);
}

// Vocabulary-parallel KD with the caller's all-gather (the test's own NCCL): fce_kd_partial on this rank's
// shards of student and teacher (or a top-K teacher, topk_norm >= 0), the records all-gathered,
// fce_kd_combine (JSD and top-K: then fce_kd_terms_partial, a second all-gather and fce_kd_terms_combine) and
// fce_kd_bwd; against the one-device emulation (every shard's records on this GPU), bitwise, and the same
// loss on every rank.
void kd_case(const Case& c, int div, int W, int dev, fce_handle_t h, fce_comm_t comm, const Nccl& nccl, ncclComm* nc,
             cudaStream_t st, int topk_norm = -1) {
  const Split s{c.V, W, (c.V + W - 1) / W};
  std::vector<float> x, y;
  std::vector<int64_t> t;
  make_inputs(c, x, t);
  Case ct = c;
  ct.N += 1;  // another seed for the teacher (its first N rows)
  ct.nan_row = false;
  std::vector<int64_t> unused;
  make_inputs(ct, y, unused);
  y.resize(size_t(c.N * c.V));
  const DLDataType xt = c.bf16 ? kBF16 : kF32;
  const fce_stream_t fs = reinterpret_cast<fce_stream_t>(st);
  Buf targets({c.N}, kI64, dev);
  targets.upload(t.data());
  fce_kd_options_t o = FCE_KD_OPTIONS_INIT;
  o.divergence = div;
  o.beta = 0.3f;
  o.temperature = 2.f;
  const bool topk = topk_norm >= 0, jsd = div == FCE_KD_JSD, two = jsd || topk;
  if (topk) o.topk_norm = topk_norm;
  o.reduction = fce_reduction_t(c.reduction);
  o.vocab_total = c.V;
  const bool none = c.reduction == FCE_REDUCTION_NONE;
  // A top-K teacher (topk_norm >= 0): 33 slots per row, every fourth unused, row 0 without a used slot; the
  // same on every rank.
  const int64_t K = 33;
  Buf ids({c.N, K}, kI64, dev), lps({c.N, K}, kF32, dev);
  if (topk) {
    std::vector<int64_t> hid(size_t(c.N * K));
    std::vector<float> hlp(size_t(c.N * K));
    for (int64_t i = 0; i < c.N; ++i)
      for (int64_t k = 0; k < K; ++k) {  // distinct ids in a row (V >= 1000 and not a multiple of 104729)
        hid[size_t(i * K + k)] = i == 0 || k % 4 == 3 ? -1 : (i * 7919 + k * 104729) % c.V;
        hlp[size_t(i * K + k)] = -0.25f * float(k % 9) - 0.5f;
      }
    ids.upload(hid.data());
    lps.upload(hlp.data());
  }
  // Shard r's records (terms: JSD's second records, from the rows' statistics).
  auto partial = [&](int64_t r, DLTensor* out, const Buf* stats = nullptr) {
    Buf a({c.N, s.width}, xt, dev), b({c.N, s.width}, xt, dev);
    a.upload(shard_bytes(c, s, r, x).data());
    b.upload(shard_bytes(c, s, r, y).data());
    fce_kd_teacher_t tt = FCE_KD_TEACHER_INIT;
    if (topk) {
      tt.topk_ids = &ids.t;
      tt.topk_logprobs = &lps.t;
    } else {
      tt.logits = &b.t;
    }
    fce_kd_options_t orr = o;
    orr.vocab_start = s.start(r);
    if (stats) ok(fce_kd_terms_partial(h, fs, &a.t, &tt, &stats->t, &orr, out), "fce_kd_terms_partial");
    else ok(fce_kd_partial(h, fs, &a.t, &tt, &orr, out), "fce_kd_partial");
    ck(cudaStreamSynchronize(st), "sync");
  };
  // Every rank's terms in rank order: this rank's all-gathered, or every shard's on this GPU (the emulation).
  auto gather_terms = [&](const Buf& stats, Buf& terms, bool emulate) {
    if (!emulate) {
      Buf mine({c.N, FCE_KD_TERMS_RECORD_FIELDS}, kF32, dev);
      partial(g_rank, &mine.t, &stats);
      if (nccl.all_gather(mine.p, terms.p, size_t(c.N) * FCE_KD_TERMS_RECORD_FIELDS, 7, nc, st) != 0)
        CHECK(false, "KD terms all-gather failed");
      return;
    }
    for (int r = 0; r < W; ++r) {
      DLTensor view = terms.t;
      int64_t vshape[2] = {c.N, FCE_KD_TERMS_RECORD_FIELDS};
      view.ndim = 2;
      view.shape = vshape;
      view.byte_offset = uint64_t(r) * uint64_t(c.N) * FCE_KD_TERMS_RECORD_FIELDS * 4;
      partial(r, &view, &stats);
    }
  };
  // rank's path: its records, the all-gather, the combine, its shard's dstudent
  auto finish = [&](Buf& recs, Buf& loss, Buf& stats, Buf& ds, bool emulate) {
    ok(fce_kd_combine(h, fs, &recs.t, &targets.t, &o, two ? nullptr : &loss.t, &stats.t, nullptr, 0),
       "fce_kd_combine");
    if (two) {
      Buf terms({int64_t(W), c.N, FCE_KD_TERMS_RECORD_FIELDS}, kF32, dev);
      gather_terms(stats, terms, emulate);
      ok(fce_kd_terms_combine(h, fs, &terms.t, &targets.t, &o, &loss.t, &stats.t, nullptr, 0), "fce_kd_terms_combine");
    }
    Buf a({c.N, s.width}, xt, dev), b({c.N, s.width}, xt, dev);
    a.upload(shard_bytes(c, s, g_rank, x).data());
    b.upload(shard_bytes(c, s, g_rank, y).data());
    fce_kd_teacher_t tt = FCE_KD_TEACHER_INIT;
    if (topk) {
      tt.topk_ids = &ids.t;
      tt.topk_logprobs = &lps.t;
    } else {
      tt.logits = &b.t;
    }
    fce_kd_options_t orr = o;
    orr.vocab_start = s.start(g_rank);
    ok(fce_kd_bwd(h, fs, &a.t, &tt, &targets.t, &stats.t, &orr, nullptr, &ds.t, nullptr, 0), "fce_kd_bwd");
    ck(cudaStreamSynchronize(st), "sync");
  };
  const std::vector<int64_t> lshape = none ? std::vector<int64_t>{c.N} : std::vector<int64_t>{};
  Buf mine({c.N, FCE_KD_RECORD_FIELDS}, kF32, dev), all({int64_t(W), c.N, FCE_KD_RECORD_FIELDS}, kF32, dev);
  partial(g_rank, &mine.t);
  if (nccl.all_gather(mine.p, all.p, size_t(c.N) * FCE_KD_RECORD_FIELDS, 7, nc, st) != 0)
    CHECK(false, "KD all-gather failed");
  Buf loss(lshape, kF32, dev), stats({c.N, FCE_KD_ROW_STATS_FIELDS}, kF32, dev), ds({c.N, s.width}, xt, dev);
  finish(all, loss, stats, ds, false);
  Buf emu({int64_t(W), c.N, FCE_KD_RECORD_FIELDS}, kF32, dev);
  for (int r = 0; r < W; ++r) {
    DLTensor view = emu.t;
    int64_t vshape[2] = {c.N, FCE_KD_RECORD_FIELDS};
    view.ndim = 2;
    view.shape = vshape;
    view.byte_offset = uint64_t(r) * uint64_t(c.N) * FCE_KD_RECORD_FIELDS * 4;
    partial(r, &view);
  }
  Buf eloss(lshape, kF32, dev), estats({c.N, FCE_KD_ROW_STATS_FIELDS}, kF32, dev), eds({c.N, s.width}, xt, dev);
  finish(emu, eloss, estats, eds, true);
  char name[128];
  std::snprintf(name, sizeof name, "KD %s%s N=%lld V=%lld %s reduction=%d%s",
                div == FCE_KD_FORWARD_KL ? "forward" : div == FCE_KD_REVERSE_KL ? "reverse" : "JSD",
                !topk ? "" : topk_norm == FCE_KD_TOPK_RENORMALIZE ? " top-K renormalized" : " top-K",
                (long long)c.N, (long long)c.V, c.bf16 ? "bf16" : "fp32", c.reduction, c.nan_row ? " NaN row" : "");
  CHECK(all.download() == emu.download(), "%s: the gathered records differ from the emulation's", name);
  CHECK(loss.download() == eloss.download() && stats.download() == estats.download() &&
            ds.download() == eds.download(),
        "%s: loss, statistics or dstudent differ from the one-device emulation", name);
  {  // NCCL mode (fce_kd_fwd_vp): the same steps in one call, then replayed from a CUDA graph
    Buf a({c.N, s.width}, xt, dev), b({c.N, s.width}, xt, dev), nloss(lshape, kF32, dev), nds({c.N, s.width}, xt, dev);
    Buf nstats({c.N, FCE_KD_ROW_STATS_FIELDS}, kF32, dev);  // what an autograd backward would keep
    a.upload(shard_bytes(c, s, g_rank, x).data());
    b.upload(shard_bytes(c, s, g_rank, y).data());
    fce_kd_teacher_t tt = FCE_KD_TEACHER_INIT;
    if (topk) {
      tt.topk_ids = &ids.t;
      tt.topk_logprobs = &lps.t;
    } else {
      tt.logits = &b.t;
    }
    fce_kd_options_t orr = o;
    orr.vocab_start = s.start(g_rank);
    fce_kd_outputs_t out = FCE_KD_OUTPUTS_INIT;
    out.loss = &nloss.t;
    out.dstudent = &nds.t;
    nloss.poison();
    nds.poison();
    nstats.poison();
    ok(fce_kd_fwd_vp(h, comm, fs, &a.t, &tt, &targets.t, &orr, &out, &nstats.t, nullptr, 0), "fce_kd_fwd_vp");
    CHECK(nloss.download() == eloss.download() && nds.download() == eds.download() &&
              nstats.download() == estats.download(),
          "%s: NCCL mode's loss, dstudent or statistics differ from the one-device emulation", name);
    size_t wsb = 0;
    ok(fce_kd_fwd_vp_workspace_size(h, comm, &a.t, &tt, &targets.t, &orr, &out, nullptr, &wsb), "workspace size");
    void* ws = nullptr;
    ck(cudaMalloc(&ws, wsb ? wsb : 1), "cudaMalloc");
    nloss.poison();
    nds.poison();
    if (replayed(st, name, 1, [&] { return fce_kd_fwd_vp(h, comm, fs, &a.t, &tt, &targets.t, &orr, &out, nullptr, ws, wsb); }))
      CHECK(nloss.download() == eloss.download() && nds.download() == eds.download(), "%s: the graph's replay differs",
            name);
    cudaFree(ws);
  }
  const auto lb = loss.download();
  Buf lb_d({int64_t(lb.size())}, DLDataType{kDLUInt, 8, 1}, dev), lall({int64_t(lb.size()) * W}, DLDataType{kDLUInt, 8, 1}, dev);
  lb_d.upload(lb.data());
  if (nccl.all_gather(lb_d.p, lall.p, lb.size(), 0, nc, st) != 0) CHECK(false, "test all-gather failed");
  ck(cudaStreamSynchronize(st), "sync");
  const auto la = lall.download();
  for (int r = 1; r < W; ++r)
    CHECK(std::memcmp(la.data(), la.data() + size_t(r) * lb.size(), lb.size()) == 0, "%s: rank %d's loss differs",
          name, r);
  if (c.nan_row && none && c.N > 1 && topk_norm != FCE_KD_TOPK_RENORMALIZE) {  // renormalized: NaN off the ids
    float l1 = 0;
    std::memcpy(&l1, lb.data() + 4, 4);
    CHECK(std::isnan(l1), "%s: row 1's NaN did not reach rank %d (loss %g)", name, g_rank, l1);
  }
  std::printf("rank %d: %s: ok\n", g_rank, name);
}

// Largest |a - b| of two outputs (bf16 or fp32 bytes) over the largest |b|; NaN where their NaNs differ.
double relative_gap(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, bool bf16) {
  auto at = [bf16](const std::vector<uint8_t>& v, size_t i) {
    float f;
    if (bf16) {
      uint16_t u;
      std::memcpy(&u, v.data() + i * 2, 2);
      const uint32_t w = uint32_t(u) << 16;
      std::memcpy(&f, &w, 4);
    } else {
      std::memcpy(&f, v.data() + i * 4, 4);
    }
    return double(f);
  };
  if (a.size() != b.size()) return NAN;
  const size_t n = a.size() / (bf16 ? 2 : 4);
  double gap = 0, top = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = at(a, i), y = at(b, i);
    if (std::isnan(x) != std::isnan(y)) return NAN;
    if (std::isnan(y)) continue;
    gap = std::max(gap, std::fabs(x - y));
    top = std::max(top, std::fabs(y));
  }
  return top > 0 ? gap / top : gap;
}

// Vocabulary-parallel linear cross-entropy in NCCL mode (fce_linear_cross_entropy_fwd_vp: the LM head split by
// rows, each token chunk's records all-gathered inside the call, dhidden's fp32 parts summed in rank order)
// against the one-device emulation: every shard's fce_linear_cross_entropy_partial, fce_cross_entropy_combine,
// every shard's fce_linear_cross_entropy_bwd with an fp32 dhidden summed on the host in rank order and
// rounded once. Where N fits one token chunk in both their GEMMs have the same shapes: the same bits, for any
// number of ranks and NCCL setting. With `chunks`, N needs several token chunks, which NCCL mode plans from
// vocab_total / W on every rank and the emulation's single-shard calls from their own width: their GEMMs may
// then differ in the last bits, so outputs are compared within bounds, and the ranks' loss, lse, entropy and
// argmax with each other bitwise. Then FCE_LINEAR_CE_ACCUMULATE (dhidden added into, through the fp32 sum)
// and a CUDA graph of the call.
void linear_case(const Case& c, int64_t H, int W, int dev, fce_handle_t h, fce_comm_t comm, cudaStream_t st,
                 const Nccl& nccl, ncclComm* nc, bool chunks = false) {
  const Split s{c.V, W, (c.V + W - 1) / W};
  std::mt19937_64 g(uint64_t(c.N * 31 + c.V + H));
  std::normal_distribution<float> nd(0.f, 1.f);
  const size_t es = c.bf16 ? 2 : 4;
  const DLDataType xt = c.bf16 ? kBF16 : kF32;
  auto store = [&](std::vector<uint8_t>& out, size_t i, float v) {
    if (c.bf16) {
      const uint16_t b = to_bf16(v);
      std::memcpy(out.data() + i * 2, &b, 2);
    } else {
      std::memcpy(out.data() + i * 4, &v, 4);
    }
  };
  std::vector<uint8_t> hid(size_t(c.N * H) * es);
  for (size_t i = 0; i < size_t(c.N * H); ++i) store(hid, i, nd(g));
  std::vector<float> wfull(size_t(c.V * H));
  for (auto& v : wfull) v = 0.5f * nd(g);
  auto shard_w = [&](int64_t r) {  // rows of shard r, padding rows NaN (never read)
    std::vector<uint8_t> out(size_t(s.width * H) * es);
    for (int64_t v = 0; v < s.width; ++v)
      for (int64_t k = 0; k < H; ++k)
        store(out, size_t(v * H + k), s.start(r) + v < c.V ? wfull[size_t((s.start(r) + v) * H + k)] : NAN);
    return out;
  };
  std::vector<int64_t> t(size_t(c.N));
  for (int64_t i = 0; i < c.N; ++i) t[size_t(i)] = i % 7 == 2 ? -100 : int64_t(g() % uint64_t(c.V));
  Buf hidden({c.N, H}, xt, dev), weight({s.width, H}, xt, dev), targets({c.N}, kI64, dev);
  hidden.upload(hid.data());
  weight.upload(shard_w(g_rank).data());
  targets.upload(t.data());
  const fce_ce_options_t o = options_of(c, s, g_rank);
  const fce_stream_t fs = reinterpret_cast<fce_stream_t>(st);
  const bool none = c.reduction == FCE_REDUCTION_NONE;
  const std::vector<int64_t> lshape = none ? std::vector<int64_t>{c.N} : std::vector<int64_t>{};

  // NCCL mode.
  Buf loss(lshape, kF32, dev), lse({c.N}, kF32, dev), ent({c.N}, kF32, dev), am({c.N}, kI64, dev),
      dh({c.N, H}, xt, dev), dw({s.width, H}, xt, dev);
  for (Buf* b : {&loss, &lse, &ent, &am, &dh, &dw}) b->poison();
  fce_linear_ce_outputs_t out = FCE_LINEAR_CE_OUTPUTS_INIT;
  out.loss = &loss.t;
  out.lse = &lse.t;
  out.entropy = &ent.t;
  out.argmax = &am.t;
  out.dhidden = &dh.t;
  out.dweight = &dw.t;
  ok(fce_linear_cross_entropy_fwd_vp(h, comm, fs, &hidden.t, &weight.t, nullptr, &targets.t, &o, &out, nullptr, 0),
     "fce_linear_cross_entropy_fwd_vp");
  ck(cudaStreamSynchronize(st), "sync");

  // The emulation.
  Buf recs({int64_t(W), c.N, 7}, kF32, dev);
  std::vector<float> dsum(size_t(c.N * H), 0.f);
  std::vector<uint8_t> dw_ref;
  Buf eloss(lshape, kF32, dev), else_lse({c.N}, kF32, dev), eent({c.N}, kF32, dev), eam({c.N}, kI64, dev);
  for (Buf* b : {&eloss, &else_lse, &eent, &eam}) b->poison();
  std::vector<std::unique_ptr<Buf>> shards;
  for (int r = 0; r < W; ++r) {
    shards.push_back(std::make_unique<Buf>(std::vector<int64_t>{s.width, H}, xt, dev));
    shards.back()->upload(shard_w(r).data());
    const fce_ce_options_t orr = options_of(c, s, r);
    DLTensor view = recs.t;
    int64_t vshape[2] = {c.N, 7};
    view.ndim = 2;
    view.shape = vshape;
    view.byte_offset = uint64_t(r) * uint64_t(c.N) * 7 * 4;
    ok(fce_linear_cross_entropy_partial(h, fs, &hidden.t, &shards.back()->t, nullptr, &targets.t, &orr, &view,
                                        nullptr, 0),
       "fce_linear_cross_entropy_partial");
  }
  fce_ce_outputs_t eo = FCE_CE_OUTPUTS_INIT;
  eo.loss = &eloss.t;
  eo.lse = &else_lse.t;
  eo.entropy = &eent.t;
  eo.argmax = &eam.t;
  ok(fce_cross_entropy_combine(h, fs, &recs.t, &targets.t, &o, &eo, nullptr, 0), "fce_cross_entropy_combine");
  for (int r = 0; r < W; ++r) {
    const fce_ce_options_t orr = options_of(c, s, r);
    Buf dhr({c.N, H}, kF32, dev), dwr({s.width, H}, xt, dev);
    fce_linear_ce_outputs_t ob = FCE_LINEAR_CE_OUTPUTS_INIT;
    ob.dhidden = &dhr.t;
    ob.dweight = &dwr.t;
    ok(fce_linear_cross_entropy_bwd(h, fs, &hidden.t, &shards[size_t(r)]->t, nullptr, &targets.t, &else_lse.t, &orr, &ob,
                                    nullptr, 0),
       "fce_linear_cross_entropy_bwd");
    ck(cudaStreamSynchronize(st), "sync");
    const auto part = dhr.download();
    for (size_t i = 0; i < dsum.size(); ++i) {
      float v;
      std::memcpy(&v, part.data() + i * 4, 4);
      dsum[i] = r == 0 ? v : dsum[i] + v;
    }
    if (r == g_rank) dw_ref = dwr.download();
  }
  std::vector<uint8_t> dh_ref(size_t(c.N * H) * es);
  for (size_t i = 0; i < dsum.size(); ++i) store(dh_ref, i, dsum[i]);
  char name[160];
  std::snprintf(name, sizeof name, "linear N=%lld H=%lld V=%lld %s reduction=%d smoothing=%g zloss=%g",
                (long long)c.N, (long long)H, (long long)c.V, c.bf16 ? "bf16" : "fp32", c.reduction, c.smoothing,
                c.zloss);
  if (!chunks) {
    CHECK(loss.download() == eloss.download() && lse.download() == else_lse.download() &&
              ent.download() == eent.download() && am.download() == eam.download(),
          "%s: the loss, lse, entropy or argmax differ from the emulation", name);
    CHECK(dw.download() == dw_ref, "%s: dweight differs from the emulation's", name);
    CHECK(dh.download() == dh_ref, "%s: dhidden differs from the emulation's rank-order sum", name);
  } else {
    // bf16 logits one ulp apart move a row's loss by ~1e-3 relative at most; mixed-up chunks by far more.
    const double gl = relative_gap(loss.download(), eloss.download(), false),
                 gs = relative_gap(lse.download(), else_lse.download(), false),
                 gw = relative_gap(dw.download(), dw_ref, c.bf16), gh = relative_gap(dh.download(), dh_ref, c.bf16);
    const bool same = loss.download() == eloss.download() && lse.download() == else_lse.download() &&
                      dw.download() == dw_ref && dh.download() == dh_ref;
    std::printf("rank %d: %s: against the emulation: loss %.2e lse %.2e dweight %.2e dhidden %.2e (%s)\n", g_rank,
                name, gl, gs, gw, gh, same ? "bitwise equal" : "not bitwise");
    CHECK(gl <= 1e-3 && gs <= 1e-5 && gw <= 2e-2 && gh <= 2e-2, "%s: outputs off the emulation's", name);
    CHECK(am.download() == eam.download() || c.bf16, "%s: argmax differs from the emulation", name);
    std::vector<uint8_t> mine;
    for (const Buf* b : {&loss, &lse, &ent, &am}) {
      const auto v = b->download();
      mine.insert(mine.end(), v.begin(), v.end());
    }
    Buf mine_d({int64_t(mine.size())}, DLDataType{kDLUInt, 8, 1}, dev);
    Buf all_d({int64_t(mine.size()) * W}, DLDataType{kDLUInt, 8, 1}, dev);
    mine_d.upload(mine.data());
    if (nccl.all_gather(mine_d.p, all_d.p, mine.size(), 0, nc, st) != 0) CHECK(false, "test all-gather failed");
    ck(cudaStreamSynchronize(st), "sync");
    const auto all = all_d.download();
    for (int r = 1; r < W; ++r)
      CHECK(std::memcmp(all.data(), all.data() + size_t(r) * mine.size(), mine.size()) == 0,
            "%s: rank %d's loss/lse/entropy/argmax differ from rank 0's", name, r);
  }

  // Accumulating: dhidden (holding the hidden states' values) + the sum, added in fp32, rounded once.
  {
    dh.upload(hid.data());
    fce_linear_ce_outputs_t acc = FCE_LINEAR_CE_OUTPUTS_INIT;
    acc.loss = &loss.t;
    acc.dhidden = &dh.t;
    acc.flags = FCE_LINEAR_CE_ACCUMULATE;
    ok(fce_linear_cross_entropy_fwd_vp(h, comm, fs, &hidden.t, &weight.t, nullptr, &targets.t, &o, &acc, nullptr, 0),
       "fce_linear_cross_entropy_fwd_vp (accumulate)");
    std::vector<uint8_t> want(dh_ref.size());
    for (size_t i = 0; i < dsum.size(); ++i) {
      float prev;
      if (c.bf16) {
        uint16_t b;
        std::memcpy(&b, hid.data() + i * 2, 2);
        const uint32_t u = uint32_t(b) << 16;
        std::memcpy(&prev, &u, 4);
      } else {
        std::memcpy(&prev, hid.data() + i * 4, 4);
      }
      store(want, i, prev + dsum[i]);
    }
    if (!chunks) CHECK(dh.download() == want, "%s: accumulated dhidden differs from the emulation's", name);
    else CHECK(relative_gap(dh.download(), want, c.bf16) <= 2e-2, "%s: accumulated dhidden off the emulation's", name);
    ok(fce_linear_cross_entropy_fwd_vp(h, comm, fs, &hidden.t, &weight.t, nullptr, &targets.t, &o, &out, nullptr, 0),
       "fce_linear_cross_entropy_fwd_vp");
  }

  // A CUDA graph of the call, with the caller's workspace.
  size_t wsb = 0;
  ok(fce_linear_cross_entropy_fwd_vp_workspace_size(h, comm, &hidden.t, &weight.t, nullptr, &targets.t, &o, &out, &wsb),
     "workspace size");
  void* ws = nullptr;
  ck(cudaMalloc(&ws, wsb ? wsb : 1), "cudaMalloc");
  const auto eager_dh = dh.download(), eager_lse = lse.download();
  dh.poison();
  lse.poison();
  if (replayed(st, name, 2, [&] {
        return fce_linear_cross_entropy_fwd_vp(h, comm, fs, &hidden.t, &weight.t, nullptr, &targets.t, &o, &out, ws,
                                               wsb);
      }))
    CHECK(dh.download() == eager_dh && lse.download() == eager_lse, "%s: the graph's replay differs", name);
  cudaFree(ws);
  std::printf("rank %d: %s: ok\n", g_rank, name);
}

void validation(int W, int dev, fce_handle_t h, fce_comm_t comm, cudaStream_t st) {
  const Case c{4, 1000, false, FCE_REDUCTION_NONE, 0.f, 0.f, false};
  const Split s{c.V, W, (c.V + W - 1) / W};
  Buf logits({c.N, s.width}, kF32, dev), targets({c.N}, kI64, dev);
  ck(cudaMemset(logits.p, 0, logits.bytes), "memset");
  ck(cudaMemset(targets.p, 0, targets.bytes), "memset");
  Outs out(c, s, dev);
  out.poison();
  const auto before = out.bytes();
  fce_ce_outputs_t ov = out.view(true);
  const fce_stream_t fs = reinterpret_cast<fce_stream_t>(st);
  fce_ce_options_t o = options_of(c, s, g_rank);
  CHECK(fce_cross_entropy_fwd_vp(h, nullptr, fs, &logits.t, &targets.t, &o, &ov, nullptr, 0) ==
            FCE_STATUS_INVALID_ARGUMENT, "NULL comm");
  fce_ce_options_t plain = FCE_CE_OPTIONS_INIT;
  CHECK(fce_cross_entropy_fwd_vp(h, comm, fs, &logits.t, &targets.t, &plain, &ov, nullptr, 0) ==
            FCE_STATUS_INVALID_ARGUMENT, "options without vocab_total");
  CHECK(std::strstr(fce_last_error_message(), "vocab_total") != nullptr, "message: %s", fce_last_error_message());
  Buf wrong({c.N, s.width + 1}, kF32, dev);
  ov.dlogits = &wrong.t;
  CHECK(fce_cross_entropy_fwd_vp(h, comm, fs, &logits.t, &targets.t, &o, &ov, nullptr, 0) ==
            FCE_STATUS_SHAPE_MISMATCH, "dlogits of another shape");
  CHECK(out.bytes() == before, "a refused call wrote outputs");
  fce_handle_t cpu = nullptr;
  fce_comm_t bad = nullptr;
  ok(fce_handle_create(kDLCPU, 0, &cpu), "cpu handle");
  CHECK(fce_comm_create(cpu, reinterpret_cast<ncclComm*>(&bad), &bad) == FCE_STATUS_INVALID_ARGUMENT && !bad,
        "a CPU handle");
  fce_handle_destroy(cpu);
  CHECK(fce_comm_destroy(nullptr) == FCE_STATUS_SUCCESS, "destroy NULL");
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Random bf16 values in [-scale, scale) from xorshift, tiled from a block of 2^24: a 2 GB buffer fills in a
// fraction of a second, which a per-element host generator does not (the timings do not depend on values).
void fill_bf16(Buf& b, float scale, uint64_t seed) {
  const size_t n = b.bytes / 2, block = std::min<size_t>(n, size_t(1) << 24);
  std::vector<uint16_t> hv(block);
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& v : hv) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    v = to_bf16(scale * (float(x >> 40) / float(1 << 23) - 1.f));
  }
  char* p = static_cast<char*>(b.p);
  ck(cudaMemcpy(p, hv.data(), block * 2, cudaMemcpyHostToDevice), "upload");
  for (size_t done = block; done < n;) {
    const size_t m = std::min(done, n - done);
    ck(cudaMemcpy(p + done * 2, p, m * 2, cudaMemcpyDeviceToDevice), "tile");
    done += m;
  }
  ck(cudaDeviceSynchronize(), "sync");
}

// One result for benchmarks/plot_scaling.py, which reads these lines from every rank's output (a step takes
// its slowest rank's time). scaling: strong (V split), weak (V_local = V on every rank) or one (one GPU).
void result(int W, const char* op, const char* scaling, int64_t N, int64_t v_local, int64_t V, const char* what,
            double ms) {
  std::printf("@result {\"ranks\": %d, \"rank\": %d, \"op\": \"%s\", \"scaling\": \"%s\", \"N\": %lld, "
              "\"V_local\": %lld, \"V\": %lld, \"what\": \"%s\", \"ms\": %.5f}\n",
              W, g_rank, op, scaling, (long long)N, (long long)v_local, (long long)V, what, ms);
}

// Per-rank timings (CUDA events after an L2 flush, median of 20): CE forward (loss) and forward + dlogits in
// place in NCCL mode, KD forward KL through the caller's all-gather, linear CE forward + backward in NCCL
// mode, each with V split over the ranks (strong) and V_local = V on every rank (weak), next to the one-GPU
// fused calls over V; the record exchange alone; the steps of each.
void bench(int W, int dev, fce_handle_t h, fce_comm_t comm, cudaStream_t st, const Nccl& nccl, ncclComm* nc) {
  const int64_t N = 8192, V = 128256;
  const fce_stream_t fs = reinterpret_cast<fce_stream_t>(st);
  cudaEvent_t e0, e1;
  cudaEventCreate(&e0);
  cudaEventCreate(&e1);
  Buf flush({int64_t(256) << 20}, DLDataType{kDLUInt, 8, 1}, dev);
  auto time = [&](auto&& fn) {
    std::vector<float> ms;
    fn();
    for (int i = 0; i < 20; ++i) {
      ck(cudaMemsetAsync(flush.p, i, flush.bytes, st), "flush");
      cudaEventRecord(e0, st);
      fn();
      cudaEventRecord(e1, st);
      cudaEventSynchronize(e1);
      float t = 0;
      cudaEventElapsedTime(&t, e0, e1);
      ms.push_back(t);
    }
    return median(ms);
  };
  std::vector<int64_t> tg(N);
  std::mt19937_64 g(1);
  for (auto& v : tg) v = int64_t(g() % uint64_t(V));
  const uint64_t seed = uint64_t(g_rank + 1) * 1000;
  // FCE_VP_BENCH=linear: the linear CE part alone (an A/B of NCCL mode's dhidden sum).
  const char* only = std::getenv("FCE_VP_BENCH");
  if (!only || std::strcmp(only, "linear") != 0) {
    for (int weak = 0; weak < 2; ++weak) {
      const char* sc = weak ? "weak" : "strong";
      const int64_t VT = weak ? V * W : V, width = weak ? V : (V + W - 1) / W;
      Buf x({N, width}, kBF16, dev), t({N}, kI64, dev), loss({}, kF32, dev);
      fill_bf16(x, 4.f, seed + uint64_t(weak));
      std::vector<int64_t> tt(tg);
      if (weak)
        for (auto& v : tt) v = int64_t(g() % uint64_t(VT));
      t.upload(tt.data());
      fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
      o.vocab_start = g_rank * width;
      o.vocab_total = VT;
      fce_ce_outputs_t fwd = FCE_CE_OUTPUTS_INIT, grad = FCE_CE_OUTPUTS_INIT;
      fwd.loss = grad.loss = &loss.t;
      grad.dlogits = &x.t;  // in place, as a training step does
      size_t wsb = 0;
      ok(fce_cross_entropy_fwd_vp_workspace_size(h, comm, &x.t, &t.t, &o, &grad, &wsb), "ws");
      Buf ent({N}, kF32, dev), lse({N}, kF32, dev), amax({N}, kI64, dev);
      fce_ce_outputs_t fe = fwd;  // with the entropy (5-field records) and the argmax (7)
      fe.entropy = &ent.t;
      fe.argmax = &amax.t;
      size_t wse = 0;
      ok(fce_cross_entropy_fwd_vp_workspace_size(h, comm, &x.t, &t.t, &o, &fe, &wse), "ws");
      wsb = std::max(wsb, wse);
      void* ws = nullptr;
      ck(cudaMalloc(&ws, wsb), "ws");
      const float tf = time([&] { ok(fce_cross_entropy_fwd_vp(h, comm, fs, &x.t, &t.t, &o, &fwd, ws, wsb), "vp"); });
      const float tfe = time([&] { ok(fce_cross_entropy_fwd_vp(h, comm, fs, &x.t, &t.t, &o, &fe, ws, wsb), "vp"); });
      // The steps alone: the shard's records at each width, its gradient from an lse, and a copy of the
      // shard (a read and a write: the bandwidth of this run).
      float tp[3];
      const int64_t widths[3] = {FCE_CE_RECORD_FIELDS_LOSS, FCE_CE_RECORD_FIELDS_ENTROPY, FCE_CE_RECORD_FIELDS_ALL};
      for (int k = 0; k < 3; ++k) {
        Buf rec({N, widths[k]}, kF32, dev);
        tp[k] = time([&] { ok(fce_cross_entropy_partial(h, fs, &x.t, &t.t, &o, &rec.t), "partial"); });
      }
      ck(cudaMemset(lse.p, 0, lse.bytes), "memset");
      Buf dx({N, width}, kBF16, dev);
      const float tb = time([&] {
        ok(fce_cross_entropy_bwd(h, fs, &x.t, &t.t, &lse.t, nullptr, &o, &dx.t, ws, wsb), "bwd");
      });
      const float tc = time([&] { ck(cudaMemcpyAsync(dx.p, x.p, x.bytes, cudaMemcpyDeviceToDevice, st), "copy"); });
      // What one pass over the shard would cost (the stretch design: rows kept on chip across the exchange):
      // the unsharded fused forward + dlogits of the same [N, V_local] columns, into dx.
      float t1p = 0;
      {
        Buf tl({N}, kI64, dev);
        std::vector<int64_t> tloc(size_t(N), 0);
        for (int64_t i = 0; i < N; ++i) tloc[size_t(i)] = int64_t(g() % uint64_t(width));
        tl.upload(tloc.data());
        fce_ce_outputs_t one = FCE_CE_OUTPUTS_INIT;
        one.loss = &loss.t;
        one.dlogits = &dx.t;
        t1p = time([&] { ok(fce_cross_entropy_fwd(h, fs, &x.t, &tl.t, nullptr, &one, nullptr, 0), "fwd"); });
      }
      // The library's own device memory when it takes the workspace itself (cudaMemGetInfo around the first
      // such call of a fresh handle: the handle keeps its workspace).
      size_t lib_bytes = 0;
      {
        fce_handle_t h2 = nullptr;
        ok(fce_handle_create(kDLCUDA, dev, &h2), "handle");
        ck(cudaDeviceSynchronize(), "sync");
        size_t f0 = 0, f1 = 0, total = 0;
        ck(cudaMemGetInfo(&f0, &total), "meminfo");
        ok(fce_cross_entropy_fwd_vp(h2, comm, fs, &x.t, &t.t, &o, &fe, nullptr, 0), "vp");
        ck(cudaDeviceSynchronize(), "sync");
        ck(cudaMemGetInfo(&f1, &total), "meminfo");
        lib_bytes = f0 > f1 ? f0 - f1 : 0;
        fce_handle_destroy(h2);
      }
      // last: the gradient in place changes the logits
      const float tg2 = time([&] { ok(fce_cross_entropy_fwd_vp(h, comm, fs, &x.t, &t.t, &o, &grad, ws, wsb), "vp"); });
      cudaFree(ws);
      std::printf("| rank %d | %s | N=%lld V_local=%lld V=%lld | %.3f | %.3f |\n", g_rank, weak ? "weak" : "strong",
                  (long long)N, (long long)width, (long long)VT, tf, tg2);
      std::printf("| rank %d | %s steps | loss+entropy+argmax %.3f; partial K=4/5/7 %.3f / %.3f / %.3f; shard bwd %.3f;"
                  " copy %.3f (%.0f GB/s); one pass over the shard (unsharded fused call) %.3f; library memory with workspace NULL %.2f MiB (workspace query %.2f MiB) | | |\n",
                  g_rank, weak ? "weak" : "strong", tfe, tp[0], tp[1], tp[2], tb, tc, 2e-6 * double(x.bytes) / tc, t1p,
                  double(lib_bytes) / 1048576.0, double(wsb) / 1048576.0);
      result(W, "ce", sc, N, width, VT, "fwd", tf);
      result(W, "ce", sc, N, width, VT, "fwd_dlogits", tg2);
      result(W, "ce", sc, N, width, VT, "partial_k4", tp[0]);
      result(W, "ce", sc, N, width, VT, "shard_bwd", tb);
      result(W, "ce", sc, N, width, VT, "copy", tc);
      result(W, "ce", sc, N, width, VT, "one_pass", t1p);
    }
    for (int64_t K : {int64_t(FCE_CE_RECORD_FIELDS_LOSS), int64_t(FCE_CE_RECORD_FIELDS_ALL)}) {
      // the exchange alone: the all-gather of [N, K] fp32 records
      Buf mine({N, K}, kF32, dev), all({int64_t(W) * N, K}, kF32, dev);
      const float ta = time([&] {
        if (nccl.all_gather(mine.p, all.p, size_t(N * K), 7, nc, st) != 0) CHECK(false, "all-gather failed");
      });
      std::printf("| rank %d | all-gather of [N, %lld] records | N=%lld, %d ranks | %.3f | |\n", g_rank, (long long)K,
                  (long long)N, W, ta);
      result(W, "exchange", "-", N, K, K, K == FCE_CE_RECORD_FIELDS_LOSS ? "all_gather_k4" : "all_gather_k7", ta);
    }
    // KD forward KL, student and teacher both sharded: the records, the all-gather, the combine; 4096 rows
    // (issue 28's target) and 8192 (the scaling curves), against one GPU's fce_kd_loss over V.
    for (int64_t NK : {int64_t(4096), int64_t(8192)}) {
      float t1f = 0;
      {
        Buf ws1({NK, V}, kBF16, dev), wt1({NK, V}, kBF16, dev), l1({}, kF32, dev);
        fill_bf16(ws1, 4.f, seed + 7);
        fill_bf16(wt1, 4.f, seed + 8);
        fce_kd_teacher_t t1 = FCE_KD_TEACHER_INIT;
        t1.logits = &wt1.t;
        fce_kd_outputs_t o1 = FCE_KD_OUTPUTS_INIT;
        o1.loss = &l1.t;
        t1f = time([&] { ok(fce_kd_loss(h, fs, &ws1.t, &t1, nullptr, nullptr, &o1, nullptr, 0), "kd"); });
      }
      result(W, "kd", "one", NK, V, V, "fwd", t1f);
      for (int weak = 0; weak < (NK == 8192 ? 2 : 1); ++weak) {
        const char* sc = weak ? "weak" : "strong";
        const int64_t VT = weak ? V * W : V, width = weak ? V : (V + W - 1) / W;
        Buf xs({NK, width}, kBF16, dev), xt({NK, width}, kBF16, dev), rec({NK, FCE_KD_RECORD_FIELDS}, kF32, dev);
        Buf all({int64_t(W), NK, FCE_KD_RECORD_FIELDS}, kF32, dev), loss({}, kF32, dev);
        Buf stats({NK, FCE_KD_ROW_STATS_FIELDS}, kF32, dev), ds({NK, width}, kBF16, dev);
        fill_bf16(xs, 4.f, seed + 9);
        fill_bf16(xt, 4.f, seed + 10);
        fce_kd_options_t o = FCE_KD_OPTIONS_INIT;
        o.vocab_start = g_rank * width;
        o.vocab_total = VT;
        fce_kd_teacher_t tt = FCE_KD_TEACHER_INIT;
        tt.logits = &xt.t;
        size_t wsb = 0;
        ok(fce_kd_combine_workspace_size(h, &all.t, nullptr, &o, &loss.t, &stats.t, &wsb), "ws");
        void* ws = nullptr;
        ck(cudaMalloc(&ws, wsb + 256), "ws");
        const float tp = time([&] { ok(fce_kd_partial(h, fs, &xs.t, &tt, &o, &rec.t), "kd partial"); });
        const float tf = time([&] {
          ok(fce_kd_partial(h, fs, &xs.t, &tt, &o, &rec.t), "kd partial");
          if (nccl.all_gather(rec.p, all.p, size_t(NK) * FCE_KD_RECORD_FIELDS, 7, nc, st) != 0)
            CHECK(false, "all-gather");
          ok(fce_kd_combine(h, fs, &all.t, nullptr, &o, &loss.t, &stats.t, ws, wsb + 256), "kd combine");
        });
        const float tb = time([&] {
          ok(fce_kd_bwd(h, fs, &xs.t, &tt, nullptr, &stats.t, &o, nullptr, &ds.t, ws, wsb + 256), "kd bwd");
        });
        cudaFree(ws);
        // NCCL mode: the forward in one call (keeping the statistics, as an autograd forward does), and the
        // forward with the shard's dstudent
        fce_kd_outputs_t ko = FCE_KD_OUTPUTS_INIT;
        ko.loss = &loss.t;
        const float tv = time([&] { ok(fce_kd_fwd_vp(h, comm, fs, &xs.t, &tt, nullptr, &o, &ko, &stats.t, nullptr, 0), "kd vp"); });
        ko.dstudent = &ds.t;
        const float tvd = time([&] { ok(fce_kd_fwd_vp(h, comm, fs, &xs.t, &tt, nullptr, &o, &ko, nullptr, nullptr, 0), "kd vp"); });
        std::printf("| rank %d | KD forward KL, %s | N=%lld V_local=%lld V=%lld | partial %.3f; partial + all-gather + "
                    "combine %.3f; shard dstudent %.3f; fce_kd_fwd_vp %.3f, with dstudent %.3f; one GPU fce_kd_loss over V %.3f | |\n",
                    g_rank, sc, (long long)NK, (long long)width, (long long)VT, tp, tf, tb, tv, tvd, t1f);
        result(W, "kd", sc, NK, width, VT, "fwd_vp", tv);
        result(W, "kd", sc, NK, width, VT, "fwd_vp_dstudent", tvd);
        result(W, "kd", sc, NK, width, VT, "fwd", tf);
        result(W, "kd", sc, NK, width, VT, "partial", tp);
        result(W, "kd", sc, NK, width, VT, "shard_dstudent", tb);
      }
    }
    // KD with two exchanges (the records, then the terms), 4096 rows, strong, against one GPU's fce_kd_loss:
    // JSD (beta 0.5), and forward KL from a top-K teacher (K = 64, the same ids on every rank).
    auto two_exchanges = [&](const char* op, const char* what, const fce_kd_teacher_t& tt1,
                             const fce_kd_teacher_t& tt, const Buf& xs, fce_kd_options_t o, int64_t NK, int64_t width) {
      float t1 = 0;
      {
        Buf ws1({NK, V}, kBF16, dev), l1({}, kF32, dev);
        fill_bf16(ws1, 4.f, seed + 7);
        fce_kd_outputs_t o1 = FCE_KD_OUTPUTS_INIT;
        o1.loss = &l1.t;
        t1 = time([&] { ok(fce_kd_loss(h, fs, &ws1.t, &tt1, nullptr, &o, &o1, nullptr, 0), "kd"); });
      }
      Buf rec({NK, FCE_KD_RECORD_FIELDS}, kF32, dev), all({int64_t(W), NK, FCE_KD_RECORD_FIELDS}, kF32, dev);
      Buf terms({NK, FCE_KD_TERMS_RECORD_FIELDS}, kF32, dev), tall({int64_t(W), NK, FCE_KD_TERMS_RECORD_FIELDS}, kF32, dev);
      Buf loss({}, kF32, dev), stats({NK, FCE_KD_ROW_STATS_FIELDS}, kF32, dev), ds({NK, width}, kBF16, dev);
      o.vocab_start = g_rank * width;
      o.vocab_total = V;
      size_t wsb = 0;
      ok(fce_kd_terms_combine_workspace_size(h, &tall.t, nullptr, &o, &loss.t, &stats.t, &wsb), "ws");
      void* ws = nullptr;
      ck(cudaMalloc(&ws, wsb + 256), "ws");
      const float tf = time([&] {
        ok(fce_kd_partial(h, fs, &xs.t, &tt, &o, &rec.t), "kd partial");
        if (nccl.all_gather(rec.p, all.p, size_t(NK) * FCE_KD_RECORD_FIELDS, 7, nc, st) != 0) CHECK(false, "all-gather");
        ok(fce_kd_combine(h, fs, &all.t, nullptr, &o, nullptr, &stats.t, ws, wsb + 256), "kd combine");
        ok(fce_kd_terms_partial(h, fs, &xs.t, &tt, &stats.t, &o, &terms.t), "kd terms");
        if (nccl.all_gather(terms.p, tall.p, size_t(NK) * FCE_KD_TERMS_RECORD_FIELDS, 7, nc, st) != 0)
          CHECK(false, "all-gather");
        ok(fce_kd_terms_combine(h, fs, &tall.t, nullptr, &o, &loss.t, &stats.t, ws, wsb + 256), "kd terms combine");
      });
      const float tb = time([&] {
        ok(fce_kd_bwd(h, fs, &xs.t, &tt, nullptr, &stats.t, &o, nullptr, &ds.t, ws, wsb + 256), "kd bwd");
      });
      cudaFree(ws);
      std::printf("| rank %d | %s, strong | N=%lld V_local=%lld V=%lld | two exchanges (partial, all-gather, combine, "
                  "terms, all-gather, combine) %.3f; shard dstudent %.3f; one GPU fce_kd_loss over V %.3f | |\n",
                  g_rank, what, (long long)NK, (long long)width, (long long)V, tf, tb, t1);
      result(W, op, "one", NK, V, V, "fwd", t1);
      result(W, op, "strong", NK, width, V, "fwd", tf);
      result(W, op, "strong", NK, width, V, "shard_dstudent", tb);
    };
    {
      const int64_t NK = 4096, width = (V + W - 1) / W;
      Buf xs({NK, width}, kBF16, dev), xt({NK, width}, kBF16, dev), wt1({NK, V}, kBF16, dev);
      fill_bf16(xs, 4.f, seed + 9);
      fill_bf16(xt, 4.f, seed + 10);
      fill_bf16(wt1, 4.f, seed + 8);
      fce_kd_teacher_t tt = FCE_KD_TEACHER_INIT, tt1 = FCE_KD_TEACHER_INIT;
      tt.logits = &xt.t;
      tt1.logits = &wt1.t;
      fce_kd_options_t o = FCE_KD_OPTIONS_INIT;
      o.divergence = FCE_KD_JSD;
      two_exchanges("kd_jsd", "KD JSD", tt1, tt, xs, o, NK, width);
      const int64_t K = 64;
      std::vector<int64_t> hid(size_t(NK * K));
      std::vector<float> hlp(size_t(NK * K));
      for (int64_t i = 0; i < NK; ++i)
        for (int64_t k = 0; k < K; ++k) {
          hid[size_t(i * K + k)] = (i * 7919 + k * 104729) % V;
          hlp[size_t(i * K + k)] = -0.1f * float(k) - 0.2f;
        }
      Buf ids({NK, K}, kI64, dev), lps({NK, K}, kF32, dev);
      ids.upload(hid.data());
      lps.upload(hlp.data());
      fce_kd_teacher_t topk = FCE_KD_TEACHER_INIT;
      topk.topk_ids = &ids.t;
      topk.topk_logprobs = &lps.t;
      two_exchanges("kd_topk", "KD forward KL, top-K teacher K=64", topk, topk, xs, FCE_KD_OPTIONS_INIT, NK, width);
    }
    {  // one GPU, the whole V, fused forward + dlogits in place
      Buf x({N, V}, kBF16, dev), t({N}, kI64, dev), loss({}, kF32, dev);
      fill_bf16(x, 4.f, seed + 11);
      t.upload(tg.data());
      fce_ce_outputs_t fwd = FCE_CE_OUTPUTS_INIT, grad = FCE_CE_OUTPUTS_INIT;
      fwd.loss = grad.loss = &loss.t;
      grad.dlogits = &x.t;
      const float tf = time([&] { ok(fce_cross_entropy_fwd(h, fs, &x.t, &t.t, nullptr, &fwd, nullptr, 0), "fwd"); });
      const float tg2 = time([&] { ok(fce_cross_entropy_fwd(h, fs, &x.t, &t.t, nullptr, &grad, nullptr, 0), "fwd"); });
      std::printf("| rank %d | one GPU | N=%lld V=%lld | %.3f | %.3f |\n", g_rank, (long long)N, (long long)V, tf, tg2);
      result(W, "ce", "one", N, V, V, "fwd", tf);
      result(W, "ce", "one", N, V, V, "fwd_dlogits", tg2);
    }
    // Logsumexp and the softmax at T = 0.7 (fp32 probabilities) in NCCL mode, V split, against one GPU's
    // fce_logsumexp and fce_temp_softmax over V.
    for (int64_t NS : {int64_t(64), N}) {
      const int64_t width = (V + W - 1) / W;
      Buf xs({NS, width}, kBF16, dev), lse({NS}, kF32, dev), ps({NS, width}, kF32, dev);
      Buf x1({NS, V}, kBF16, dev), p1({NS, V}, kF32, dev);
      fill_bf16(xs, 4.f, seed + 12);
      fill_bf16(x1, 4.f, seed + 13);
      fce_lse_options_t lo = FCE_LSE_OPTIONS_INIT;
      lo.scale = 1.f / 0.7f;
      lo.vocab_start = g_rank * width;
      lo.vocab_total = V;
      fce_softmax_options_t so = FCE_SOFTMAX_OPTIONS_INIT, s1 = FCE_SOFTMAX_OPTIONS_INIT;
      so.temperature = s1.temperature = 0.7f;
      so.vocab_start = lo.vocab_start;
      so.vocab_total = V;
      const float tl = time([&] { ok(fce_logsumexp_vp(h, comm, fs, &xs.t, &lo, &lse.t, nullptr, 0), "lse vp"); });
      const float ts = time([&] {
        ok(fce_temp_softmax_vp(h, comm, fs, &xs.t, &so, &ps.t, nullptr, nullptr, nullptr, 0), "softmax vp");
      });
      fce_lse_options_t l1 = FCE_LSE_OPTIONS_INIT;
      l1.scale = lo.scale;
      const float tl1 = time([&] { ok(fce_logsumexp(h, fs, &x1.t, &l1, &lse.t, nullptr, 0), "lse"); });
      const float ts1 = time([&] { ok(fce_temp_softmax(h, fs, &x1.t, &s1, &p1.t, nullptr, nullptr, 0), "softmax"); });
      std::printf("| rank %d | logsumexp / softmax T=0.7 (fp32 probs), NCCL mode | N=%lld V_local=%lld V=%lld | %.3f | %.3f |"
                  " one GPU over V: %.3f / %.3f\n",
                  g_rank, (long long)NS, (long long)width, (long long)V, tl, ts, tl1, ts1);
      result(W, "lse", "strong", NS, width, V, "fwd", tl);
      result(W, "softmax", "strong", NS, width, V, "fwd", ts);
      result(W, "lse", "one", NS, V, V, "fwd", tl1);
      result(W, "softmax", "one", NS, V, V, "fwd", ts1);
    }
  }
  // Linear CE, the LM head split by rows: N 8192, H 4096, bf16; V split (strong) and V_local = V (weak); the
  // weak shard's columns are one GPU's whole problem, its fused call the baseline of both.
  const int64_t NL = 8192, H = 4096;
  Buf hid({NL, H}, kBF16, dev), dh({NL, H}, kBF16, dev), dh32({NL, H}, kF32, dev), lse({NL}, kF32, dev);
  Buf t({NL}, kI64, dev), loss({}, kF32, dev);
  fill_bf16(hid, 2.f, seed + 12);
  {
    // The device memory that the first call with a dhidden (its sum over the ranks) takes beyond the same call
    // without, both with a caller's workspace: NCCL makes connections on their first use, with buffers of its
    // own (grouped ncclSend / ncclRecv, tried for the sum, took 446 MiB on 2 ranks and 1214 MiB on 4).
    const int64_t width = (V + W - 1) / W;
    Buf wt({width, H}, kBF16, dev);
    fill_bf16(wt, 0.1f, seed + 20);
    std::vector<int64_t> tt(size_t(NL), 0);
    t.upload(tt.data());
    fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
    o.vocab_start = g_rank * width;
    o.vocab_total = V;
    fce_linear_ce_outputs_t fwd = FCE_LINEAR_CE_OUTPUTS_INIT, both = FCE_LINEAR_CE_OUTPUTS_INIT;
    fwd.loss = both.loss = &loss.t;
    both.dhidden = &dh.t;
    size_t wsb = 0, f0 = 0, f1 = 0, total = 0;
    ok(fce_linear_cross_entropy_fwd_vp_workspace_size(h, comm, &hid.t, &wt.t, nullptr, &t.t, &o, &both, &wsb), "ws");
    void* ws = nullptr;
    ck(cudaMalloc(&ws, wsb), "ws");
    ok(fce_linear_cross_entropy_fwd_vp(h, comm, fs, &hid.t, &wt.t, nullptr, &t.t, &o, &fwd, ws, wsb), "lce vp");
    ck(cudaDeviceSynchronize(), "sync");
    ck(cudaMemGetInfo(&f0, &total), "meminfo");
    ok(fce_linear_cross_entropy_fwd_vp(h, comm, fs, &hid.t, &wt.t, nullptr, &t.t, &o, &both, ws, wsb), "lce vp");
    ck(cudaDeviceSynchronize(), "sync");
    ck(cudaMemGetInfo(&f1, &total), "meminfo");
    cudaFree(ws);
    const double mib = f0 > f1 ? double(f0 - f1) / 1048576.0 : 0.0;
    std::printf("| rank %d | device memory of the first call with dhidden beyond the first without | %.1f MiB "
                "| |\n", g_rank, mib);
    result(W, "memory", "strong", NL, width, V, "first_dhidden_sum_mib", mib);
  }
  for (int weak = 0; weak < 2; ++weak) {
    const char* sc = weak ? "weak" : "strong";
    const int64_t VT = weak ? V * W : V, width = weak ? V : (V + W - 1) / W;
    Buf wt({width, H}, kBF16, dev), dw({width, H}, kBF16, dev);
    Buf rec({NL, FCE_CE_RECORD_FIELDS_LOSS}, kF32, dev), all({int64_t(W), NL, FCE_CE_RECORD_FIELDS_LOSS}, kF32, dev);
    fill_bf16(wt, 0.1f, seed + 13 + uint64_t(weak));
    std::vector<int64_t> tt(size_t(NL), 0);
    for (auto& v : tt) v = int64_t(g() % uint64_t(VT));
    t.upload(tt.data());
    fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
    o.vocab_start = g_rank * width;
    o.vocab_total = VT;
    fce_linear_ce_outputs_t fwd = FCE_LINEAR_CE_OUTPUTS_INIT, both = FCE_LINEAR_CE_OUTPUTS_INIT;
    fwd.loss = both.loss = &loss.t;
    both.dhidden = &dh.t;
    both.dweight = &dw.t;
    const float tf = time([&] {
      ok(fce_linear_cross_entropy_fwd_vp(h, comm, fs, &hid.t, &wt.t, nullptr, &t.t, &o, &fwd, nullptr, 0), "lce vp");
    });
    const float tfb = time([&] {
      ok(fce_linear_cross_entropy_fwd_vp(h, comm, fs, &hid.t, &wt.t, nullptr, &t.t, &o, &both, nullptr, 0), "lce vp");
    });
    // Where NCCL mode's time goes: dweight alone (no dhidden, no sum over the ranks), an fp32 dhidden (summed
    // in place, no rounding pass).
    fce_linear_ce_outputs_t dwo = fwd, f32o = both;
    dwo.dweight = &dw.t;
    f32o.dhidden = &dh32.t;
    const float tdw = time([&] {
      ok(fce_linear_cross_entropy_fwd_vp(h, comm, fs, &hid.t, &wt.t, nullptr, &t.t, &o, &dwo, nullptr, 0), "lce vp");
    });
    const float t32 = time([&] {
      ok(fce_linear_cross_entropy_fwd_vp(h, comm, fs, &hid.t, &wt.t, nullptr, &t.t, &o, &f32o, nullptr, 0), "lce vp");
    });
    // The explicit path: the shard's records, the all-gather, the combine, the shard's backward (recomputing
    // the logits) and the fp32 dhidden's sum over the ranks (NCCL's all-reduce here, in its own order).
    fce_ce_outputs_t co = FCE_CE_OUTPUTS_INIT;
    co.loss = &loss.t;
    co.lse = &lse.t;
    fce_linear_ce_outputs_t bo = FCE_LINEAR_CE_OUTPUTS_INIT;
    bo.dhidden = &dh32.t;
    bo.dweight = &dw.t;
    const float tx = time([&] {
      ok(fce_linear_cross_entropy_partial(h, fs, &hid.t, &wt.t, nullptr, &t.t, &o, &rec.t, nullptr, 0), "partial");
      if (nccl.all_gather(rec.p, all.p, size_t(NL * FCE_CE_RECORD_FIELDS_LOSS), 7, nc, st) != 0) CHECK(false, "ag");
      ok(fce_cross_entropy_combine(h, fs, &all.t, &t.t, &o, &co, nullptr, 0), "combine");
      ok(fce_linear_cross_entropy_bwd(h, fs, &hid.t, &wt.t, nullptr, &t.t, &lse.t, &o, &bo, nullptr, 0), "bwd");
      if (nccl.all_reduce(dh32.p, dh32.p, size_t(NL * H), 7, 0, nc, st) != 0) CHECK(false, "all-reduce");
    });
    // The fp32 all-reduce alone, for the share of the exchange.
    const float tar = time([&] {
      if (nccl.all_reduce(dh32.p, dh32.p, size_t(NL * H), 7, 0, nc, st) != 0) CHECK(false, "all-reduce");
    });
    // One GPU's fused call over the shard's columns (no exchange): the floor of this design.
    Buf tl({NL}, kI64, dev);
    for (auto& v : tt) v = int64_t(g() % uint64_t(width));
    tl.upload(tt.data());
    const float t1 = time([&] {
      ok(fce_linear_cross_entropy_fwd(h, fs, &hid.t, &wt.t, nullptr, &tl.t, nullptr, &both, nullptr, 0), "lce");
    });
    const float t1f = time([&] {
      ok(fce_linear_cross_entropy_fwd(h, fs, &hid.t, &wt.t, nullptr, &tl.t, nullptr, &fwd, nullptr, 0), "lce");
    });
    size_t lib_bytes = 0, wsb = 0;
    {
      ok(fce_linear_cross_entropy_fwd_vp_workspace_size(h, comm, &hid.t, &wt.t, nullptr, &t.t, &o, &both, &wsb), "ws");
      fce_handle_t h2 = nullptr;
      ok(fce_handle_create(kDLCUDA, dev, &h2), "handle");
      ck(cudaDeviceSynchronize(), "sync");
      size_t f0 = 0, f1 = 0, total = 0;
      ck(cudaMemGetInfo(&f0, &total), "meminfo");
      ok(fce_linear_cross_entropy_fwd_vp(h2, comm, fs, &hid.t, &wt.t, nullptr, &t.t, &o, &both, nullptr, 0), "lce vp");
      ck(cudaDeviceSynchronize(), "sync");
      ck(cudaMemGetInfo(&f1, &total), "meminfo");
      lib_bytes = f0 > f1 ? f0 - f1 : 0;
      fce_handle_destroy(h2);
    }
    const double flop = 6.0 * double(NL) * double(H) * double(width);
    std::printf("| rank %d | linear CE %s, N=%lld H=%lld V_local=%lld | fwd %.3f | fwd+bwd %.3f (%.0f TFLOP/s) |\n",
                g_rank, sc, (long long)NL, (long long)H, (long long)width, tf, tfb, flop / tfb * 1e-9);
    std::printf("| rank %d | linear CE %s steps | explicit partial+all-gather+combine+bwd+all-reduce %.3f; NCCL mode "
                "with dweight only %.3f, with an fp32 dhidden %.3f; fp32 all-reduce of [N, H] %.3f; one GPU's fused "
                "call over the shard's columns %.3f (%.0f TFLOP/s), forward %.3f; library memory with workspace NULL "
                "%.1f MiB (workspace query %.1f MiB) | | |\n",
                g_rank, sc, tx, tdw, t32, tar, t1, flop / t1 * 1e-9, t1f, double(lib_bytes) / 1048576.0,
                double(wsb) / 1048576.0);
    result(W, "linear_ce", sc, NL, width, VT, "fwd", tf);
    result(W, "linear_ce", sc, NL, width, VT, "fwd_bwd", tfb);
    result(W, "linear_ce", sc, NL, width, VT, "dweight_only", tdw);
    result(W, "linear_ce", sc, NL, width, VT, "fp32_dhidden", t32);
    result(W, "linear_ce", sc, NL, width, VT, "explicit", tx);
    result(W, "linear_ce", sc, NL, width, VT, "fp32_all_reduce", tar);
    result(W, "linear_ce", sc, NL, width, width, "one_gpu_shard_cols_fwd_bwd", t1);
    result(W, "linear_ce", sc, NL, width, width, "one_gpu_shard_cols_fwd", t1f);
    if (weak) {  // the weak shard's columns are V: one GPU's whole problem
      result(W, "linear_ce", "one", NL, V, V, "fwd_bwd", t1);
      result(W, "linear_ce", "one", NL, V, V, "fwd", t1f);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: vp_nccl RANK WORLD ID_FILE [--bench]\n");
    return 2;
  }
  g_rank = std::atoi(argv[1]);
  const int W = std::atoi(argv[2]);
  const std::string id_file = argv[3];
  const bool do_bench = argc > 4 && std::strcmp(argv[4], "--bench") == 0;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // the ranks share one log: whole lines
  // FCE_VP_SHARE_GPUS=1: more ranks than GPUs, rank r on GPU r % count (NCCL may refuse two ranks on one GPU).
  const char* share = std::getenv("FCE_VP_SHARE_GPUS");
  const bool shared = share && std::strcmp(share, "1") == 0;
  int ndev = 0;
  if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev < 1 || (ndev < W && !shared)) {
    std::printf("rank %d: %d GPU(s) for %d ranks: skipped\n", g_rank, ndev, W);
    return 77;
  }
  void* lib = dlopen("libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) {
    std::printf("rank %d: no libnccl.so.2 (%s): skipped\n", g_rank, dlerror());
    return 77;
  }
  Nccl nccl{};
  nccl.get_unique_id = reinterpret_cast<decltype(nccl.get_unique_id)>(dlsym(lib, "ncclGetUniqueId"));
  nccl.comm_init_rank = reinterpret_cast<decltype(nccl.comm_init_rank)>(dlsym(lib, "ncclCommInitRank"));
  nccl.comm_destroy = reinterpret_cast<decltype(nccl.comm_destroy)>(dlsym(lib, "ncclCommDestroy"));
  nccl.all_gather = reinterpret_cast<decltype(nccl.all_gather)>(dlsym(lib, "ncclAllGather"));
  nccl.all_reduce = reinterpret_cast<decltype(nccl.all_reduce)>(dlsym(lib, "ncclAllReduce"));
  const int dev = g_rank % ndev;
  ck(cudaSetDevice(dev), "cudaSetDevice");
  NcclId id{};
  if (g_rank == 0) {
    if (nccl.get_unique_id(&id) != 0) return 1;
    const std::string tmp = id_file + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    std::fwrite(&id, sizeof id, 1, f);
    std::fclose(f);
    std::rename(tmp.c_str(), id_file.c_str());
  } else {
    FILE* f = nullptr;
    for (int i = 0; i < 600 && !(f = std::fopen(id_file.c_str(), "rb")); ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (!f || std::fread(&id, sizeof id, 1, f) != 1) return 1;
    std::fclose(f);
  }
  ncclComm* nc = nullptr;
  if (nccl.comm_init_rank(&nc, W, id, g_rank) != 0) {
    std::fprintf(stderr, "rank %d: ncclCommInitRank failed\n", g_rank);
    return 1;
  }
  fce_handle_t h = nullptr;
  ok(fce_handle_create(kDLCUDA, dev, &h), "fce_handle_create");
  fce_comm_t comm = nullptr;
  ok(fce_comm_create(h, nc, &comm), "fce_comm_create");
  int32_t r = -1, w = -1;
  ok(fce_comm_info(comm, &r, &w), "fce_comm_info");
  CHECK(r == g_rank && w == W, "fce_comm_info: rank %d of %d", r, w);
  cudaStream_t st;
  ck(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), "stream");
  if (do_bench) {
    bench(W, dev, h, comm, st, nccl, nc);
  } else {
    const Case cases[] = {
        {1, 50021, false, FCE_REDUCTION_NONE, 0.f, 0.f, false},
        {37, 50021, true, FCE_REDUCTION_NONE, 0.1f, 1e-4f, true},
        {37, 50021, false, FCE_REDUCTION_MEAN, 0.f, 0.f, false},
        {300, 129920, true, FCE_REDUCTION_MEAN, 0.1f, 1e-4f, false},
        {300, 129920, true, FCE_REDUCTION_NONE, 0.f, 0.f, true},
        {64, 7, false, FCE_REDUCTION_SUM, 0.f, 0.f, false},  // shards of 4 and 3 columns (2 ranks)
        {37, 151936, true, FCE_REDUCTION_MEAN, 0.1f, 1e-4f, true},  // Qwen's V: uneven over 3 or 7 ranks
        {300, 129920, true, FCE_REDUCTION_NONE, 0.f, 0.f, false, true},
        {37, 50021, false, FCE_REDUCTION_MEAN, 0.1f, 1e-4f, true, true},
    };
    for (const Case& c : cases) run_case(c, W, dev, h, comm, nccl, nc, st);
    const Case kd_cases[] = {
        {37, 50021, false, FCE_REDUCTION_NONE, 0.f, 0.f, true},
        {300, 129920, true, FCE_REDUCTION_MEAN, 0.f, 0.f, false},
        {64, 7, false, FCE_REDUCTION_SUM, 0.f, 0.f, false},
        {37, 151936, true, FCE_REDUCTION_NONE, 0.f, 0.f, true},
    };
    for (const Case& c : kd_cases)
      for (int div : {FCE_KD_FORWARD_KL, FCE_KD_REVERSE_KL, FCE_KD_JSD}) {
        kd_case(c, div, W, dev, h, comm, nccl, nc, st);
        if (c.V >= 1000)  // a top-K teacher (distinct ids need V >= K)
          for (int norm : {FCE_KD_TOPK_FULL_VOCAB, FCE_KD_TOPK_RENORMALIZE}) kd_case(c, div, W, dev, h, comm, nccl, nc, st, norm);
      }
    for (const Case& c : kd_cases)
      for (float T : {1.f, 0.7f}) lse_case(c, T, W, dev, h, comm, nccl, nc, st);
    const Case linear_cases[] = {
        {37, 50021, true, FCE_REDUCTION_NONE, 0.f, 0.f, false},
        {300, 129920, true, FCE_REDUCTION_MEAN, 0.1f, 1e-4f, false},
        {64, 7, false, FCE_REDUCTION_SUM, 0.f, 0.f, false},
        {37, 151936, true, FCE_REDUCTION_NONE, 0.f, 0.f, false},
    };
    for (const Case& c : linear_cases) linear_case(c, c.V > 1000 ? 128 : 16, W, dev, h, comm, st, nccl, nc);
    // Several token chunks (448 MiB of bf16 logits hold ~3000 rows of 75969 columns, ~6000 of 37985) and a
    // short last shard: every rank must cut the same chunks for the per-chunk all-gathers to match.
    linear_case({7000, 151937, true, FCE_REDUCTION_MEAN, 0.1f, 1e-4f, false}, 64, W, dev, h, comm, st, nccl, nc,
                true);
    validation(W, dev, h, comm, st);
  }
  fce_comm_destroy(comm);
  fce_handle_destroy(h);
  nccl.comm_destroy(nc);
  std::printf("rank %d: %s (%d failure%s)\n", g_rank, g_fail ? "FAILED" : "passed", g_fail, g_fail == 1 ? "" : "s");
  return g_fail ? 1 : 0;
}
