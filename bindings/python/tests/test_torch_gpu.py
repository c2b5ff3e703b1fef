"""fusedce.torch's autograd functions against PyTorch's own losses: values and gradients.

Runs on CUDA tensors when torch sees a GPU and the library's CUDA backend works; skipped otherwise (no
torch, no GPU, a build without CUDA, or a CUDA backend that still reports FCE_STATUS_NOT_IMPLEMENTED;
set FUSEDCE_GPU_STRICT=1 to make the latter a failure). The same checks also run on CPU tensors whenever
torch is importable, which exercises the DLPack path and the autograd wiring without a GPU.
"""
import os

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import fusedce  # noqa: E402
import fusedce.torch as ft  # noqa: E402


def _cuda_status():
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        fusedce.logsumexp(torch.zeros(1, 4, device="cuda"))
        torch.cuda.synchronize()
    except fusedce.NoDeviceError as e:
        return "libfusedce has no usable CUDA device: %s" % e
    except fusedce.BackendNotImplementedError as e:
        if os.environ.get("FUSEDCE_GPU_STRICT") == "1":
            raise
        return "the CUDA backend is not implemented yet: %s" % e
    return None


_CUDA_SKIP = _cuda_status()
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(_CUDA_SKIP is not None, reason=str(_CUDA_SKIP)))]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
       torch.float16: dict(rtol=5e-3, atol=5e-3)}


def _leaf(x):
    return x.detach().clone().requires_grad_(True)


def _check(a, b, dtype=torch.float32):
    torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kw", [{}, {"reduction": "sum"}, {"reduction": "none"}, {"label_smoothing": 0.1},
                                {"ignore_index": 5}, {"weight": True}, {"weight": True, "label_smoothing": 0.2}],
                         ids=lambda kw: ",".join(kw) or "defaults")
def test_cross_entropy_matches_torch(device, dtype, kw):
    g = torch.Generator().manual_seed(0)
    n, v = 64, 1000
    x = (torch.randn(n, v, generator=g) * 3).to(device=device, dtype=dtype)
    t = torch.randint(0, v, (n,), generator=g).to(device)
    t[3] = kw.get("ignore_index", -100)
    kw = dict(kw)
    if kw.pop("weight", False):
        kw["weight"] = (torch.rand(v, generator=g) + 0.5).to(device)
    a, b = _leaf(x), _leaf(x.float())
    la = ft.cross_entropy(a, t, **kw)
    lb = F.cross_entropy(b, t, **kw)
    _check(la, lb, dtype)
    up = torch.rand_like(lb) if lb.dim() else torch.tensor(0.7, device=device)
    la.backward(up)
    lb.backward(up)
    assert a.grad.dtype == dtype
    _check(a.grad, b.grad, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_shapes_and_module(device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, 3, 5, generator=g).to(device)          # (N, C, d1, d2)
    t = torch.randint(0, 7, (4, 3, 5), generator=g).to(device)
    for red in ("none", "mean", "sum"):
        a, b = _leaf(x), _leaf(x)
        la, lb = ft.cross_entropy(a, t, reduction=red), F.cross_entropy(b, t, reduction=red)
        assert la.shape == lb.shape
        _check(la, lb)
        la.sum().backward()                    # stride-0 upstream gradient for "none"
        lb.sum().backward()
        _check(a.grad, b.grad)
    x1, t1 = torch.randn(7, device=device), torch.tensor(2, device=device)
    _check(ft.cross_entropy(x1, t1), F.cross_entropy(x1, t1))
    m = ft.CrossEntropyLoss(ignore_index=0, label_smoothing=0.05)
    x2, t2 = torch.randn(9, 7, device=device), torch.randint(0, 7, (9,), device=device)
    _check(m(x2, t2), torch.nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.05)(x2, t2))
    # probability targets go to PyTorch
    p = torch.softmax(torch.randn(9, 7, device=device), -1)
    _check(ft.cross_entropy(x2, p), F.cross_entropy(x2, p))


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_extras_match_formula(device):
    """z-loss, soft-capping and logit scale against the header's formula written in torch."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(32, 300, generator=g) * 4).to(device)
    t = torch.randint(0, 300, (32,), generator=g).to(device)
    t[0] = -100
    cap, s, q = 20.0, 0.8, 1e-3
    a, b = _leaf(x), _leaf(x)
    la = ft.cross_entropy(a, t, z_loss_scale=q, softcap=cap, logit_scale=s)
    z = cap * torch.tanh(s * b / cap)
    keep = t != -100
    per = F.cross_entropy(z, t, reduction="none") + q * torch.logsumexp(z, -1) ** 2 * keep
    lb = per.sum() / keep.sum()
    _check(la, lb)
    la.backward()
    lb.backward()
    _check(a.grad, b.grad)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_matches_torch(device, dtype, bias):
    g = torch.Generator().manual_seed(3)
    b_, t_, h, v = 2, 24, 64, 500
    hid = torch.randn(b_, t_, h, generator=g).to(device=device, dtype=dtype)
    w = (torch.randn(v, h, generator=g) * 0.1).to(device=device, dtype=dtype)
    bb = (torch.randn(v, generator=g) * 0.1).to(device=device, dtype=dtype) if bias else None
    tgt = torch.randint(0, v, (b_, t_), generator=g).to(device)
    tgt[0, :3] = -100
    ha, wa = _leaf(hid), _leaf(w)
    ba = _leaf(bb) if bias else None
    hb, wb = _leaf(hid.float()), _leaf(w.float())
    bbb = _leaf(bb.float()) if bias else None
    la = ft.linear_cross_entropy(ha, wa, tgt, ba, label_smoothing=0.1)
    lb = F.cross_entropy(F.linear(hb, wb, bbb).reshape(-1, v), tgt.reshape(-1), label_smoothing=0.1)
    _check(la, lb, dtype)
    la.backward()
    lb.backward()
    _check(ha.grad, hb.grad, dtype)
    _check(wa.grad, wb.grad, dtype)
    if bias:
        _check(ba.grad, bbb.grad, dtype)
    # the module, called like Liger's fused linear cross-entropy
    m = ft.LinearCrossEntropyLoss(label_smoothing=0.1)
    _check(m(w, hid, tgt, bb), lb, dtype)


def _kd_reference(s, t, divergence, beta, temperature, mask):
    lq = F.log_softmax(s.float() / temperature, -1)
    lp = F.log_softmax(t.float() / temperature, -1)
    p, q = lp.exp(), lq.exp()
    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0):
        per = (p * (lp - lq)).sum(-1)
    elif divergence == "reverse_kl" or (divergence == "jsd" and beta == 1):
        per = (q * (lq - lp)).sum(-1)
    else:
        lm = torch.log(beta * p + (1 - beta) * q)
        per = beta * (p * (lp - lm)).sum(-1) + (1 - beta) * (q * (lq - lm)).sum(-1)
    per = per * mask
    return per.sum() / mask.sum()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("divergence,beta", [("forward_kl", 0.5), ("reverse_kl", 0.5), ("jsd", 0.3), ("jsd", 0.0)])
def test_kd_loss_matches_torch(device, divergence, beta):
    g = torch.Generator().manual_seed(4)
    n, v, temp = 48, 700, 2.0
    s = (torch.randn(n, v, generator=g) * 2).to(device)
    t = (torch.randn(n, v, generator=g) * 2).to(device)
    tgt = torch.randint(0, v, (n,), generator=g).to(device)
    tgt[:5] = -100
    a, b = _leaf(s), _leaf(s)
    la = ft.kd_loss(a, t, tgt, divergence=divergence, beta=beta, temperature=temp)
    lb = _kd_reference(b, t, divergence, beta, temp, (tgt != -100).float())
    _check(la, lb)
    la.backward(torch.tensor(1.3, device=device))
    lb.backward(torch.tensor(1.3, device=device))
    _check(a.grad, b.grad)
    if divergence == "forward_kl":  # the usual PyTorch spelling of the same loss, without masking
        a2 = _leaf(s)
        want = F.kl_div(F.log_softmax(s / temp, -1), F.log_softmax(t / temp, -1), log_target=True,
                        reduction="batchmean")
        _check(ft.KDLoss(temperature=temp)(a2, t), want)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("topk_norm", ["full_vocab", "renormalize"])
def test_kd_topk_matches_torch(device, topk_norm):
    g = torch.Generator().manual_seed(5)
    n, v, k = 16, 300, 8
    s = torch.randn(n, v, generator=g).to(device)
    teacher = torch.randn(n, v, generator=g).to(device)
    lps, ids = torch.log_softmax(teacher, -1).topk(k, -1)
    a, b = _leaf(s), _leaf(s)
    la = ft.kd_loss_topk(a, ids, lps, topk_norm=topk_norm, reduction="none")
    lp = torch.log_softmax(lps, -1)                                # teacher renormalized over its K ids
    ls = torch.log_softmax(b, -1) if topk_norm == "full_vocab" else None
    lq = ls.gather(1, ids) if ls is not None else torch.log_softmax(b.gather(1, ids), -1)
    lb = (lp.exp() * (lp - lq)).sum(-1)
    _check(la, lb)
    up = torch.rand(n, device=device)
    la.backward(up)
    lb.backward(up)
    _check(a.grad, b.grad)


@pytest.mark.skipif(_CUDA_SKIP is not None, reason=str(_CUDA_SKIP))
def test_cuda_side_stream_and_no_host_sync():
    """Work goes on the current stream: results computed under a side stream are right once that stream is
    synchronized, and the default stream is not involved."""
    x = torch.randn(256, 4096, device="cuda", requires_grad=True)
    t = torch.randint(0, 4096, (256,), device="cuda")
    want = F.cross_entropy(x.detach(), t)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        loss = ft.cross_entropy(x, t)
        loss.backward()
    s.synchronize()
    _check(loss, want)
    xr = x.detach().requires_grad_(True)
    torch.testing.assert_close(x.grad, torch.autograd.grad(F.cross_entropy(xr, t), xr)[0], rtol=1e-4, atol=1e-6)
