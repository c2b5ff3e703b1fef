#!/usr/bin/env python3
"""Linear log-prob + entropy against linear cross-entropy, interleaved: each round times every variant once
(event-timed after an L2 flush), so that clock and power drift over the run falls on all of them alike; the
medians and ranges over the rounds. Variants: the PyTorch path's forward + backward (linear_cross_entropy
with reduction none and an [N] upstream gradient, linear_logprobs_entropy with both), and the C calls that
make them up (forward without / with the entropy output, backward without / with the entropy's term), and
the peers of the same math that keep the logits: fusedce's logprobs_entropy(hidden @ weight.T) and
torch.compile of log_softmax / gather / entropy (bench_entropy.reference_math).

    FUSEDCE_LIBRARY=... python3 dev/probe_linear_lpe.py [--tokens 8192 --vocab 128256 --hidden 4096 --rounds 15]
"""
import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import torch  # noqa: E402

import fusedce  # noqa: E402
import fusedce.torch as ft  # noqa: E402
from bench_entropy import flush_l2, reference_math  # noqa: E402


def once(fn):
    flush_l2()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--rounds", type=int, default=15)
    a = ap.parse_args()
    N, V, H, T = a.tokens, a.vocab, a.hidden, a.temperature
    s = 1.0 / T
    g = torch.Generator(device="cuda").manual_seed(0)
    hid = torch.randn(N, H, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(V, H, device="cuda", generator=g) * H ** -0.5).to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    gl = torch.randn(N, device="cuda", generator=g)
    ge = torch.randn(N, device="cuda", generator=g) * 0.01
    dh, dw = torch.empty_like(hid), torch.empty_like(w)
    fo = fusedce.linear_cross_entropy_fwd(hid, w, t, reduction="none", entropy=True, logit_scale=s)

    def step(fn, grads):
        def run():
            hl, wl = hid.detach().requires_grad_(True), w.detach().requires_grad_(True)
            torch.autograd.backward(fn(hl, wl), grads)
        return run

    variants = {
        "torch: linear_cross_entropy none, fwd+bwd": step(
            lambda h_, w_: (ft.linear_cross_entropy(h_, w_, t, reduction="none", logit_scale=s),), (gl,)),
        "torch: linear_logprobs_entropy, fwd+bwd": step(
            lambda h_, w_: ft.linear_logprobs_entropy(h_, w_, t, T), (-gl, ge)),
        "torch: logprobs_entropy(h @ w.T), fwd+bwd (bf16 logits kept)": step(
            lambda h_, w_: ft.logprobs_entropy(h_ @ w_.T, t, T), (-gl, ge)),
        "torch.compile of the same math, fwd+bwd": step(
            torch.compile(lambda h_, w_: reference_math(h_ @ w_.T, t, T), dynamic=False), (-gl, ge)),
        "C fwd, loss + lse": lambda: fusedce.linear_cross_entropy_fwd(hid, w, t, reduction="none", logit_scale=s),
        "C fwd, + entropy": lambda: fusedce.linear_cross_entropy_fwd(hid, w, t, reduction="none", entropy=True,
                                                                     logit_scale=s),
        "C bwd, grad_loss": lambda: fusedce.linear_cross_entropy_bwd(
            hid, w, t, fo.lse, dhidden=dh, dweight=dw, grad_loss=gl, reduction="none", logit_scale=s),
        "C bwd, + grad_entropy": lambda: fusedce.linear_cross_entropy_bwd(
            hid, w, t, fo.lse, dhidden=dh, dweight=dw, grad_loss=gl, grad_entropy=ge, entropy=fo.entropy,
            reduction="none", logit_scale=s),
    }
    for fn in variants.values():  # warm-up (and torch's first-call costs)
        fn()
        fn()
    times = {k: [] for k in variants}
    for _ in range(a.rounds):
        for k, fn in variants.items():
            times[k].append(once(fn))
    print("%s, N=%d H=%d V=%d T=%g, %d interleaved rounds" % (torch.cuda.get_device_name(), N, H, V, T, a.rounds))
    print("| variant | median ms | min | max |\n|---|---|---|---|")
    med = {}
    for k, v in times.items():
        med[k] = statistics.median(v)
        print("| %s | %.2f | %.2f | %.2f |" % (k, med[k], min(v), max(v)))
    keys = list(variants)
    for a_, b_ in ((keys[1], keys[0]), (keys[5], keys[4]), (keys[7], keys[6]), (keys[1], keys[3]), (keys[2], keys[3])):
        print("(%s) / (%s): %.3f" % (a_, b_, med[a_] / med[b_]))
    print("C sum (fwd + entropy, bwd + grad_entropy) %.2f vs torch path %.2f" % (med[keys[5]] + med[keys[7]],
                                                                               med[keys[1]]))


if __name__ == "__main__":
    main()
