"""fusedce.torch.logprobs_entropy and linear_logprobs_entropy (verl's log-prob + entropy): values and both
gradients against a float64 reference written here with torch (log_softmax, entropy, autograd), on random and
peaked rows up to V = 129920, temperatures 0.6 to 1.5, ignored labels, every reduction; CPU tensors always,
CUDA tensors too when torch and the library see a GPU."""
import pytest
import torch

import fusedce
import fusedce.torch as ft


def _cuda_ok():
    if not torch.cuda.is_available():
        return False
    try:
        fusedce.logsumexp(torch.zeros(1, 4, device="cuda"))
        torch.cuda.synchronize()
        return True
    except fusedce.FusedCEError:
        return False


DEVICES = ["cpu"] + (["cuda"] if _cuda_ok() else [])


def _reference(logits, labels, temperature, ignore_index=-100):
    """float64 (logprobs, entropy) with torch's own ops; ignored labels give logprob 0."""
    z = logits.double() / temperature
    logp = torch.log_softmax(z, -1)
    valid = labels != ignore_index
    lp = torch.where(valid, logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1), torch.zeros_like(logp[..., 0]))
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _inputs(n, v, dtype, device, peaked, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, v, generator=g) * 2
    if peaked:  # one dominant logit per row: entropies near 0, the case behind verl's precision reports
        x[torch.arange(n), torch.randint(0, v, (n,), generator=g)] += 25.0
    labels = torch.randint(0, v, (n,), generator=g)
    labels[::5] = -100
    return x.to(dtype).to(device), labels.to(device), g


def _tol(dtype):
    return dict(rtol=2e-2, atol=2e-3) if dtype != torch.float32 else dict(rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,peaked", [((7, 1031), False), ((9, 257), True), ((3, 129920), True)])
@pytest.mark.parametrize("temperature", [0.6, 1.0, 1.5])
def test_logprobs_entropy_and_both_gradients(device, dtype, shape, peaked, temperature):
    n, v = shape
    x, labels, g = _inputs(n, v, dtype, device, peaked, seed=n * v)
    x.requires_grad_(True)
    lp, ent = ft.logprobs_entropy(x, labels, temperature)
    xr = x.detach().double().requires_grad_(True)
    rlp, rent = _reference(xr, labels, temperature)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=2e-5 * (1 + rlp.abs().max().item()))
    torch.testing.assert_close(ent.double(), rent, rtol=1e-4, atol=1e-4)
    glp = torch.randn(n, generator=g).to(device)
    gent = torch.randn(n, generator=g).to(device)
    (got,) = torch.autograd.grad((lp * glp).sum() + (ent * gent).sum(), x)
    (want,) = torch.autograd.grad((rlp * glp.double()).sum() + (rent * gent.double()).sum(), xr, retain_graph=True)
    # fp32 forms log p_j = z_j - lse from an fp32 lse: an absolute error near ulp(max |z|) per element times
    # the upstream gradient, which dominates where a peaked row's true gradient is smaller (as in torch's
    # own fp32 log_softmax backward).
    zulp = 4 * 2.0 ** -23 * (x.detach().float().abs().max().item() / temperature)
    gmax = max(glp.abs().max().item(), gent.abs().max().item())
    scale = want.abs().max().item()
    torch.testing.assert_close(got.double(), want, rtol=_tol(dtype)["rtol"],
                               atol=_tol(dtype)["atol"] * scale + zulp * gmax)
    # each upstream gradient alone (the other output unused: no gradient flows into it)
    for which in ("logprobs", "entropy"):
        lp, ent = ft.logprobs_entropy(x, labels, temperature)
        out, rout = (lp, rlp) if which == "logprobs" else (ent, rent)
        (got,) = torch.autograd.grad((out * glp).sum(), x)
        (want,) = torch.autograd.grad((rout * glp.double()).sum(), xr, retain_graph=True)
        torch.testing.assert_close(got.double(), want, rtol=_tol(dtype)["rtol"],
                                   atol=_tol(dtype)["atol"] * want.abs().max().item() + zulp * gmax, msg=which)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_reductions_and_shapes(device, reduction):
    x, labels, _ = _inputs(12, 50, torch.float32, device, False, seed=3)
    x3, l3 = x.reshape(3, 4, 50).requires_grad_(True), labels.reshape(3, 4)
    lp, ent = ft.logprobs_entropy(x3, l3, 0.9, reduction)
    rlp, rent = _reference(x3.detach(), l3, 0.9)
    red = {"none": lambda t: t, "sum": torch.sum, "mean": torch.mean}[reduction]
    torch.testing.assert_close(lp.double(), red(rlp), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), red(rent), rtol=1e-5, atol=1e-5)
    assert lp.shape == red(rlp).shape
    (lp.sum() - ent.sum()).backward()
    assert x3.grad is not None and torch.isfinite(x3.grad).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep_logits", [False, True])
def test_linear_logprobs_entropy(device, dtype, keep_logits):
    g = torch.Generator().manual_seed(7)
    n, hdim, v = 17, 32, 389
    h = (torch.randn(n, hdim, generator=g)).to(dtype).to(device).requires_grad_(True)
    w = (torch.randn(v, hdim, generator=g) * 0.3).to(dtype).to(device).requires_grad_(True)
    labels = torch.randint(0, v, (n,), generator=g).to(device)
    labels[2] = -100
    lp, ent = ft.linear_logprobs_entropy(h, w, labels, temperature=0.8, keep_logits=keep_logits)
    hr, wr = h.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    logits = (h.detach().float() @ w.detach().float().T).to(dtype).double()  # the logits as the library rounds them
    rlp, rent = _reference(logits, labels, 0.8)
    torch.testing.assert_close(lp.double(), rlp, **_tol(dtype))
    torch.testing.assert_close(ent.double(), rent, **_tol(dtype))
    glp, gent = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)
    dh, dw = torch.autograd.grad((lp * glp).sum() + (ent * gent).sum(), (h, w))
    flp, fent = _reference(hr @ wr.T, labels, 0.8)
    wdh, wdw = torch.autograd.grad((flp * glp.double()).sum() + (fent * gent.double()).sum(), (hr, wr))
    for got, want in ((dh, wdh), (dw, wdw)):
        torch.testing.assert_close(got.double(), want, rtol=_tol(dtype)["rtol"] * 3,
                                   atol=_tol(dtype)["atol"] * 3 * want.abs().max().item())


def test_bad_temperature_raises():
    x = torch.randn(2, 5)
    t = torch.tensor([1, 2])
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError):
            ft.logprobs_entropy(x, t, bad)
