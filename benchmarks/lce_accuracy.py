#!/usr/bin/env python3
"""Linear cross-entropy on the GPU: time, extra memory and gradient accuracy against a float64 reference,
fusedce.torch next to torch.compile, in one process.

    python3 benchmarks/lce_accuracy.py                                   # N=8192 H=4096 V=128256, random
    python3 benchmarks/lce_accuracy.py --shape 16384,4096,151936 --shape 8192,2304,256000
    python3 benchmarks/lce_accuracy.py --real data/smollm2_kjv_sample.safetensors   # real hidden states
    python3 benchmarks/lce_accuracy.py --modes default,ce:split,default  # forced paths, alternating
    python3 benchmarks/lce_accuracy.py --rounds 15 --shape ...          # head-to-head only (no accuracy)

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

--rounds R: instead, the head-to-head in interleaved rounds. Each round times, in a rotating order and each
after a 256 MiB L2 flush, the three cuBLAS GEMMs, the one N x V x H GEMM, and forward + backward and forward
alone (under torch.no_grad) of fusedce.torch and of torch.compile; medians over the rounds, and per round the
ratio of fusedce's time to torch.compile's (the GPU's clocks drift over a run; a ratio inside one round does
not). Forward alone is compared with the one GEMM's rate, forward + backward with the three GEMMs' and the
one GEMM's.
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


def compiled_peer():
    """torch.compile of the unfused loss, made afresh for each shape with dynamic=False (a training run's fixed
    shape): one function compiled for several shapes turns shape-generic (dynamic) from the second."""
    return torch.compile(lambda h_, w_, t_: F.cross_entropy((h_ @ w_.T).float(), t_), dynamic=False)


def head_to_head(n, hdim, v, real, rounds, ft):
    """Interleaved rounds (the module docstring): rows of (variant, median ms, min, max) and the per-round
    fusedce / torch.compile ratios (fwd+bwd, forward)."""
    compiled = compiled_peer()
    hid, w, tgt = inputs(n, hdim, v, real)
    g = torch.randn(n, v, device="cuda").to(torch.bfloat16)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    h = hid.detach().clone().requires_grad_()
    ww = w.detach().clone().requires_grad_()

    def both(step):
        def f():
            h.grad = ww.grad = None
            step(h, ww, tgt).backward()
        return f

    def fwd(step):
        def f():
            with torch.no_grad():
                step(hid, w, tgt)
        return f

    def three():
        torch.matmul(hid, w.T)
        torch.matmul(g, w)
        torch.matmul(g.T, hid)

    lib = lambda h_, w_, t_: ft.linear_cross_entropy(h_, w_, t_)  # noqa: E731
    variants = [("three cuBLAS GEMMs (torch.matmul)", three), ("one GEMM, N x V x H", lambda: torch.matmul(hid, w.T)),
                ("fusedce.torch fwd+bwd", both(lib)), ("torch.compile fwd+bwd", both(compiled)),
                ("fusedce.torch forward", fwd(lib)), ("torch.compile forward", fwd(compiled))]
    for _, f in variants:  # compilation, the library's handle and workspace
        f()
        f()
    torch.cuda.synchronize()
    times = [[] for _ in variants]
    for r in range(rounds):
        for j in range(len(variants)):
            k = (j + r) % len(variants)
            flush.zero_()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            variants[k][1]()
            b.record()
            torch.cuda.synchronize()
            times[k].append(a.elapsed_time(b))
    del g, flush, h, ww, hid, w, tgt
    torch.cuda.empty_cache()
    rows = [(name, statistics.median(t), min(t), max(t)) for (name, _), t in zip(variants, times)]
    ratios = ([x / y for x, y in zip(times[2], times[3])], [x / y for x, y in zip(times[4], times[5])])
    return rows, ratios


def main_rounds(a, shapes, ft):
    out = []
    print("# lce_accuracy.py --rounds %d on %s, torch %s%s" % (a.rounds, torch.cuda.get_device_name(),
                                                               torch.__version__, ", real" if a.real else ""))
    for n, hdim, v in shapes:
        rows, (rb, rf) = head_to_head(n, hdim, v, a.real, a.rounds, ft)
        three, one = rows[0][1], rows[1][1]
        print("\n%d×%d×%d, %d rounds\n| variant | ms median (min..max) | of the one GEMM's rate | of the three "
              "GEMMs' rate |\n|---|---|---|---|" % (n, hdim, v, a.rounds))
        for i, (name, med, lo, hi) in enumerate(rows):
            k = 1 if i in (1, 4, 5) else 3  # forward alone is one GEMM's flops
            print("| %s | %.2f (%.2f..%.2f) | %.1f%% | %s |" % (name, med, lo, hi, 100 * k * one / med,
                                                              "" if k == 1 else "%.1f%%" % (100 * three / med)))
        for what, r in (("fwd+bwd", rb), ("forward", rf)):
            print("fusedce / torch.compile, %s: median %.3f per round, faster in %d of %d rounds"
                  % (what, statistics.median(r), sum(x < 1 for x in r), len(r)))
        out.append(dict(shape=[n, hdim, v], rounds=a.rounds, real=a.real,
                        rows=[dict(variant=nm, ms=m, min_ms=lo, max_ms=hi) for nm, m, lo, hi in rows],
                        ratio_fwd_bwd=rb, ratio_forward=rf))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, head_to_head=out), fh,
                      indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", action="append", help="N,H,V (repeatable); default 8192,4096,128256")
    ap.add_argument("--real", help="the sample file's hidden states, targets and LM head (its H and V)")
    ap.add_argument("--tokens", type=int, default=8192, help="rows with --real (the sample tiled)")
    ap.add_argument("--modes", default="default")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--rounds", type=int, help="the interleaved head-to-head instead (module docstring)")
    ap.add_argument("--json")
    a = ap.parse_args()
    import fusedce.torch as ft

    shapes = [tuple(int(x) for x in s.split(",")) for s in (a.shape or ["8192,4096,128256"])]
    if a.real:
        t = read_safetensors(a.real, ["lm_head"])["lm_head"]
        shapes = [(a.tokens, t.shape[1], t.shape[0])]
    if a.rounds:
        return main_rounds(a, shapes, ft)
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
        impls = [("torch.compile", None, compiled_peer())]
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
