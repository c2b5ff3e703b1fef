#!/usr/bin/env python3
"""The entropy's gradient (verl's log-prob + entropy) on the GPU: the C path and the PyTorch path, with the
copy bandwidth, the cuBLAS rate and the peers (PyTorch eager, torch.compile) in the same run.

    python3 benchmarks/bench_entropy.py [--tokens 8192 --vocab 128256 --hidden 4096] [--json out.json]

Rows (bf16, event-timed medians after an L2 flush):
  - copy: d.copy_(x) over the [N, V] logits (one read, one write), the bandwidth floor of a fused pass;
  - C calls (fusedce.ops on torch tensors): the fused forward with the gradient for the loss alone (mean;
    none with an [N] grad_loss), then with grad_entropy as well; the backward from saved statistics without
    (fce_cross_entropy_bwd) and with the entropy's gradient (fce_cross_entropy_bwd_ex);
  - PyTorch: fusedce.torch.logprobs_entropy forward + backward with random upstream gradients for both
    outputs, against eager and torch.compile of log_softmax / gather / entropy in fp32;
  - linear: the GEMMs alone (what forward + backward needs: 8 N H V flops through cuBLAS), linear
    cross-entropy (mean: 6 N H V, fused; none: 8 N H V), linear_logprobs_entropy, torch.compile of the same
    math. Memory: torch's peak above the inputs plus device memory outside torch's allocator (cudaMemGetInfo).
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bindings", "python"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

_FLUSH = None


def flush_l2():
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    _FLUSH.zero_()


def timed(fn, iters, warmup=3):
    """Median ms of fn() over iters runs, each after an L2 flush, CUDA events around the call alone."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        flush_l2()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def outside_torch():
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def memory(fn):
    """(torch's peak above what was allocated before, bytes outside torch's allocator) of one call."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base, out0 = torch.cuda.memory_allocated(), outside_torch()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, max(0, outside_torch() - out0)


def reference_math(x, labels, temperature):
    z = x.float() / temperature
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) * (labels != -100)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip-linear", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()

    import fusedce
    import fusedce.torch as ft

    dev = "cuda"
    N, V, H, T = a.tokens, a.vocab, a.hidden, a.temperature
    g = torch.Generator(device=dev).manual_seed(0)
    x = (torch.randn(N, V, device=dev, generator=g) * 2).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device=dev, generator=g)
    t[: N // 16] = -100
    gl = torch.randn(N, device=dev, generator=g)
    ge = torch.randn(N, device=dev, generator=g) * 0.01
    d = torch.empty_like(x)
    rows = []

    def row(group, name, ms, bytes_moved=None, flops=None, mem=None, note=""):
        r = dict(group=group, name=name, ms=ms, note=note)
        if bytes_moved:
            r["GB/s"] = bytes_moved / ms / 1e6
        if flops:
            r["TFLOP/s"] = flops / ms / 1e9
        if mem:
            r["torch_peak_MiB"], r["outside_MiB"] = mem[0] / 2**20, mem[1] / 2**20
        rows.append(r)
        print("%-8s %-58s %9.3f ms %s" % (group, name, ms, note), flush=True)

    rw = 2 * x.numel() * x.element_size()
    row("floor", "copy [N,V] (read + write)", timed(lambda: d.copy_(x), a.iters), rw)
    s = 1.0 / T
    cases = [
        ("C fwd + dlogits, loss only (mean)", dict(dlogits=d, lse=False, logit_scale=s)),
        ("C fwd + dlogits, loss only (none, [N] grad_loss)",
         dict(dlogits=d, lse=False, reduction="none", grad_loss=gl, logit_scale=s)),
        ("C fwd + dlogits, grad_loss + grad_entropy",
         dict(dlogits=d, lse=False, reduction="none", grad_loss=gl, grad_entropy=ge, logit_scale=s)),
        ("C fwd + dlogits, both + entropy and lse out",
         dict(dlogits=d, lse=True, entropy=True, reduction="none", grad_loss=gl, grad_entropy=ge, logit_scale=s)),
    ]
    for name, kw in cases:
        row("C", name, timed(lambda kw=kw: fusedce.cross_entropy_fwd(x, t, **kw), a.iters), rw)
    fwd = fusedce.cross_entropy_fwd(x, t, reduction="none", entropy=True, logit_scale=s)
    row("C", "C bwd from lse (loss only)", timed(lambda: fusedce.cross_entropy_bwd(
        x, t, fwd.lse, grad_loss=gl, dlogits=d, reduction="none", logit_scale=s), a.iters), rw)
    row("C", "C bwd_ex from lse + entropy (both)", timed(lambda: fusedce.cross_entropy_bwd_ex(
        x, t, fwd.lse, entropy=fwd.entropy, grad_loss=gl, grad_entropy=ge, dlogits=d, reduction="none",
        logit_scale=s), a.iters), rw)

    # PyTorch path: forward + backward with both upstream gradients
    glp = torch.randn(N, device=dev, generator=g)

    def step(fn):
        def run():
            xl = x.detach().requires_grad_(True)
            lp, ent = fn(xl, t, T)
            torch.autograd.backward((lp, ent), (glp, ge))
            return xl.grad
        return run

    eager_fn = reference_math
    compiled_fn = torch.compile(reference_math, dynamic=False)
    ref_grad = step(eager_fn)()
    for name, fn in (("fusedce.torch.logprobs_entropy", ft.logprobs_entropy), ("torch eager (fp32 math)", eager_fn),
                     ("torch.compile (fp32 math)", compiled_fn)):
        run = step(fn)
        try:
            err = float((run().float() - ref_grad.float()).abs().max())
            row("PyTorch", name + " fwd+bwd", timed(run, a.iters), 3 * x.numel() * x.element_size(), mem=memory(run),
                note="max |dx - eager| %.2e" % err)
        except Exception as e:  # noqa: BLE001 - report, do not hide
            row("PyTorch", name + " fwd+bwd", float("nan"), note="n/a: %s" % str(e).splitlines()[0][:80])
    del x, d, fwd, ref_grad
    torch.cuda.empty_cache()

    if not a.skip_linear:
        hid = torch.randn(N, H, device=dev, generator=g).to(torch.bfloat16)
        w = (torch.randn(V, H, device=dev, generator=g) * H ** -0.5).to(torch.bfloat16)
        lg = torch.empty(N, V, device=dev, dtype=torch.bfloat16)
        dh, dw = torch.empty_like(hid), torch.empty_like(w)

        def gemms():  # forward, the backward's recompute, dhidden, dweight
            torch.mm(hid, w.T, out=lg)
            torch.mm(hid, w.T, out=lg)
            torch.mm(lg, w, out=dh)
            torch.mm(lg.T, hid, out=dw)
        f8 = 8.0 * N * H * V
        row("linear", "cuBLAS: 4 GEMMs of fwd+bwd (8NHV)", timed(gemms, a.iters), flops=f8)
        del lg
        torch.cuda.empty_cache()

        def lstep(fn, grads):
            def run():
                hl, wl = hid.detach().requires_grad_(True), w.detach().requires_grad_(True)
                out = fn(hl, wl)
                torch.autograd.backward(out, grads)
                return hl.grad, wl.grad
            return run

        # the C calls alone: forward (with the entropy output), backward without and with the entropy's term
        fo = fusedce.linear_cross_entropy_fwd(hid, w, t, reduction="none", entropy=True, logit_scale=s)
        row("linear", "C linear fwd, loss + lse (none)", timed(lambda: fusedce.linear_cross_entropy_fwd(
            hid, w, t, reduction="none", logit_scale=s), a.iters), flops=2.0 * N * H * V)
        row("linear", "C linear fwd, + entropy", timed(lambda: fusedce.linear_cross_entropy_fwd(
            hid, w, t, reduction="none", entropy=True, logit_scale=s), a.iters), flops=2.0 * N * H * V)
        row("linear", "C linear bwd (grad_loss)", timed(lambda: fusedce.linear_cross_entropy_bwd(
            hid, w, t, fo.lse, dhidden=dh, dweight=dw, grad_loss=gl, reduction="none", logit_scale=s),
            max(3, a.iters // 2)), flops=6.0 * N * H * V)
        row("linear", "C linear bwd (grad_loss + grad_entropy)", timed(lambda: fusedce.linear_cross_entropy_bwd(
            hid, w, t, fo.lse, dhidden=dh, dweight=dw, grad_loss=gl, grad_entropy=ge, entropy=fo.entropy,
            reduction="none", logit_scale=s), max(3, a.iters // 2)), flops=6.0 * N * H * V)
        del fo
        one = torch.ones((), device=dev)
        lin = [
            ("fusedce linear_cross_entropy (mean: 6NHV fused)",
             lambda h_, w_: (ft.linear_cross_entropy(h_, w_, t, logit_scale=s),), (one,), 6.0),
            ("fusedce linear_cross_entropy (none: 8NHV)",
             lambda h_, w_: (ft.linear_cross_entropy(h_, w_, t, reduction="none", logit_scale=s),), (gl,), 8.0),
            ("fusedce linear_logprobs_entropy (both grads)",
             lambda h_, w_: ft.linear_logprobs_entropy(h_, w_, t, T), (glp, ge), 8.0),
            ("fusedce logprobs_entropy(h @ w.T) (logits kept: 6NHV)",
             lambda h_, w_: ft.logprobs_entropy(h_ @ w_.T, t, T), (glp, ge), 6.0),
            ("torch.compile linear log-prob + entropy",
             torch.compile(lambda h_, w_: reference_math(h_ @ w_.T, t, T), dynamic=False), (glp, ge), 6.0),
        ]
        for name, fn, grads, k in lin:
            run = lstep(fn, grads)
            try:
                row("linear", name + " fwd+bwd", timed(run, max(3, a.iters // 2)), flops=k * N * H * V,
                    mem=memory(run))
            except Exception as e:  # noqa: BLE001
                row("linear", name + " fwd+bwd", float("nan"), note="n/a: %s" % str(e).splitlines()[0][:80])

    info = dict(device=torch.cuda.get_device_name(), tokens=N, vocab=V, hidden=H, temperature=T,
                library=str(fusedce.build_info()), torch=torch.__version__)
    print("\n| group | row | ms | GB/s or TFLOP/s | memory (torch peak / outside, MiB) | note |\n|---|---|---|---|---|---|")
    for r in rows:
        rate = "%.0f GB/s" % r["GB/s"] if "GB/s" in r else ("%.0f TFLOP/s" % r["TFLOP/s"] if "TFLOP/s" in r else "")
        mem = "%.0f / %.0f" % (r["torch_peak_MiB"], r["outside_MiB"]) if "torch_peak_MiB" in r else ""
        print("| %s | %s | %.3f | %s | %s | %s |" % (r["group"], r["name"], r["ms"], rate, mem, r["note"]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(info=info, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
