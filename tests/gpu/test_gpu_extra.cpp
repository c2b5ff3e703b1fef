// GPU-only tests: more than 2^31 elements, bitwise repeatability, CUDA-graph capture, threads, programmatic
// dependent launches.
#include <cuda_runtime.h>

#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "../common/testing.hpp"

using namespace fct;

// 65536 x 50257 bf16 logits (3.3e9 elements): row i is 0 except a_i = i % 5 at t_i; loss is known exactly.
TEST(GpuLarge, MoreThan2To31Elements) {
  const int64_t N = 65536, V = 50257;
  Handle h;
  Tensor logits(DT::BF16, {N, V});
  ASSERT_EQ(cudaMemset(logits.dl()->data, 0, size_t(N * V) * 2), cudaSuccess);
  Tensor targets(DT::I64, {N});
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = (i * 7919) % V;
    targets.set_int(i, t);
    const uint16_t a = to_bf16(float(i % 5));
    ASSERT_EQ(cudaMemcpy(static_cast<char*>(logits.dl()->data) + size_t(i * V + t) * 2, &a, 2, cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  targets.upload();
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.reduction = FCE_REDUCTION_NONE;
  Tensor loss(DT::F32, {N}), lse(DT::F32, {N});
  loss.poison(); loss.upload();
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  out.lse = lse.dl();
  FCE_OK(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0));
  loss.download();
  for (int64_t i = 0; i < N; ++i) {
    const double a = i % 5;
    const double want = std::log(double(V - 1) + std::exp(a)) - a;
    ASSERT_TRUE(close(loss.get(i), want, 1e-5, 1e-5)) << "row " << i;
  }
  // logsumexp of the same rows
  Tensor l2(DT::F32, {N});
  FCE_OK(fce_logsumexp(h, test_stream(), logits.dl(), nullptr, l2.dl(), nullptr, 0));
  l2.download();
  for (int64_t i = 0; i < N; i += 97) ASSERT_TRUE(close(l2.get(i), std::log(double(V - 1) + std::exp(double(i % 5))), 1e-5, 1e-5));
}

namespace {
std::vector<uint8_t> run_ce_once(int64_t N, int64_t V, Tensor& logits, Tensor& targets) {
  Handle h;
  Tensor loss(DT::F32, {}), lse(DT::F32, {N}), dl(DT::BF16, {N, V});
  fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
  o.label_smoothing = 0.1f;
  o.z_loss_scale = 1e-4f;
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl(); out.lse = lse.dl(); out.dlogits = dl.dl();
  EXPECT_EQ(fce_cross_entropy_fwd(h, test_stream(), logits.dl(), targets.dl(), &o, &out, nullptr, 0), FCE_STATUS_SUCCESS);
  Tensor lse2(DT::F32, {N});
  EXPECT_EQ(fce_logsumexp(h, test_stream(), logits.dl(), nullptr, lse2.dl(), nullptr, 0), FCE_STATUS_SUCCESS);
  loss.download(); lse.download(); dl.download(); lse2.download();
  std::vector<uint8_t> all = loss.bytes();
  for (Tensor* t : {&lse, &dl, &lse2}) all.insert(all.end(), t->bytes().begin(), t->bytes().end());
  return all;
}
}  // namespace

TEST(GpuDeterminism, BitwiseRepeatable) {
  for (int64_t N : {1, 16, 300}) {
    const int64_t V = 151936;
    Tensor logits(DT::BF16, {N, V});
    fill_logits(logits, 3.0, true);
    Tensor targets(DT::I32, {N});
    for (int64_t i = 0; i < N; ++i) targets.set_int(i, (i * 31) % V);
    targets.upload();
    const auto a = run_ce_once(N, V, logits, targets), b = run_ce_once(N, V, logits, targets);
    ASSERT_TRUE(a == b) << "N=" << N << ": two runs differ";
  }
}

namespace {

// Device buffer copied back as bytes.
std::vector<uint8_t> bytes_of(const void* p, size_t n) {
  std::vector<uint8_t> h(n);
  EXPECT_EQ(cudaMemcpy(h.data(), p, n, cudaMemcpyDeviceToHost), cudaSuccess);
  return h;
}

struct GraphCase {
  int64_t N = 64, V = 32003, H = 64;
  Tensor logits{DT::BF16, {N, V}}, teacher{DT::BF16, {N, V}}, targets{DT::I32, {N}};
  Tensor hidden{DT::BF16, {N, H}}, weight{DT::BF16, {V, H}};
  Tensor loss{DT::F32, {}}, lse{DT::F32, {N}}, dl{DT::BF16, {N, V}}, probs{DT::F32, {N, V}};
  Tensor kdl{DT::F32, {}}, ds{DT::BF16, {N, V}}, lloss{DT::F32, {}}, dh{DT::BF16, {N, H}}, dw{DT::BF16, {V, H}};
  GraphCase() {
    fill_logits(logits, 2.0, true);
    fill_logits(teacher, 2.0, false);
    fill_logits(hidden, 1.0, false);
    fill_logits(weight, 0.1, false);
    for (int64_t i = 0; i < N; ++i) targets.set_int(i, (i * 131) % V);
    targets.upload();
  }
  // Every op once on `stream` with caller workspaces `ws` (no allocation: capturable).
  void run(fce_handle_t h, cudaStream_t stream, void* ws, size_t wsb) {
    fce_stream_t s = reinterpret_cast<fce_stream_t>(stream);
    fce_ce_outputs_t o = FCE_CE_OUTPUTS_INIT;
    o.loss = loss.dl(); o.lse = lse.dl(); o.dlogits = dl.dl();
    ASSERT_EQ(fce_cross_entropy_fwd(h, s, logits.dl(), targets.dl(), nullptr, &o, ws, wsb), FCE_STATUS_SUCCESS)
        << fce_last_error_message();
    ASSERT_EQ(fce_temp_softmax(h, s, logits.dl(), nullptr, probs.dl(), nullptr, ws, wsb), FCE_STATUS_SUCCESS)
        << fce_last_error_message();
    fce_kd_teacher_t t = FCE_KD_TEACHER_INIT;
    t.logits = teacher.dl();
    fce_kd_outputs_t ko = FCE_KD_OUTPUTS_INIT;
    ko.loss = kdl.dl(); ko.dstudent = ds.dl();
    ASSERT_EQ(fce_kd_loss(h, s, logits.dl(), &t, targets.dl(), nullptr, &ko, ws, wsb), FCE_STATUS_SUCCESS)
        << fce_last_error_message();
    fce_linear_ce_outputs_t lo = FCE_LINEAR_CE_OUTPUTS_INIT;
    lo.loss = lloss.dl(); lo.dhidden = dh.dl(); lo.dweight = dw.dl();
    ASSERT_EQ(fce_linear_cross_entropy_fwd(h, s, hidden.dl(), weight.dl(), nullptr, targets.dl(), nullptr, &lo, ws, wsb),
              FCE_STATUS_SUCCESS) << fce_last_error_message();
  }
  // Each output's bytes, named.
  std::vector<std::pair<const char*, std::vector<uint8_t>>> outputs() {
    std::vector<std::pair<const char*, std::vector<uint8_t>>> all;
    const char* names[] = {"ce loss", "ce lse", "dlogits", "probs", "kd loss", "dstudent", "lce loss", "dhidden",
                           "dweight"};
    int k = 0;
    for (Tensor* t : {&loss, &lse, &dl, &probs, &kdl, &ds, &lloss, &dh, &dw})
      all.emplace_back(names[k++], bytes_of(t->dl()->data, t->bytes().size()));
    return all;
  }
};

constexpr size_t kGraphWs = size_t(64) << 20;  // above every op's need at these sizes

}  // namespace

// Every op captured in a CUDA graph and replayed gives the bytes of direct calls.
TEST(GpuGraph, CaptureReplayMatchesDirectCalls) {
  GraphCase g;
  Handle h;
  void* ws = nullptr;
  ASSERT_EQ(cudaMalloc(&ws, kGraphWs), cudaSuccess);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  g.run(h, s, ws, kGraphWs);  // direct (also creates the cuBLAS handle outside capture)
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const auto direct = g.outputs();
  for (Tensor* t : {&g.loss, &g.lse, &g.dl, &g.probs, &g.kdl, &g.ds, &g.lloss, &g.dh, &g.dw})
    // Poison with the pattern the test allocator wrote (0xee), so the tensors' padding compares equal.
    ASSERT_EQ(cudaMemset(t->dl()->data, 0xee, t->bytes().size()), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);  // the poison lands before the non-blocking stream runs
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  g.run(h, s, ws, kGraphWs);
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (int k = 0; k < 2; ++k) ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  const auto replay = g.outputs();
  for (size_t k = 0; k < direct.size(); ++k)
    EXPECT_TRUE(replay[k].second == direct[k].second)
        << direct[k].first << ": graph replay differs from direct calls (first bytes " << int(replay[k].second[0])
        << "," << int(replay[k].second[1]) << " vs " << int(direct[k].second[0]) << "," << int(direct[k].second[1])
        << ")";
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
  cudaFree(ws);
}

namespace fct {
cudaError_t launch_slow_copy(const void* src, void* dst, size_t bytes, unsigned long long spin_ns, cudaStream_t s);
}

namespace {
struct PdlCase {
  const char* what;
  int64_t N, V;
  int op;  // 0 logsumexp, 1 cross-entropy forward (per-row loss and lse), 2 softmax -> fp32
};
}  // namespace

// The few-row register kernels (logsumexp, CE forward, softmax) are programmatic dependent launches on
// sm_90, so they must wait for the kernel before them in the stream. Here that kernel lets them
// launch at once and writes their logits over zeros ~200 us later: one that did not wait would read the
// zeros. Its results must be the bytes of a call on the logits themselves: direct, on the legacy default
// stream, and replayed in a graph.
TEST(GpuPdl, FewRowKernelsWaitForTheKernelBefore) {
  Handle h;
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(test_stream());
  const PdlCase cases[] = {{"logsumexp", 16, 151936, 0}, {"logsumexp", 1, 128256, 0}, {"CE forward", 16, 151936, 1},
                           {"CE forward", 1, 128256, 1}, {"softmax", 16, 151936, 2},   {"softmax", 1, 128256, 2}};
  for (const PdlCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << c.what << " " << c.N << "x" << c.V);
    Tensor src(DT::BF16, {c.N, c.V}), x(DT::BF16, {c.N, c.V}), targets(DT::I32, {c.N});
    fill_logits(src, 3.0, false);
    for (int64_t i = 0; i < c.N; ++i) targets.set_int(i, (i * 7919) % c.V);
    targets.upload();
    Tensor a(DT::F32, c.op == 2 ? std::vector<int64_t>{c.N, c.V} : std::vector<int64_t>{c.N}), b(DT::F32, {c.N});
    auto op = [&](DLTensor* logits, fce_stream_t st = test_stream()) {
      if (c.op == 0) return fce_logsumexp(h, st, logits, nullptr, a.dl(), nullptr, 0);
      if (c.op == 2) return fce_temp_softmax(h, st, logits, nullptr, a.dl(), nullptr, nullptr, 0);
      fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
      o.reduction = FCE_REDUCTION_NONE;
      fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
      out.loss = a.dl();
      out.lse = b.dl();
      return fce_cross_entropy_fwd(h, st, logits, targets.dl(), &o, &out, nullptr, 0);
    };
    auto reset = [&] {  // outputs poisoned, x zeros
      a.poison(); a.upload();
      b.poison(); b.upload();
      ASSERT_EQ(cudaMemsetAsync(x.dl()->data, 0, x.bytes().size(), s), cudaSuccess);
    };
    auto results = [&] {
      a.download();
      b.download();
      std::vector<uint8_t> r = a.bytes();
      r.insert(r.end(), b.bytes().begin(), b.bytes().end());
      return r;
    };
    reset();
    FCE_OK(op(src.dl()));  // also sizes the handle's workspace outside the capture below
    const std::vector<uint8_t> want = results();
    constexpr unsigned long long kSpinNs = 200000;
    const size_t bytes = size_t(c.N * c.V) * 2;
    reset();
    ASSERT_EQ(launch_slow_copy(src.dl()->data, x.dl()->data, bytes, kSpinNs, s), cudaSuccess);
    FCE_OK(op(x.dl()));
    EXPECT_TRUE(results() == want) << "direct: differs from a call on the logits";
    reset();  // the legacy default stream (NULL) too
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    ASSERT_EQ(launch_slow_copy(src.dl()->data, x.dl()->data, bytes, kSpinNs, nullptr), cudaSuccess);
    FCE_OK(op(x.dl(), nullptr));
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(results() == want) << "legacy default stream: differs from a call on the logits";
    reset();
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    cudaGraph_t graph;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    ASSERT_EQ(launch_slow_copy(src.dl()->data, x.dl()->data, bytes, kSpinNs, s), cudaSuccess);
    const fce_status_t st = op(x.dl());
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    FCE_OK(st);
    cudaGraphExec_t exec;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    EXPECT_TRUE(results() == want) << "graph: differs from a call on the logits";
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
  }
}

// Several threads, one handle and one stream each, give the bytes of a serial run.
TEST(GpuConcurrency, ThreadsWithOwnHandlesMatchSerial) {
  GraphCase g;
  std::vector<std::pair<const char*, std::vector<uint8_t>>> serial;
  {
    Handle h;
    g.run(h, nullptr, nullptr, 0);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    serial = g.outputs();
  }
  constexpr int kThreads = 4;
  std::vector<GraphCase> cases(kThreads);
  std::vector<std::thread> threads;
  for (int k = 0; k < kThreads; ++k) {
    // Same inputs as the serial run.
    for (auto pr : {std::make_pair(&g.logits, &cases[k].logits), std::make_pair(&g.teacher, &cases[k].teacher),
                    std::make_pair(&g.hidden, &cases[k].hidden), std::make_pair(&g.weight, &cases[k].weight)})
      ASSERT_EQ(cudaMemcpy(pr.second->dl()->data, pr.first->dl()->data, pr.first->bytes().size(),
                           cudaMemcpyDeviceToDevice), cudaSuccess);
  }
  for (int k = 0; k < kThreads; ++k)
    threads.emplace_back([&cases, k] {
      Handle h;
      cudaStream_t s;
      cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
      cases[k].run(h, s, nullptr, 0);
      cudaStreamSynchronize(s);
      cudaStreamDestroy(s);
    });
  for (auto& t : threads) t.join();
  for (int k = 0; k < kThreads; ++k) {
    const auto got = cases[k].outputs();
    for (size_t j = 0; j < serial.size(); ++j)
      EXPECT_TRUE(got[j].second == serial[j].second) << "thread " << k << ": " << serial[j].first << " differs";
  }
}

// The handle's cached workspace grows in stream order: while a slow kernel occupies the stream, a call that
// grows the cache (twice: from nothing, then past its size) returns at once and leaves the stream busy,
// where a host synchronization would have waited for the kernel. Its results are those of a call with a
// caller's workspace. While the stream is being captured the cache cannot grow: INVALID_ARGUMENT.
TEST(GpuContract, CachedWorkspaceGrowsWithoutBlockingTheHost) {
  const cudaStream_t s = reinterpret_cast<cudaStream_t>(test_stream());
  Tensor src(DT::I32, {1 << 18}), dst(DT::I32, {1 << 18});
  constexpr unsigned long long kSpinNs = 400000000ull;  // 400 ms
  Handle h;
  for (int64_t N : {2048, 8192}) {  // the second call needs more workspace than the first
    SCOPED_TRACE(::testing::Message() << "N = " << N);
    const int64_t V = 1031;
    Tensor x(DT::BF16, {N, V}), tg(DT::I64, {N}), loss(DT::F32, {}), want(DT::F32, {});
    fill_logits(x, 2.0, false);
    for (int64_t i = 0; i < N; ++i) tg.set_int(i, (i * 7) % V);
    tg.upload();
    fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
    out.loss = want.dl();
    size_t need = 0;
    FCE_OK(fce_cross_entropy_fwd_workspace_size(h, x.dl(), tg.dl(), nullptr, &out, &need));
    ASSERT_GT(need, 0u);
    Tensor ws(DT::I32, {int64_t(need / 4 + 1)});
    FCE_OK(fce_cross_entropy_fwd(h, test_stream(), x.dl(), tg.dl(), nullptr, &out, ws.dl()->data, need));
    want.download();
    out.loss = loss.dl();
    ASSERT_EQ(launch_slow_copy(src.dl()->data, dst.dl()->data, src.bytes().size(), kSpinNs, s), cudaSuccess);
    const auto t0 = std::chrono::steady_clock::now();
    FCE_OK(fce_cross_entropy_fwd(h, test_stream(), x.dl(), tg.dl(), nullptr, &out, nullptr, 0));
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady) << "the call waited for the stream";
    EXPECT_LT(ms, 100.0) << "the call blocked the host";
    loss.download();
    EXPECT_EQ(loss.get(0), want.get(0));
  }
  // A fresh handle, capture first: the cache cannot grow inside the capture.
  Handle fresh;
  Tensor x(DT::F32, {300, 257}), tg(DT::I64, {300}), loss(DT::F32, {});
  fill_logits(x, 1.0, false);
  for (int64_t i = 0; i < 300; ++i) tg.set_int(i, i % 257);
  tg.upload();
  fce_ce_outputs_t out = FCE_CE_OUTPUTS_INIT;
  out.loss = loss.dl();
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
  const fce_status_t st = fce_cross_entropy_fwd(fresh, test_stream(), x.dl(), tg.dl(), nullptr, &out, nullptr, 0);
  const std::string msg = fce_last_error_message();
  ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
  cudaGraphDestroy(graph);
  EXPECT_EQ(st, FCE_STATUS_INVALID_ARGUMENT);
  EXPECT_NE(msg.find("captured"), std::string::npos) << msg;
}

// What a CUDA handle takes: kDLCUDA and kDLCUDAManaged (cudaMallocManaged) memory of its ordinal; not
// pinned host memory (kDLCUDAHost, cudaMallocHost: a CPU handle's), nor another ordinal, nor kDLCPU.
TEST(GpuContract, DeviceTypes) {
  const int64_t N = 4, V = 1031;
  Tensor x(DT::F32, {N, V}), lse(DT::F32, {N});
  fill_logits(x, 2.0, false);
  Handle h;
  FCE_OK(fce_logsumexp(h, test_stream(), x.dl(), nullptr, lse.dl(), nullptr, 0));
  lse.download();
  const size_t bytes = size_t(N * V) * 4;
  void *managed = nullptr, *pinned = nullptr, *out_m = nullptr;
  ASSERT_EQ(cudaMallocManaged(&managed, bytes), cudaSuccess);
  ASSERT_EQ(cudaMallocManaged(&out_m, N * 4), cudaSuccess);
  ASSERT_EQ(cudaMallocHost(&pinned, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(managed, x.dl()->data, bytes, cudaMemcpyDeviceToDevice), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(pinned, x.dl()->data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  DLTensor xm = *x.dl(), om = *lse.dl(), xp = *x.dl();
  xm.data = managed;
  xm.device = {kDLCUDAManaged, 0};
  om.data = out_m;
  om.device = {kDLCUDAManaged, 0};
  FCE_OK(fce_logsumexp(h, test_stream(), &xm, nullptr, &om, nullptr, 0));
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int64_t i = 0; i < N; ++i) EXPECT_EQ(static_cast<float*>(out_m)[i], float(lse.get(i))) << "managed, row " << i;
  xp.data = pinned;
  xp.device = {kDLCUDAHost, 0};
  EXPECT_EQ(fce_logsumexp(h, test_stream(), &xp, nullptr, lse.dl(), nullptr, 0), FCE_STATUS_DEVICE_MISMATCH);
  DLTensor other = *x.dl();
  other.device = {kDLCUDA, 1};
  EXPECT_EQ(fce_logsumexp(h, test_stream(), &other, nullptr, lse.dl(), nullptr, 0), FCE_STATUS_DEVICE_MISMATCH);
  DLTensor cpu = xp;
  cpu.device = {kDLCPU, 0};
  EXPECT_EQ(fce_logsumexp(h, test_stream(), &cpu, nullptr, lse.dl(), nullptr, 0), FCE_STATUS_DEVICE_MISMATCH);
  // A CPU handle reads the pinned copy (kDLCUDAHost) and refuses the managed one.
  fce_handle_t ch;
  FCE_OK(fce_handle_create(kDLCPU, 0, &ch));
  std::vector<float> host_out(N);
  DLTensor ho = *lse.dl();
  ho.data = host_out.data();
  ho.device = {kDLCPU, 0};
  FCE_OK(fce_logsumexp(ch, nullptr, &xp, nullptr, &ho, nullptr, 0));
  for (int64_t i = 0; i < N; ++i) EXPECT_NEAR(host_out[size_t(i)], lse.get(i), 2e-5 * (1 + std::fabs(lse.get(i))));
  EXPECT_EQ(fce_logsumexp(ch, nullptr, &xm, nullptr, &ho, nullptr, 0), FCE_STATUS_DEVICE_MISMATCH);
  fce_handle_destroy(ch);
  cudaFree(managed);
  cudaFree(out_m);
  cudaFreeHost(pinned);
}
