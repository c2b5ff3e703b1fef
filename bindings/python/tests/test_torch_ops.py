"""fusedce.torch as PyTorch users meet it: the custom ops (torch.library.opcheck), torch.compile(fullgraph=True)
of training steps against eager, the drop-in arguments of PyTorch, Liger-Kernel and Cut Cross-Entropy
against references written here with torch, the in-place backward, the upstream gradient applied after a
fused forward, forward-only linear cross-entropy without gradients, and CUDA-graph capture.

CPU tensors always (torch is required: the suite fails without it); CUDA tensors too when torch sees a GPU
and the library's CUDA backend works.
"""
import pytest
import torch

import fusedce
import fusedce.torch as ft
from fusedce import _torch_ops

F = torch.nn.functional


def _cuda_ok():
    if not torch.cuda.is_available():
        return False
    try:
        fusedce.logsumexp(torch.zeros(1, 4, device="cuda"))
        torch.cuda.synchronize()
        return True
    except fusedce.FusedCEError:
        return False


CUDA = _cuda_ok()
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device for torch and libfusedce")


def _close(a, b, rtol=2e-5, atol=2e-6):
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


# ---- the custom ops themselves ---------------------------------------------------------------------

def _op_samples(device):
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(device).requires_grad_(grad)

    x = randn(6, 33, grad=True)
    t = torch.randint(0, 33, (6,), generator=g).to(device)
    t[1] = -100
    none, mean = fusedce.ops._REDUCTIONS["none"], fusedce.ops._REDUCTIONS["mean"]
    h, w, b = randn(6, 8, grad=True), randn(33, 8, grad=True), randn(33, grad=True)
    ce_opts = (-100, 0.1, 1e-4, 0.0, 1.0)
    return [
        ("cross_entropy", (x, t, None, mean, *ce_opts, True, True, True)),
        ("cross_entropy", (x, t, None, none, *ce_opts, False, False, False)),
        ("cross_entropy_fused", (x, t, None, mean, *ce_opts, False, True, False)),
        ("logsumexp", (x, 0.5)),
        ("temp_softmax", (x, 0.7, None, True, True, 0)),
        ("kd_loss", (x, randn(6, 33), None, None, t, 2, 0.5, 2.0, True, 0, mean, -100, True)),
        ("linear_cross_entropy", (h, w, b, t, None, mean, *ce_opts, True, True, True, True, True, True)),
        ("linear_cross_entropy", (h, w, b, t, None, none, *ce_opts, False, False, False, False, False, False)),
        ("logprobs_entropy", (x, t, 1.25, -100)),
        ("logprobs_entropy_bwd", (x.detach(), t, torch.randn(6).to(device), torch.rand(6).to(device), randn(6), randn(6), 1.25,
                                  -100)),
        ("linear_logprobs_entropy", (h, w, t, 0.8, -100)),
    ]


# Ops whose backward scales their own gradient output in place (fce_scale_rows: no pass for an upstream
# gradient of 1): that output is the gradient's buffer, not a result for the caller. opcheck's AOT test
# returns every output to the caller and so flags the in-place scaling; torch.compile of the public
# functions, which never return that output, is tested below against eager.
_GRADIENT_BUFFER_OPS = {"cross_entropy_fused", "kd_loss", "linear_cross_entropy"}


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch of every op."""
    for name, args in _op_samples(device):
        utils = ("test_schema", "test_autograd_registration", "test_faketensor") + (
            () if name in _GRADIENT_BUFFER_OPS and any(a is True for a in args[-6:]) else ("test_aot_dispatch_dynamic",))
        torch.library.opcheck(getattr(torch.ops.fusedce, name).default, args, test_utils=utils)
    x = torch.randn(4, 9, device=device)
    torch.library.opcheck(torch.ops.fusedce.scale_rows_.default, (x, torch.tensor([1.0, 2.0, 0.5, 1.0], device=device)))


@pytest.mark.parametrize("device", DEVICES)
def test_ops_are_differentiable_through_torch_ops(device):
    """torch.ops.fusedce.* alone (the registered autograd) against torch's own math."""
    x = torch.randn(5, 19, device=device, requires_grad=True)
    t = torch.randint(0, 19, (5,), device=device)
    mean = fusedce.ops._REDUCTIONS["mean"]
    loss = torch.ops.fusedce.cross_entropy(x, t, None, mean, -100, 0.0, 0.0, 0.0, 1.0, False, False, False)[0]
    (g,) = torch.autograd.grad(loss * 2, x)
    (r,) = torch.autograd.grad(F.cross_entropy(x, t) * 2, x)
    _close(g, r)
    lse = torch.ops.fusedce.logsumexp(x, 1.0)
    (g,) = torch.autograd.grad(lse.sum(), x)
    _close(g, torch.softmax(x, -1).detach())


# ---- torch.compile --------------------------------------------------------------------------------

def _steps(lin):
    def ce_default(h, t):
        return ft.cross_entropy(lin(h), t, label_smoothing=0.1, lse_square_scale=1e-4)

    def ce_inplace(h, t):
        return ft.cross_entropy(lin(h), t, label_smoothing=0.1, inplace_backward=True)

    def linear_mean(h, t):
        return ft.linear_cross_entropy(h, lin.weight, t, bias=lin.bias, softcap=30.0)

    def linear_none(h, t):
        return ft.linear_cross_entropy(h, lin.weight, t, bias=lin.bias, reduction="none").sum() * 0.5

    def kd_and_sampling(h, t):
        s = lin(h)
        return (ft.kd_loss(s, s.detach() * 0.5 + 0.1, temperature=2.0, divergence="jsd") + ft.logsumexp(s).sum() * 0.1
                + (ft.softmax(s, 0.7) * torch.arange(s.shape[1], device=s.device)).sum() * 0.01
                + ft.log_softmax(s, 0.7)[:, :3].sum() * 0.01)

    def ppo_with_entropy_bonus(h, t):
        adv = torch.linspace(-1, 1, h.shape[0], device=h.device)
        lp, ent = ft.logprobs_entropy(lin(h), t, temperature=0.7)
        llp, lent = ft.linear_logprobs_entropy(h, lin.weight, t, temperature=1.3)
        return -(adv * (lp + llp)).mean() - 0.01 * (ent.mean() + lent.mean())

    return [ce_default, ce_inplace, linear_mean, linear_none, kd_and_sampling, ppo_with_entropy_bonus]


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_training_steps_match_eager(device):
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 37).to(device)
    h = torch.randn(10, 16, device=device)
    t = torch.randint(0, 37, (10,), device=device)
    t[3] = -100
    for step in _steps(lin):
        lin.zero_grad()
        want = step(h, t)
        want.backward()
        gw = lin.weight.grad.clone()
        lin.zero_grad()
        got = torch.compile(step, fullgraph=True)(h, t)
        got.backward()
        _close(got.detach(), want.detach(), rtol=1e-5, atol=1e-6)
        _close(lin.weight.grad, gw, rtol=1e-5, atol=1e-6)


# ---- drop-in arguments ----------------------------------------------------------------------------

def _ref_ce(x, t, ignore_index=-100, label_smoothing=0.0, zq=0.0, cap=None, reduction="mean"):
    z = x.double()
    if cap is not None:
        z = cap * torch.tanh(z / cap)
    lse = torch.logsumexp(z, -1)
    per = F.cross_entropy(z, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    valid = (t != ignore_index).double()
    zl = zq * lse ** 2 * valid
    per = per + zl
    n = valid.sum().clamp_min(1)
    red = {"mean": lambda v: v.sum() / n, "sum": torch.sum, "none": lambda v: v}[reduction]
    return red(per), red(zl), lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_liger_arguments(device, dtype):
    torch.manual_seed(1)
    x = (torch.randn(12, 41, device=device) * 3).to(dtype).requires_grad_()
    t = torch.randint(0, 41, (12,), device=device)
    t[::5] = -100
    for red in ("mean", "sum", "none"):
        out = ft.cross_entropy(x, t, reduction=red, label_smoothing=0.05, lse_square_scale=1e-3, softcap=20.0,
                               return_z_loss=True, return_lse=True, return_entropy=True, return_token_accuracy=True,
                               return_predicted_tokens=True)
        loss, zl, lse = _ref_ce(x.detach(), t, label_smoothing=0.05, zq=1e-3, cap=20.0, reduction=red)
        tol = dict(rtol=2e-5, atol=2e-5)
        _close(out.loss, loss.float(), **tol)
        _close(out.z_loss, zl.float(), **tol)
        _close(out.lse, lse.float(), **tol)
        z = 20.0 * torch.tanh(x.detach().double() / 20.0)
        p = torch.softmax(z, -1)
        _close(out.entropy, -(p * torch.log_softmax(z, -1)).sum(-1).float(), rtol=1e-4, atol=1e-4)
        am = x.detach().float().argmax(-1)
        assert torch.equal(out.predicted_tokens, am)
        valid = t != -100
        _close(out.token_accuracy, ((am == t) & valid).sum().float() / valid.sum())
    # softcap=None is no cap; the loss alone without return_* flags; z_loss_scale is the same knob
    plain = ft.cross_entropy(x, t, softcap=None)
    assert torch.is_tensor(plain) and plain.dim() == 0
    _close(ft.cross_entropy(x, t, z_loss_scale=1e-3), ft.cross_entropy(x, t, lse_square_scale=1e-3))
    with pytest.raises(ValueError):
        ft.cross_entropy(x, t, z_loss_scale=1e-3, lse_square_scale=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_pytorch_arguments_and_module(device):
    x = torch.randn(3, 7, 5, device=device, requires_grad=True)  # (N, C, d1)
    t = torch.randint(0, 7, (3, 5), device=device)
    w = torch.rand(7, device=device) + 0.5
    for red in ("mean", "sum", "none"):
        got = ft.CrossEntropyLoss(weight=w, ignore_index=2, reduction=red, label_smoothing=0.1)(x, t)
        want = F.cross_entropy(x, t, weight=w, ignore_index=2, reduction=red, label_smoothing=0.1)
        _close(got, want, rtol=1e-5, atol=1e-6)
        g1, = torch.autograd.grad(got.sum(), x)
        g2, = torch.autograd.grad(want.sum(), x)
        _close(g1, g2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_cut_cross_entropy_arguments(device):
    """linear_cross_entropy(e, c, targets, shift=..., ignore_index=..., softcap=...) on [B, T, H]."""
    torch.manual_seed(2)
    e = torch.randn(2, 9, 16, device=device, requires_grad=True)
    c = (torch.randn(29, 16, device=device) * 0.3).requires_grad_()
    targets = torch.randint(0, 29, (2, 9), device=device)
    targets[0, 4] = -100
    for shift, cap in ((True, None), (2, 15.0), (False, None)):
        got = ft.linear_cross_entropy(e, c, targets, shift=shift, softcap=cap)
        s = int(shift)
        logits = e[:, : e.shape[1] - s] @ c.T if s else e @ c.T
        if cap is not None:
            logits = cap * torch.tanh(logits / cap)
        want = F.cross_entropy(logits.reshape(-1, 29), targets[:, s:].reshape(-1))
        _close(got, want, rtol=1e-5, atol=1e-6)
        g1 = torch.autograd.grad(got, (e, c))
        g2 = torch.autograd.grad(want, (e, c))
        for a, b in zip(g1, g2):
            _close(a, b, rtol=1e-5, atol=1e-6)
    loss = ft.LinearCrossEntropyLoss(reduction="none")(c, e, targets)
    assert loss.shape == targets.shape


# ---- gradient modes -------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_inplace_backward(device):
    torch.manual_seed(3)
    h = torch.randn(16, 8, device=device, requires_grad=True)
    w = torch.randn(301, 8, device=device, requires_grad=True)
    t = torch.randint(0, 301, (16,), device=device)
    logits = h @ w.T
    ptr = logits.data_ptr()
    loss = ft.cross_entropy(logits, t, inplace_backward=True)
    assert logits.data_ptr() == ptr
    (loss * 0.25).backward()
    h2, w2 = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    (F.cross_entropy(h2 @ w2.T, t) * 0.25).backward()
    _close(h.grad, h2.grad)
    _close(w.grad, w2.grad)
    _close(loss, F.cross_entropy(h2.detach() @ w2.detach().T, t))


@pytest.mark.parametrize("device", DEVICES)
def test_fused_gradients_become_grad_without_a_copy(device, monkeypatch):
    """A gradient formed in the forward (kd_loss, reduced linear_cross_entropy, the in-place cross-entropy)
    becomes the leaf's .grad as it is: the very buffer the library wrote, no copy (a copy costs one more
    [N, V] of memory and a pass over it)."""
    torch.manual_seed(5)
    written = {}

    def spy(name, *keys):
        real = getattr(_torch_ops._fast, name) if name != "linear_cross_entropy_fwd" else fusedce.ops.linear_cross_entropy_fwd

        def wrapped(*a, **k):
            out = real(*a, **k)
            for key in keys:
                t = out[key] if isinstance(key, int) else getattr(out, key)
                if t is not None:
                    written[key] = t.data_ptr()
            return out
        return wrapped

    monkeypatch.setattr(_torch_ops._fast, "kd_loss", spy("kd_loss", 1))
    s = torch.randn(5, 37, device=device, requires_grad=True)
    ft.kd_loss(s, torch.randn(5, 37, device=device)).backward()
    assert s.grad.data_ptr() == written[1]

    monkeypatch.setattr(_torch_ops.ops, "linear_cross_entropy_fwd",
                        spy("linear_cross_entropy_fwd", "dhidden", "dweight"))
    h = torch.randn(5, 8, device=device, requires_grad=True)
    w = torch.randn(37, 8, device=device, requires_grad=True)
    t = torch.randint(0, 37, (5,), device=device)
    ft.linear_cross_entropy(h, w, t).backward()
    assert h.grad.data_ptr() == written["dhidden"] and w.grad.data_ptr() == written["dweight"]

    x = torch.randn(5, 37, device=device, requires_grad=True)
    ptr = x.data_ptr()
    ft.cross_entropy(x, t, inplace_backward=True).backward()
    assert x.grad.data_ptr() == ptr  # the logits' own memory


@needs_cuda
def test_inplace_backward_allocates_no_gradient_buffer():
    n, v = 512, 32000
    h = torch.randn(n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(v, 64, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, v, (n,), device="cuda")
    for leaf in (False, True):
        x = (h @ w.T) if not leaf else torch.randn(n, v, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        ft.cross_entropy(x, t, inplace_backward=True).backward()
        torch.cuda.synchronize()
        extra = torch.cuda.max_memory_allocated() - base
        # dhidden ([n, 64]) and small per-row outputs only; a gradient buffer would be n * v * 2 bytes.
        assert extra < n * v * 2 // 8, "in-place backward allocated %d bytes (logits: %d)" % (extra, n * v * 2)
        del x


@pytest.mark.parametrize("device", DEVICES)
def test_upstream_gradient_after_fused_forward(device):
    """kd_loss and the reduced linear_cross_entropy form their gradient in the forward; the backward applies
    the upstream gradient (3, or per row)."""
    torch.manual_seed(4)
    s = torch.randn(6, 23, device=device, requires_grad=True)
    te = torch.randn(6, 23, device=device)
    g1, = torch.autograd.grad(ft.kd_loss(s, te, temperature=1.5) * 3.0, s)
    lq, lp = F.log_softmax(s / 1.5, -1), F.log_softmax(te / 1.5, -1)
    g2, = torch.autograd.grad(F.kl_div(lq, lp, log_target=True, reduction="batchmean") * 3.0, s)
    _close(g1, g2, rtol=1e-5, atol=1e-6)
    rows = ft.kd_loss(s, te, reduction="none")
    wts = torch.arange(6.0, device=device)
    g1, = torch.autograd.grad((rows * wts).sum(), s)
    g2, = torch.autograd.grad((F.kl_div(F.log_softmax(s, -1), F.log_softmax(te, -1), log_target=True,
                                        reduction="none").sum(-1) * wts).sum(), s)
    _close(g1, g2, rtol=1e-5, atol=1e-6)
    h = torch.randn(7, 8, device=device, requires_grad=True)
    w = torch.randn(19, 8, device=device, requires_grad=True)
    t = torch.randint(0, 19, (7,), device=device)
    a = torch.autograd.grad(ft.linear_cross_entropy(h, w, t, reduction="sum") * -2.0, (h, w))
    b = torch.autograd.grad(F.cross_entropy(h @ w.T, t, reduction="sum") * -2.0, (h, w))
    for x, y in zip(a, b):
        _close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_forward_only_without_gradients(device, monkeypatch):
    asked = []
    real = fusedce.ops.linear_cross_entropy_fwd

    def spy(*a, **kw):
        asked.append((kw.get("dhidden"), kw.get("dweight"), kw.get("dbias")))
        return real(*a, **kw)

    monkeypatch.setattr(fusedce.ops, "linear_cross_entropy_fwd", spy)
    h = torch.randn(5, 8, device=device, requires_grad=True)
    w = torch.randn(13, 8, device=device, requires_grad=True)
    t = torch.randint(0, 13, (5,), device=device)
    with torch.no_grad():
        ft.linear_cross_entropy(h, w, t)
    ft.linear_cross_entropy(h.detach(), w.detach(), t)
    ft.linear_cross_entropy(h, w, t)
    assert asked == [(False, False, False), (False, False, False), (True, True, False)]


# ---- CUDA graphs ----------------------------------------------------------------------------------

@needs_cuda
def test_cuda_graph_capture_of_forward_and_backward():
    torch.manual_seed(5)
    x = torch.randn(64, 1031, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 1031, (64,), device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside the capture (handles, plans)
        for _ in range(2):
            x.grad = None
            ft.cross_entropy(x, t, label_smoothing=0.1).backward()
            ft.softmax(x.detach(), 0.8)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(g):
        loss = ft.cross_entropy(x, t, label_smoothing=0.1)
        loss.backward()
        probs = ft.softmax(x.detach(), 0.8)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    x2 = x.detach().clone().requires_grad_()
    want = F.cross_entropy(x2.float(), t, label_smoothing=0.1)
    want.backward()
    _close(loss, want, rtol=1e-4, atol=1e-5)
    _close(x.grad, x2.grad, rtol=2e-2, atol=1e-4)
    _close(probs, torch.softmax(x.detach().float() / 0.8, -1), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_through_a_reported_output_only(device):
    """lse and z_loss are reported, not differentiated: a backward through them alone gives the logits no
    gradient (and no zeros materialized for the unused loss)."""
    x = torch.randn(4, 11, device=device, requires_grad=True)
    t = torch.randint(0, 11, (4,), device=device)
    out = ft.cross_entropy(x, t, return_z_loss=True, lse_square_scale=1e-4)
    out.z_loss.backward()
    assert x.grad is None
    h = torch.randn(4, 6, device=device, requires_grad=True)
    w = torch.randn(11, 6, device=device, requires_grad=True)
    out = ft.linear_cross_entropy(h, w, t, return_lse=True)
    out.lse.sum().backward()
    assert h.grad is None and w.grad is None


# ---- the eager fast path (libfusedce_torch.so) ----------------------------------------------------

def test_eager_fast_path_is_the_one_expected():
    """The build's tests set FUSEDCE_EXPECT_TORCH_EAGER: 1 where libfusedce_torch.so was built (its calls
    must then be the ones running), 0 where the suite runs on the cffi path."""
    import os

    from fusedce import _eager
    want = os.environ.get("FUSEDCE_EXPECT_TORCH_EAGER")
    if want is None:
        pytest.skip("FUSEDCE_EXPECT_TORCH_EAGER not set (outside the build's tests)")
    assert _eager.available == (want == "1"), _eager.why
    x = torch.randn(3, 7, requires_grad=True)
    loss = ft.cross_entropy(x, torch.tensor([0, 6, 2]))
    # a C++ autograd node on the fast path, the Python autograd.Function otherwise
    assert (loss.grad_fn.name() == "CrossEntropyBackward") == (want == "1"), loss.grad_fn.name()


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_raises_the_bindings_exceptions(device):
    """A call the library refuses raises the binding's exception class with the library's message, on
    either path, records no autograd node and writes nothing (the in-place logits keep their values)."""
    x = torch.randn(4, 9, device=device, requires_grad=True)
    with pytest.raises(fusedce.ShapeMismatchError, match="fce_cross_entropy_fwd"):
        ft.cross_entropy(x, torch.zeros(5, dtype=torch.int64, device=device))
    y = x.detach().clone().requires_grad_()
    before = y.detach().clone()
    with pytest.raises(fusedce.InvalidArgumentError, match="label_smoothing"):
        ft.cross_entropy(y, torch.zeros(4, dtype=torch.int64, device=device), label_smoothing=2.0,
                         inplace_backward=True)
    assert torch.equal(y.detach(), before) and y.grad is None
    with pytest.raises(fusedce.InvalidArgumentError, match="scale"):
        ft.logsumexp(x.detach(), scale=-1.0)
    with pytest.raises(fusedce.InvalidArgumentError, match="temperature"):
        ft.softmax(x.detach(), -0.5)
    with pytest.raises(fusedce.UnsupportedDtypeError):
        ft.logsumexp(x.detach().double())


def test_arguments_of_other_python_types():
    """numpy scalars, ints for floats and the like reach the library as the values they stand for."""
    import numpy as np
    x = torch.randn(5, 12)
    t = torch.randint(0, 12, (5,))
    t[2] = -1
    want = F.cross_entropy(x, t, ignore_index=-1, label_smoothing=0.25)
    for kw in (dict(ignore_index=np.int64(-1), label_smoothing=np.float32(0.25)),
               dict(ignore_index=-1, label_smoothing=0.25, inplace_backward=np.bool_(False)),
               dict(ignore_index=-1, label_smoothing=1 / 4)):
        _close(ft.cross_entropy(x, t, **kw), want)
    _close(ft.cross_entropy(x, t, ignore_index=-1, label_smoothing=0, lse_square_scale=np.float64(0.0)),
           F.cross_entropy(x, t, ignore_index=-1))


@pytest.mark.parametrize("device", DEVICES)
def test_array_api_with_torch_tensors(device):
    """The array API's torch path (libfusedce_torch's ops where loaded, cffi otherwise): outputs it allocates
    and the caller's (out=, probs=), against torch in float64; outputs poisoned before the call."""
    torch.manual_seed(11)
    x = (torch.randn(7, 131, device=device) * 4).to(torch.bfloat16)
    t = torch.randint(0, 131, (7,), device=device)
    t[3] = -100
    xd = x.double()
    lse = torch.logsumexp(xd * 0.5, -1)
    _close(fusedce.logsumexp(x, scale=0.5), lse, rtol=1e-6, atol=1e-6)
    out = torch.full((7,), float("nan"), device=device)
    assert fusedce.logsumexp(x, scale=0.5, out=out) is out
    _close(out, lse, rtol=1e-6, atol=1e-6)
    temps = torch.linspace(0.5, 2.0, 7, device=device)
    probs = torch.full((7, 131), float("nan"), device=device)
    o = fusedce.temp_softmax(x, temperatures=temps, probs=probs, logprobs=True)
    assert o.probs is probs
    _close(o.probs, torch.softmax(xd / temps.double()[:, None], -1), rtol=1e-5, atol=1e-7)
    _close(o.logprobs, torch.log_softmax(xd / temps.double()[:, None], -1), rtol=1e-5, atol=1e-5)
    o = fusedce.temp_softmax(x, temperature=0.7, dtype=None, logprobs=True)
    assert o.probs.dtype == torch.bfloat16 and o.logprobs.dtype == torch.bfloat16
    _close(o.probs, torch.softmax(xd / 0.7, -1), rtol=1e-2, atol=1e-3)
    r = fusedce.cross_entropy_fwd(x, t, reduction="none", z_loss_scale=1e-3, z_loss=True, entropy=True, argmax=True)
    ll = torch.logsumexp(xd, -1)
    nll = torch.where(t == -100, 0.0, ll - xd.gather(1, t.clamp_min(0)[:, None])[:, 0])
    zl = torch.where(t == -100, 0.0, 1e-3 * ll ** 2)
    _close(r.loss, nll + zl, rtol=1e-5, atol=1e-5)
    _close(r.z_loss, zl, rtol=1e-5, atol=1e-6)
    _close(r.lse, ll, rtol=1e-6, atol=1e-6)
    p = torch.softmax(xd, -1)
    _close(r.entropy, -(p * torch.log_softmax(xd, -1)).sum(-1), rtol=1e-5, atol=1e-5)
    assert torch.equal(r.argmax, x.float().argmax(-1)) and r.dlogits is None
    with pytest.raises(fusedce.InvalidArgumentError):
        fusedce.temp_softmax(x, temperature=float("nan"))
    with pytest.raises(fusedce.ShapeMismatchError):
        fusedce.logsumexp(x, out=torch.empty(3, device=device))


# ---- the lse a backward reads: its pairs (m, l), exact at any offset of the logits -----------------
#
# From 0.2.0 the library takes an lse as [N] or as its pairs [N, 2] (m, l) = (max z, log sum exp(z - m)); a
# backward given the pairs forms p_j = exp((z_j - m) - l) exactly whatever the logits' common offset, where
# from an [N] lse each p_j carries the lse's fp32 rounding (|lse| 2^-24 relative: 6e-3 at 1e5; at 2^25 the
# lse rounds log 2 away and p_j = 1 for both maxima). Every autograd path keeps the pairs; the references
# are float64 from max-shifted values (float64 itself loses log s beside a max of 1e15).

def _ce64(x, t):
    """Per-row float64 cross-entropy of x [N, V] at targets t, its gradient and lse, from max-shifted values
    (d = x - max is exact in float64 for fp32/bf16/fp16 inputs)."""
    x64 = x.detach().double()
    m = x64.max(-1, keepdim=True).values
    d = x64 - m
    s = d.exp().sum(-1, keepdim=True)
    p = d.exp() / s
    loss = s.log()[:, 0] - d.gather(-1, t[:, None])[:, 0]
    grad = p - F.one_hot(t, x.shape[-1]).double()
    return loss, grad, m[:, 0] + s.log()[:, 0]


def _offset_cases(device):
    """(logits, targets): fp32 logits around 1e5; rows [2^25, 2^25, 0, 1] (fp32), [65504, 65504, 0, 1]
    (fp16) and [2^127, 2^127, 0, 1] (bf16), whose gradient at target 0 is exactly [-0.5, 0.5, 0, 0]."""
    g = torch.Generator().manual_seed(21)
    x = (torch.randn(6, 50, generator=g) * 2 + 1e5).to(device)
    t = torch.randint(0, 50, (6,), generator=g).to(device)
    out = [(x, t)]
    for big, dt in ((2.0 ** 25, torch.float32), (65504.0, torch.float16), (2.0 ** 127, torch.bfloat16)):
        rows = torch.tensor([[big, big, 0.0, 1.0], [0.0, 1.0, big, big]]).to(device=device, dtype=dt)
        out.append((rows, torch.tensor([0, 3], device=device)))
    return out


def _ce_paths(monkeypatch):
    """How fusedce.torch.cross_entropy may run: as called (libfusedce_torch's C++ autograd node where it is
    loaded), the Python autograd.Function (the cffi path), and torch.compile(fullgraph=True) (the custom op
    fusedce::cross_entropy and its registered backward)."""
    def function(*a, **k):
        with monkeypatch.context() as m:
            m.setattr(ft, "_EAGER", False)
            return ft.cross_entropy(*a, **k)

    # Dynamo's recompile limit (8) counts the variants of ft.cross_entropy's code object across every
    # torch.compile wrapper of it: a fresh start per test, or the shapes and options of the tests before (and
    # their cuda runs, on a GPU machine) exhaust it under fullgraph=True.
    torch._dynamo.reset()
    return {"eager": ft.cross_entropy, "function": function,
            "compile": torch.compile(ft.cross_entropy, fullgraph=True, backend="aot_eager", dynamic=False)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["eager", "function", "compile"])
def test_cross_entropy_gradient_exact_at_large_offsets(device, path, monkeypatch):
    """fusedce.torch.cross_entropy forward and backward on logits with a large common offset: the gradient
    (times an upstream gradient) within fp32 rounding of the float64 one, exactly [-0.5, 0.5, 0, 0] g on the
    rows of two equal maxima; the lse it reports within an ulp of the float64 lse."""
    fn = _ce_paths(monkeypatch)[path]
    for x0, t in _offset_cases(device):
        x = x0.clone().requires_grad_()
        out = fn(x, t, reduction="none", return_lse=True)
        up = torch.linspace(0.5, 1.5, t.shape[0], device=device)
        (out.loss * up).sum().backward()
        loss, grad, lse = _ce64(x0, t)
        want = grad * up.double()[:, None]
        if x0.shape[1] == 4:
            assert torch.equal(want, torch.tensor([[-0.5, 0.5, 0, 0], [0, 0, 0.5, -0.5]], dtype=torch.float64,
                                                  device=device) * up.double()[:, None])
            assert torch.equal(x.grad.double(), want), (path, x0.dtype, x.grad)
        else:
            err = float((x.grad.double() - want).abs().max())
            assert err < 2e-6, (path, "gradient off by %g (an [N] lse's rounding gives ~1e-3)" % err)
        # the loss and lse: within an ulp of |lse| (the library forms the loss from the fp32 lse)
        ulp = (torch.finfo(torch.float32).eps * lse.abs()).clamp_min(1e-6)
        assert bool(((out.lse.double() - lse).abs() <= ulp).all()), (path, out.lse, lse)
        assert bool(((out.loss.double() - loss).abs() <= ulp).all()), (path, out.loss, loss)


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_mean_and_options_at_an_offset(device, monkeypatch):
    """The reduced loss with label smoothing and the z-loss, at fp32 logits + 1e5, on every path: the gradient
    against float64 autograd of max-shifted logits (the z-loss's term 2 q lse p_j included)."""
    g = torch.Generator().manual_seed(4)
    x0 = (torch.randn(5, 33, generator=g) + 1e5).to(device)
    t = torch.randint(0, 33, (5,), generator=g).to(device)
    x64 = x0.double().requires_grad_()
    m = x64.detach().max(-1, keepdim=True).values
    zq = 1e-12
    lse64 = torch.logsumexp(x64 - m, -1) + m[:, 0]
    ref = F.cross_entropy(x64 - m, t, label_smoothing=0.1) + zq * (lse64 ** 2).mean()
    (ref * 0.75).backward()
    for name, fn in _ce_paths(monkeypatch).items():
        x = x0.clone().requires_grad_()
        (fn(x, t, label_smoothing=0.1, lse_square_scale=zq) * 0.75).backward()
        err = float((x.grad.double() - x64.grad).abs().max())
        assert err < 1e-6, (name, err)


@pytest.mark.parametrize("device", DEVICES)
def test_reported_lse_and_the_library_lse(device, monkeypatch):
    """return_lse: without a backward to feed, the library's [N] lse bit for bit; with one (and under
    torch.compile, whose op fusedce::cross_entropy returns the pairs), m + l of the pairs the backward keeps,
    added in fp32 (fusedce.lse_value): within 1 ulp of the [N] lse (the CPU backend rounds m + log s once in
    float64, the CUDA one in fp32 as this does)."""
    g = torch.Generator().manual_seed(8)
    x = (torch.randn(64, 40, generator=g) * 3).to(device)
    t = torch.randint(0, 40, (64,), generator=g).to(device)
    plain = fusedce.cross_entropy_fwd(x, t, reduction="none").lse
    pairs = fusedce.cross_entropy_fwd(x, t, reduction="none", lse="pair").lse
    assert pairs.shape == (64, 2) and pairs.dtype == torch.float32
    assert torch.equal(fusedce.lse_value(pairs), pairs[:, 0] + pairs[:, 1])
    assert torch.equal(pairs[:, 0], x.max(-1).values)
    assert bool(((fusedce.lse_value(pairs) - plain).abs() <= torch.finfo(torch.float32).eps * plain.abs()).all())
    for name, fn in _ce_paths(monkeypatch).items():
        with torch.no_grad():
            want = fusedce.lse_value(pairs) if name == "compile" else plain
            assert torch.equal(fn(x, t, return_lse=True).lse, want), name
        xg = x.clone().requires_grad_()
        assert torch.equal(fn(xg, t, return_lse=True).lse.detach(), fusedce.lse_value(pairs)), name
    out = torch.ops.fusedce.cross_entropy(x, t, None, 0, -100, 0.0, 0.0, 0.0, 1.0, False, False, False)
    assert torch.equal(out[1], pairs)


@pytest.mark.parametrize("device", DEVICES)
def test_linear_cross_entropy_gradient_exact_at_large_offsets(device):
    """linear_cross_entropy with per-row losses (the backward recomputes the logits from the saved lse) where
    a bias puts every logit near 1e5, and where it makes the logits [2^25, 2^25, 0, 1]: dhidden, dweight and
    dbias against float64, dbias exactly [-0.5, 0.5, 0, 0] g on the second."""
    g = torch.Generator().manual_seed(2)
    h0 = torch.randn(6, 8, generator=g).to(device)
    w0 = (torch.randn(30, 8, generator=g) * 0.5).to(device)
    b0 = (torch.randn(30, generator=g) + 1e5).to(device)
    t = torch.randint(0, 30, (6,), generator=g).to(device)
    up = torch.linspace(0.5, 1.5, 6, device=device)
    h, w, b = (a.clone().requires_grad_() for a in (h0, w0, b0))
    out = ft.linear_cross_entropy(h, w, t, bias=b, reduction="none", return_lse=True)
    (out.loss * up).sum().backward()
    # the library rounds the logits to fp32 (hidden's dtype) before the softmax: the reference too
    z = (h0.double() @ w0.double().T + b0.double()).float()
    _, grad, lse = _ce64(z, t)
    dz = grad * up.double()[:, None]
    for got, want, name in ((b.grad, dz.sum(0), "dbias"), (h.grad, dz @ w0.double(), "dhidden"),
                            (w.grad, dz.T @ h0.double(), "dweight")):
        err = float((got.double() - want).abs().max())
        assert err < 1e-5, (name, err)
    assert bool(((out.lse.double() - lse).abs() <= torch.finfo(torch.float32).eps * lse.abs()).all())
    h = torch.zeros(2, 3, device=device, requires_grad=True)
    w = torch.zeros(4, 3, device=device, requires_grad=True)
    b = torch.tensor([2.0 ** 25, 2.0 ** 25, 0.0, 1.0], device=device, requires_grad=True)
    loss = ft.linear_cross_entropy(h, w, torch.tensor([0, 1], device=device), bias=b, reduction="none")
    (loss * torch.tensor([1.0, 3.0], device=device)).sum().backward()
    assert torch.equal(b.grad, torch.tensor([-0.5 + 1.5, 0.5 - 1.5, 0.0, 0.0], device=device)), b.grad


@pytest.mark.parametrize("device", DEVICES)
def test_logprobs_gradient_exact_at_large_offsets(device):
    """logprobs_entropy's log-probabilities (fce_cross_entropy_bwd_ex from the saved pairs) and
    linear_logprobs_entropy's (fce_linear_cross_entropy_bwd) at logits near 1e5: the gradient against float64
    of max-shifted logits. (The entropy's gradient is left out here: the CPU library's entropy forward loses
    ~1e-3 at this offset by itself, summing exp(z - m) z in fp32 before subtracting m: not the lse's form.)"""
    g = torch.Generator().manual_seed(6)
    x0 = (torch.randn(5, 40, generator=g) * 2 + 1e5).to(device)
    t = torch.randint(0, 40, (5,), generator=g).to(device)
    u = torch.randn(5, generator=g).to(device)

    def ref(rows):
        x64 = rows.double().requires_grad_()
        lp64 = torch.log_softmax(x64 - x64.detach().max(-1, keepdim=True).values, -1)
        (lp64.gather(1, t[:, None])[:, 0] * u.double()).sum().backward()
        return x64.grad

    x = x0.clone().requires_grad_()
    lp, _ = ft.logprobs_entropy(x, t)
    (lp * u).sum().backward()
    err = float((x.grad.double() - ref(x0)).abs().max())
    assert err < 2e-6, "logprobs_entropy: gradient off by %g" % err
    # the LM head form: hidden [5, 1] of ones, weight [40, 1] the logits of row 0 (every row's logits)
    h = torch.ones(5, 1, device=device, requires_grad=True)
    w = x0[:1].T.clone().requires_grad_()
    lp, _ = ft.linear_logprobs_entropy(h, w, t)
    (lp * u).sum().backward()
    err = float((w.grad[:, 0].double() - ref(x0[:1].expand(5, 40)).sum(0)).abs().max())
    assert err < 1e-5, "linear_logprobs_entropy: dweight off by %g" % err
