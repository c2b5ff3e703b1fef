#!/usr/bin/env python3
"""Linear cross-entropy on the GPU: time, extra memory and gradient accuracy against a float64 reference,
fusedce.torch next to torch.compile, in one process.

    python3 benchmarks/lce_accuracy.py                                   # N=8192 H=4096 V=128256, random
    python3 benchmarks/lce_accuracy.py --shape 16384,4096,151936 --shape 8192,2304,256000
    python3 benchmarks/lce_accuracy.py --real data/smollm2_kjv_sample.safetensors   # real hidden states
    python3 benchmarks/lce_accuracy.py --modes default,ce:split,default  # forced paths, alternating

For each shape (N tokens, H hidden, V vocabulary; bf16 hidden states and LM head, mean loss, 1/16 of the
targets ignored) it times forward + backward (loss, dhidden, dweight: 6NHV flops) of
fusedce.torch.linear_cross_entropy and of torch.compile(F.cross_entropy((h @ w.T).float(), t)) (CUDA events,
median of --iters after a warm-up), the in-run cuBLAS rate of the three GEMMs of that shape (torch.matmul,
bf16 in and out), and the extra device memory of a call beyond its inputs and the gradients asked for
(PyTorch's peak, plus what the first call leaves held outside PyTorch's allocator by cudaMemGetInfo: the
library's workspace, on a stream, so a handle, of its own). Then
dhidden and dweight of each against float64 (the logits, softmax and both gradient GEMMs in float64, in row
chunks): RMS and max absolute error, and their ratio to torch.compile's. --modes runs the library once per mode,
with FCE_FORCE_PATH set to the mode (the planners' paths, e.g. "ce:split"); "default" leaves it unset.
"""
import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bindings", "python"))
sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_torch import read_safetensors  # noqa: E402


def inputs(n, h, v, real, seed=0):
    if real:
        t = read_safetensors(real, ["hidden", "lm_head", "targets"])
        reps = -(-n // t["hidden"].shape[0])
        hid = t["hidden"].repeat(reps, 1)[:n].cuda().to(torch.bfloat16).contiguous()
        tgt = t["targets"].repeat(reps)[:n].cuda().to(torch.int64)
        return hid, t["lm_head"].cuda().to(torch.bfloat16).contiguous(), tgt
    g = torch.Generator(device="cuda").manual_seed(seed)
    hid = torch.randn(n, h, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    tgt = torch.randint(0, v, (n,), device="cuda", generator=g)
    tgt[: n // 16] = -100
    return hid, w, tgt


def reference(hid, w, tgt, rows=1024):
    """dhidden and dweight of the mean cross-entropy in float64."""
    h64, w64 = hid.double(), w.double()
    valid = (tgt != -100).sum().item()
    dh = torch.empty_like(h64)
    dw = torch.zeros_like(w64)
    for r0 in range(0, hid.shape[0], rows):
        x = h64[r0:r0 + rows] @ w64.T
        t = tgt[r0:r0 + rows]
        p = torch.softmax(x, -1)
        keep = t != -100
        p[keep, t[keep]] -= 1.0
        p[~keep] = 0.0
        p /= valid
        dh[r0:r0 + rows] = p @ w64
        dw += p.T @ h64[r0:r0 + rows]
        del x, p
    return dh, dw


def errors(got, ref):
    d = got.double() - ref
    return d.pow(2).mean().sqrt().item(), d.abs().max().item()


def timed(fn, iters):
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def cublas_ms(n, h, v, iters):
    a = torch.randn(n, h, device="cuda").to(torch.bfloat16)
    b = torch.randn(v, h, device="cuda").to(torch.bfloat16)
    g = torch.randn(n, v, device="cuda").to(torch.bfloat16)

    def three():
        torch.matmul(a, b.T)
        torch.matmul(g, b)
        torch.matmul(g.T, a)

    three()
    ms = timed(three, iters)
    del a, b, g
    return ms


def run_one(step, hid, w, tgt, iters):
    """(ms, extra MiB, dh, dw) of fwd+bwd on a stream of its own (so the library makes a handle, and its
    cached workspace, for this call alone). Extra memory: PyTorch's peak above the inputs and the gradients
    asked for, plus what the first call left held outside PyTorch's allocator (cudaMemGetInfo)."""
    h = hid.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()
    grads = (h.numel() + ww.numel()) * h.element_size()

    def once():
        h.grad = ww.grad = None
        step(h, ww, tgt).backward()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free0, res0 = torch.cuda.mem_get_info()[0], torch.cuda.memory_reserved()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        once()  # the first call: compilation, the library's handle and workspace
        torch.cuda.synchronize()
        h.grad = ww.grad = None
        outside = free0 - torch.cuda.mem_get_info()[0] - (torch.cuda.memory_reserved() - res0)
        torch.cuda.reset_peak_memory_stats()
        once()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base - grads
        ms = timed(once, iters)
    return ms, (max(peak, 0) + max(outside, 0)) / 2**20, h.grad.detach(), ww.grad.detach()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="N,H,V (repeatable); default 8192,4096,128256")
    ap.add_argument("--real", help="the sample file's hidden states, targets and LM head (its H and V)")
    ap.add_argument("--tokens", type=int, default=8192, help="rows with --real (the sample tiled)")
    ap.add_argument("--modes", default="default")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    import fusedce.torch as ft

    compiled = torch.compile(lambda h, w, t: F.cross_entropy((h @ w.T).float(), t))
    shapes = [tuple(int(x) for x in s.split(",")) for s in (a.shape or ["8192,4096,128256"])]
    if a.real:
        t = read_safetensors(a.real, ["lm_head"])["lm_head"]
        shapes = [(a.tokens, t.shape[1], t.shape[0])]
    rows = []
    print("# lce_accuracy.py on %s, torch %s%s" % (torch.cuda.get_device_name(), torch.__version__,
                                                   ", real hidden states of " + a.real if a.real else ", random"))
    print("| N×H×V | implementation | ms | % of cuBLAS | extra MiB | dhidden RMS / max | dweight RMS / max "
          "| dweight RMS, max vs torch.compile |")
    print("|---|---|---|---|---|---|---|---|")
    for n, hdim, v in shapes:
        hid, w, tgt = inputs(n, hdim, v, a.real)
        ref_dh, ref_dw = reference(hid, w, tgt)
        gemm = cublas_ms(n, hdim, v, a.iters)
        impls = [("torch.compile", None, compiled)]
        for m in a.modes.split(","):
            impls.append(("fusedce" + ("" if m == "default" else " (%s)" % m), m,
                          lambda h, w_, t: ft.linear_cross_entropy(h, w_, t)))
        base = None
        for name, mode, step in impls:
            if mode and mode != "default":
                os.environ["FCE_FORCE_PATH"] = mode
            else:
                os.environ.pop("FCE_FORCE_PATH", None)
            ms, extra, dh, dw = run_one(step, hid, w, tgt, a.iters)
            eh, ew = errors(dh, ref_dh), errors(dw, ref_dw)
            if base is None:
                base = ew
            r = dict(shape=[n, hdim, v], impl=name, ms=ms, cublas_ms=gemm, pct=100 * gemm / ms, extra_mib=extra,
                     dh_rms=eh[0], dh_max=eh[1], dw_rms=ew[0], dw_max=ew[1], dw_rms_ratio=ew[0] / base[0],
                     dw_max_ratio=ew[1] / base[1])
            rows.append(r)
            print("| %d×%d×%d | %s | %.2f | %.1f | %.0f | %.3g / %.3g | %.3g / %.3g | %.2f, %.2f |" % (
                n, hdim, v, name, ms, r["pct"], extra, eh[0], eh[1], ew[0], ew[1], r["dw_rms_ratio"],
                r["dw_max_ratio"]), flush=True)
            del dh, dw
        os.environ.pop("FCE_FORCE_PATH", None)
        del hid, w, tgt, ref_dh, ref_dw
        torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, real=a.real, rows=rows), fh,
                      indent=1)


if __name__ == "__main__":
    main()
