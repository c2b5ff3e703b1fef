// The eager fast path of fusedce.torch: the library's calls for torch tensors from C++, with autograd in C++.
//
// A plain shared library against libtorch (no Python headers, so one build serves every Python version of
// the same torch), loaded by torch.ops.load_library. It defines the ops `fusedce_eager::*`, which eager
// calls of fusedce.torch reach through a bound OpOverload (about 1 us from Python). torch.compile never
// sees them: traced calls take the `fusedce::*` custom ops of _torch_ops.py, which keep the fakes.
//
// It calls the libfusedce that Python loaded, through the addresses `_bind` receives, so that both paths
// use one library (FUSEDCE_LIBRARY included). A failed call throws "fusedce-status:<status>:<function>";
// Python turns that into the binding's exception class with the library's message (still in this thread).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#ifdef FCE_TORCH_CUDA  // a CUDA build of torch (meson.build); a CPU-only torch has no CUDA tensors
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#endif
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#include <fusedce/fusedce.h>

#include <map>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;
using torch::autograd::variable_list;

struct Api {
  decltype(&fce_handle_create) handle_create = nullptr;
  decltype(&fce_cross_entropy_fwd) ce_fwd = nullptr;
  decltype(&fce_cross_entropy_fwd_workspace_size) ce_fwd_ws = nullptr;
  decltype(&fce_cross_entropy_bwd) ce_bwd = nullptr;
  decltype(&fce_cross_entropy_bwd_workspace_size) ce_bwd_ws = nullptr;
  decltype(&fce_logsumexp) lse = nullptr;
  decltype(&fce_logsumexp_workspace_size) lse_ws = nullptr;
  decltype(&fce_temp_softmax) softmax = nullptr;
  decltype(&fce_temp_softmax_workspace_size) softmax_ws = nullptr;
  decltype(&fce_scale_rows) scale_rows = nullptr;
};
Api api;

// The addresses in Api's order (Python: fusedce._torch_eager).
void bind(std::vector<int64_t> addresses) {
  TORCH_CHECK(addresses.size() == 10, "fusedce_eager::_bind takes 10 addresses");
  void** slots[] = {reinterpret_cast<void**>(&api.handle_create), reinterpret_cast<void**>(&api.ce_fwd),
                    reinterpret_cast<void**>(&api.ce_fwd_ws),     reinterpret_cast<void**>(&api.ce_bwd),
                    reinterpret_cast<void**>(&api.ce_bwd_ws),     reinterpret_cast<void**>(&api.lse),
                    reinterpret_cast<void**>(&api.lse_ws),        reinterpret_cast<void**>(&api.softmax),
                    reinterpret_cast<void**>(&api.softmax_ws),    reinterpret_cast<void**>(&api.scale_rows)};
  for (size_t k = 0; k < addresses.size(); ++k) *slots[k] = reinterpret_cast<void*>(addresses[k]);
}

[[noreturn]] void fail(fce_status_t status, const char* function) {
  TORCH_CHECK(false, "fusedce-status:", static_cast<int>(status), ":", function);
}

// Where a call runs: the handle of this thread for (device, stream), the stream, the DLPack device.
struct Where {
  fce_handle_t handle;
  fce_stream_t stream;
  DLDevice device;
  bool capturing;
};

Where locate(const Tensor& x) {
  // One handle per thread, device and stream, as the Python path: a handle serves one thread at a time, and
  // its cached workspace never serves two streams at once. They live until the process ends (destroying
  // one synchronizes the device, which a thread's exit must not do behind the user's back).
  thread_local std::map<std::tuple<int, int, void*>, fce_handle_t> handles;
  Where w{};
#ifdef FCE_TORCH_CUDA
  if (x.is_cuda()) {
    const int idx = x.get_device();
    cudaStream_t s = c10::cuda::getCurrentCUDAStream(idx).stream();
    w.stream = reinterpret_cast<fce_stream_t>(s);
    w.device = DLDevice{kDLCUDA, idx};
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    w.capturing = cudaStreamIsCapturing(s, &status) == cudaSuccess && status != cudaStreamCaptureStatusNone;
  } else
#endif
  {
    w.stream = nullptr;
    w.device = DLDevice{kDLCPU, 0};
    w.capturing = false;
  }
  auto key = std::make_tuple(static_cast<int>(w.device.device_type), w.device.device_id,
                             static_cast<void*>(w.stream));
  auto it = handles.find(key);
  if (it == handles.end()) {
    fce_handle_t h = nullptr;
    fce_status_t st = api.handle_create(w.device.device_type, w.device.device_id, &h);
    if (st != FCE_STATUS_SUCCESS) fail(st, "fce_handle_create");
    it = handles.emplace(key, h).first;
  }
  w.handle = it->second;
  return w;
}

// A DLTensor viewing t (its sizes and strides arrays, alive as long as t); the library validates the rest.
DLTensor dl(const Tensor& t) {
  DLTensor d{};
  d.data = t.data_ptr();
  d.device = t.is_cuda() ? DLDevice{kDLCUDA, static_cast<int32_t>(t.get_device())} : DLDevice{kDLCPU, 0};
  d.ndim = static_cast<int32_t>(t.dim());
  switch (t.scalar_type()) {
    case at::kFloat: d.dtype = DLDataType{kDLFloat, 32, 1}; break;
    case at::kBFloat16: d.dtype = DLDataType{kDLBfloat, 16, 1}; break;
    case at::kHalf: d.dtype = DLDataType{kDLFloat, 16, 1}; break;
    case at::kDouble: d.dtype = DLDataType{kDLFloat, 64, 1}; break;
    case at::kLong: d.dtype = DLDataType{kDLInt, 64, 1}; break;
    case at::kInt: d.dtype = DLDataType{kDLInt, 32, 1}; break;
    default: d.dtype = DLDataType{kDLOpaqueHandle, 0, 1}; break;  // the library answers UNSUPPORTED_DTYPE
  }
  d.shape = const_cast<int64_t*>(t.sizes().data());
  d.strides = const_cast<int64_t*>(t.strides().data());
  return d;
}

// Workspace for one call: the handle's cached one (nullptr), or, while the stream is captured into a CUDA
// graph (the cache cannot grow there), one from torch's caching allocator sized by the op's query.
template <class Query>
std::pair<void*, size_t> workspace(const Where& w, const Tensor& like, Tensor& keep, Query query,
                                   const char* name) {
  if (!w.capturing) return {nullptr, 0};
  size_t bytes = 0;
  fce_status_t st = query(&bytes);
  if (st != FCE_STATUS_SUCCESS) fail(st, name);
  if (bytes == 0) return {nullptr, 0};
  keep = at::empty({static_cast<int64_t>(bytes)}, like.options().dtype(at::kByte));
  return {keep.data_ptr(), bytes};
}

struct CeArgs {
  c10::optional<Tensor> weight;
  int64_t reduction, ignore_index;
  double label_smoothing, z_loss_scale, softcap, logit_scale;

  fce_ce_options_t options(DLTensor* weight_dl) const {
    fce_ce_options_t o = FCE_CE_OPTIONS_INIT;
    o.reduction = static_cast<int32_t>(reduction);
    o.ignore_index = ignore_index;
    o.label_smoothing = static_cast<float>(label_smoothing);
    o.z_loss_scale = static_cast<float>(z_loss_scale);
    o.softcap = static_cast<float>(softcap);
    o.logit_scale = static_cast<float>(logit_scale);
    o.class_weights = weight_dl;
    return o;
  }
};

Tensor maybe_empty(bool want, at::IntArrayRef shape, const at::TensorOptions& options) {
  return want ? at::empty(shape, options) : Tensor();
}

// The lse output of a forward: none, the [N] lse, or its pairs [N, 2] (m, l) = (max z, log sum exp(z - m)),
// lse = m + l (fce_ce_outputs_t.lse), from which the backward forms every p_j = exp((z_j - m) - l) exactly at
// any offset of the logits.
enum class LseForm { none, value, pair };

// fce_cross_entropy_fwd: {loss, lse, z_loss, argmax, entropy} (undefined where not asked for); dlogits and
// grad_loss optional.
std::vector<Tensor> ce_forward(const Tensor& logits, const Tensor& targets, const CeArgs& a, LseForm lse_form,
                               bool want_z_loss, bool want_argmax, bool want_entropy, const Tensor& dlogits) {
  const Where w = locate(logits);
  const int64_t n = logits.dim() > 0 ? logits.size(0) : 0;
  const auto f32 = logits.options().dtype(at::kFloat);
  std::vector<int64_t> loss_shape;
  if (a.reduction == FCE_REDUCTION_NONE) loss_shape.push_back(n);
  Tensor lse;
  if (lse_form == LseForm::value) lse = at::empty({n}, f32);
  if (lse_form == LseForm::pair) lse = at::empty({n, 2}, f32);
  std::vector<Tensor> out = {at::empty(loss_shape, f32), lse,
                             maybe_empty(want_z_loss, loss_shape, f32),
                             maybe_empty(want_argmax, {n}, logits.options().dtype(at::kLong)),
                             maybe_empty(want_entropy, {n}, f32)};
  DLTensor x = dl(logits), t = dl(targets), dl_out[6], wt;
  DLTensor* p[6] = {};
  for (int k = 0; k < 5; ++k)
    if (out[k].defined()) {
      dl_out[k] = dl(out[k]);
      p[k] = &dl_out[k];
    }
  if (dlogits.defined()) {
    dl_out[5] = dl(dlogits);
    p[5] = &dl_out[5];
  }
  if (a.weight) wt = dl(*a.weight);
  const fce_ce_options_t o = a.options(a.weight ? &wt : nullptr);
  fce_ce_outputs_t outs = FCE_CE_OUTPUTS_INIT;
  outs.loss = p[0];
  outs.lse = p[1];
  outs.z_loss = p[2];
  outs.argmax = p[3];
  outs.entropy = p[4];
  outs.dlogits = p[5];
  Tensor keep;
  auto ws = workspace(w, logits, keep, [&](size_t* b) { return api.ce_fwd_ws(w.handle, &x, &t, &o, &outs, b); },
                      "fce_cross_entropy_fwd_workspace_size");
  fce_status_t st = api.ce_fwd(w.handle, w.stream, &x, &t, &o, &outs, ws.first, ws.second);
  if (st != FCE_STATUS_SUCCESS) fail(st, "fce_cross_entropy_fwd");
  return out;
}

// An upstream gradient as fce_cross_entropy_bwd / fce_scale_rows read it: fp32, contiguous; a stride-0 [N]
// (from .sum() or .mean() of a per-row loss) as the [1] scalar the library broadcasts.
Tensor upstream(Tensor g) {
  if (g.dim() == 1 && g.numel() > 1 && g.stride(0) == 0) g = g.narrow(0, 0, 1);
  return g.to(at::kFloat).contiguous();
}

void scale_rows(const Tensor& d, const Tensor& factor) {
  const Where w = locate(d);
  Tensor rows = d.dim() == 2 ? d : d.reshape({1, -1});
  Tensor f = factor.reshape({-1});
  DLTensor x = dl(rows), fd = dl(f);
  fce_status_t st = api.scale_rows(w.handle, w.stream, &x, &fd);
  if (st != FCE_STATUS_SUCCESS) fail(st, "fce_scale_rows");
}

// fce_cross_entropy_bwd from the forward's lse ([N] or its pairs [N, 2]).
Tensor ce_backward(const Tensor& logits, const Tensor& targets, const Tensor& lse, const Tensor& grad_loss,
                   const CeArgs& a) {
  const Where w = locate(logits);
  Tensor d = at::empty_like(logits);
  DLTensor x = dl(logits), t = dl(targets), l = dl(lse),
           g = dl(grad_loss), dd = dl(d), wt;
  if (a.weight) wt = dl(*a.weight);
  const fce_ce_options_t o = a.options(a.weight ? &wt : nullptr);
  Tensor keep;
  auto ws = workspace(
      w, logits, keep, [&](size_t* b) { return api.ce_bwd_ws(w.handle, &x, &t, &l, &g, &o, &dd, b); },
      "fce_cross_entropy_bwd_workspace_size");
  fce_status_t st = api.ce_bwd(w.handle, w.stream, &x, &t, &l, &g, &o, &dd, ws.first, ws.second);
  if (st != FCE_STATUS_SUCCESS) fail(st, "fce_cross_entropy_bwd");
  return d;
}

// The autograd node of fusedce_eager::cross_entropy, made by hand (as PyTorch's generated nodes are) rather
// than through autograd::Function, whose bookkeeping (saved_data map, output wrapping) costs microseconds
// per call. Its inputs are the gradients of the float outputs (loss, then lse, z_loss, entropy where asked
// for); only the loss's is used: lse, z_loss (a part of the loss, reported alone) and entropy are reported,
// not differentiated, as in the Python path.
//  - default mode: the logits are kept; the backward reads them again with the forward's lse, kept as its
//    pairs [N, 2] (exact probabilities at any offset of the logits; an [N] lse's fp32 rounding would enter
//    every p_j: 6e-3 relative at 1e5);
//  - in-place mode: the forward wrote the gradient (for an upstream gradient of 1) over the logits; the
//    backward hands that memory on, scaled on the device where the upstream gradient is not 1. It is held
//    here, not saved, so that autograd holds its only reference when it is handed on (AccumulateGrad then
//    adopts it as a leaf's .grad instead of copying it).
struct CrossEntropyBackward : torch::autograd::Node {
  CeArgs args;
  bool inplace = false;
  torch::autograd::SavedVariable logits, targets, weight, lse;
  Tensor held;

  variable_list apply(variable_list&& grads) override {
    variable_list r(1);
    if (inplace) {
      Tensor d = std::move(held);
      if (!grads[0].defined() || !should_compute_output(0)) return r;
      TORCH_CHECK(d.defined(), "fusedce: the in-place cross-entropy's gradient was already handed on "
                  "(a second backward through the same graph)");
      scale_rows(d, upstream(grads[0]));  // nothing moves for the usual upstream gradient of 1
      r[0] = std::move(d);
      return r;
    }
    if (!grads[0].defined() || !should_compute_output(0)) return r;
    CeArgs a = args;
    Tensor w = weight.unpack();
    if (w.defined()) a.weight = w;
    r[0] = ce_backward(logits.unpack(), targets.unpack(), lse.unpack(), upstream(grads[0]), a);
    return r;
  }

  std::string name() const override { return inplace ? "CrossEntropyInplaceBackward" : "CrossEntropyBackward"; }

  void release_variables() override {
    logits.reset_data();
    targets.reset_data();
    weight.reset_data();
    lse.reset_data();
  }
};

// fusedce_eager::cross_entropy: through autograd when the logits need a gradient, the forward alone otherwise.
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> cross_entropy(
    const Tensor& logits, const Tensor& targets, const c10::optional<Tensor>& weight, int64_t reduction,
    int64_t ignore_index, double label_smoothing, double z_loss_scale, double softcap, double logit_scale,
    bool want_lse, bool want_z_loss, bool want_argmax, bool want_entropy, bool inplace) {
  const CeArgs a{weight, reduction, ignore_index, label_smoothing, z_loss_scale, softcap, logit_scale};
  if (!c10::GradMode::is_enabled() || !logits.requires_grad()) {
    std::vector<Tensor> out = ce_forward(logits, targets, a, want_lse ? LseForm::value : LseForm::none, want_z_loss,
                                         want_argmax, want_entropy, Tensor());
    return {out[0], out[1], out[2], out[3], out[4]};
  }
  // The default mode always forms the lse's pairs (its backward's); the in-place mode's backward reads none.
  const LseForm form = !inplace ? LseForm::pair : want_lse ? LseForm::value : LseForm::none;
  std::vector<Tensor> out = ce_forward(logits, targets, a, form, want_z_loss, want_argmax, want_entropy,
                                       inplace ? logits : Tensor());
  auto node = std::shared_ptr<CrossEntropyBackward>(new CrossEntropyBackward(), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(logits));
  node->args = a;
  node->args.weight = c10::nullopt;
  node->inplace = inplace;
  if (inplace) {
    node->held = logits.detach();
  } else {
    node->logits = torch::autograd::SavedVariable(logits, false);
    node->targets = torch::autograd::SavedVariable(targets, false);
    if (weight) node->weight = torch::autograd::SavedVariable(*weight, false);
    node->lse = torch::autograd::SavedVariable(out[1], false);
    // The caller's [N] lse: m + l in fp32 (the CUDA backend's [N] lse bit for bit; the CPU's rounds m + log s
    // once in float64, within 1 ulp of this). The backward keeps the pairs.
    out[1] = want_lse ? out[1].select(1, 0) + out[1].select(1, 1) : Tensor();
  }
  for (int k : {0, 1, 2, 4})
    if (out[k].defined()) torch::autograd::set_history(out[k], node);
  return {out[0], out[1], out[2], out[3], out[4]};
}

// fusedce_eager::cross_entropy_loss: the loss alone, no class weights, softcap, or extra output (the common
// call: fewer arguments to convert from Python, one result).
Tensor cross_entropy_loss(const Tensor& logits, const Tensor& targets, int64_t reduction, int64_t ignore_index,
                          double label_smoothing, double z_loss_scale, double logit_scale, bool inplace) {
  return std::get<0>(cross_entropy(logits, targets, c10::nullopt, reduction, ignore_index, label_smoothing,
                                   z_loss_scale, 0.0, logit_scale, false, false, false, false, inplace));
}

void logsumexp_into(const Tensor& x, double scale, const Tensor& out) {
  const Where w = locate(x);
  DLTensor xd = dl(x), od = dl(out);
  fce_lse_options_t o = FCE_LSE_OPTIONS_INIT;
  o.scale = static_cast<float>(scale);
  Tensor keep;
  auto ws = workspace(w, x, keep, [&](size_t* b) { return api.lse_ws(w.handle, &xd, &o, &od, b); },
                      "fce_logsumexp_workspace_size");
  fce_status_t st = api.lse(w.handle, w.stream, &xd, &o, &od, ws.first, ws.second);
  if (st != FCE_STATUS_SUCCESS) fail(st, "fce_logsumexp");
}

// fusedce_eager::logsumexp (no gradient: a differentiable call takes the Python path).
Tensor logsumexp(const Tensor& x, double scale) {
  Tensor out = at::empty({x.dim() > 0 ? x.size(0) : 0}, x.options().dtype(at::kFloat));
  logsumexp_into(x, scale, out);
  return out;
}

// fusedce_eager::logsumexp_out: into the caller's [N] fp32 (the array API's out=).
void logsumexp_out(const Tensor& x, double scale, const Tensor& out) { logsumexp_into(x, scale, out); }

void temp_softmax_into(const Tensor& logits, double temperature, const c10::optional<Tensor>& temperatures,
                       const Tensor& p, const Tensor& lp) {
  const Where w = locate(logits);
  DLTensor x = dl(logits), pd, lpd, td;
  if (p.defined()) pd = dl(p);
  if (lp.defined()) lpd = dl(lp);
  fce_softmax_options_t o = FCE_SOFTMAX_OPTIONS_INIT;
  o.temperature = static_cast<float>(temperature);
  if (temperatures) {
    td = dl(*temperatures);
    o.temperatures = &td;
  }
  DLTensor* pp = p.defined() ? &pd : nullptr;
  DLTensor* lpp = lp.defined() ? &lpd : nullptr;
  Tensor keep;
  auto ws = workspace(w, logits, keep, [&](size_t* b) { return api.softmax_ws(w.handle, &x, &o, pp, lpp, b); },
                      "fce_temp_softmax_workspace_size");
  fce_status_t st = api.softmax(w.handle, w.stream, &x, &o, pp, lpp, ws.first, ws.second);
  if (st != FCE_STATUS_SUCCESS) fail(st, "fce_temp_softmax");
}

// fusedce_eager::temp_softmax (no gradient): (probs, logprobs), undefined where not asked for; fp32 outputs
// or the logits' dtype.
std::tuple<Tensor, Tensor> temp_softmax(const Tensor& logits, double temperature,
                                        const c10::optional<Tensor>& temperatures, bool want_probs,
                                        bool want_logprobs, bool fp32) {
  const auto opts = fp32 ? logits.options().dtype(at::kFloat) : logits.options();
  Tensor p = maybe_empty(want_probs, logits.sizes(), opts), lp = maybe_empty(want_logprobs, logits.sizes(), opts);
  temp_softmax_into(logits, temperature, temperatures, p, lp);
  return {p, lp};
}

// fusedce_eager::temp_softmax_out: into the caller's probs and/or logprobs (the array API's).
void temp_softmax_out(const Tensor& logits, double temperature, const c10::optional<Tensor>& temperatures,
                      const c10::optional<Tensor>& probs, const c10::optional<Tensor>& logprobs) {
  temp_softmax_into(logits, temperature, temperatures, probs ? *probs : Tensor(), logprobs ? *logprobs : Tensor());
}

}  // namespace

TORCH_LIBRARY(fusedce_eager, m) {
  m.def("_bind(int[] addresses) -> ()", &bind);
  m.def("cross_entropy(Tensor logits, Tensor targets, Tensor? weight, int reduction, int ignore_index, "
        "float label_smoothing, float z_loss_scale, float softcap, float logit_scale, bool want_lse, "
        "bool want_z_loss, bool want_argmax, bool want_entropy, bool inplace) -> "
        "(Tensor, Tensor, Tensor, Tensor, Tensor)",
        &cross_entropy);
  m.def("cross_entropy_loss(Tensor logits, Tensor targets, int reduction, int ignore_index, float label_smoothing, "
        "float z_loss_scale, float logit_scale, bool inplace) -> Tensor",
        &cross_entropy_loss);
  m.def("logsumexp(Tensor x, float scale) -> Tensor", &logsumexp);
  m.def("logsumexp_out(Tensor x, float scale, Tensor(a!) out) -> ()", &logsumexp_out);
  m.def("temp_softmax(Tensor logits, float temperature, Tensor? temperatures, bool want_probs, "
        "bool want_logprobs, bool fp32) -> (Tensor, Tensor)",
        &temp_softmax);
  m.def("temp_softmax_out(Tensor logits, float temperature, Tensor? temperatures, Tensor(a!)? probs, "
        "Tensor(b!)? logprobs) -> ()",
        &temp_softmax_out);
}
