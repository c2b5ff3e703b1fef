#!/usr/bin/env python3
"""What each optional output costs the cross-entropy forward (no gradient) on the GPU: fusedce.cross_entropy_fwd
over [N, V] bf16 logits with the loss alone, then with lse, argmax, entropy, label smoothing, each alone, and
the copy floor; event-timed medians after an L2 flush. Also under FCE_FORCE_PATH values given as arguments
(run one process per value: the planner reads the variable per call).

    FUSEDCE_LIBRARY=... python3 dev/probe_ce_forward_outputs.py [--tokens N] [--vocab V] [--hidden H]
"""
import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bindings", "python"))
import torch  # noqa: E402

import fusedce  # noqa: E402


def timed(fn, iters=15):
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        fn()
    ts = []
    for _ in range(iters):
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=0, help="linear cross-entropy's forward from [N, H] instead")
    a = ap.parse_args()
    x = (torch.randn(a.tokens, a.vocab, device="cuda") * 2).to(torch.bfloat16)
    t = torch.randint(0, a.vocab, (a.tokens,), device="cuda")
    d = torch.empty_like(x)
    print("FCE_FORCE_PATH=%s" % os.environ.get("FCE_FORCE_PATH", ""))
    print("%-40s %8.3f ms" % ("copy (read + write)", timed(lambda: d.copy_(x))))
    if a.hidden:
        h = torch.randn(a.tokens, a.hidden, device="cuda").to(torch.bfloat16)
        w = (torch.randn(a.vocab, a.hidden, device="cuda") * a.hidden ** -0.5).to(torch.bfloat16)
        lg = torch.empty(a.tokens, a.vocab, device="cuda", dtype=torch.bfloat16)
        print("%-40s %8.3f ms" % ("GEMM h @ w.T", timed(lambda: torch.mm(h, w.T, out=lg))))
        del lg
        for name, kw in [("linear: loss (none)", dict(reduction="none")),
                         ("linear: loss + entropy (none)", dict(reduction="none", entropy=True)),
                         ("linear: loss + argmax (none)", dict(reduction="none", argmax=True)),
                         ("linear: loss, scale 1/0.7 (none)", dict(reduction="none", logit_scale=1 / 0.7)),
                         ("linear: + entropy, scale 1/0.7", dict(reduction="none", entropy=True, logit_scale=1 / 0.7))]:
            print("%-40s %8.3f ms" % (name, timed(lambda kw=kw: fusedce.linear_cross_entropy_fwd(h, w, t, **kw), 7)))
        return
    for name, kw in [("loss", dict(lse=False)), ("loss + lse", {}), ("loss + argmax", dict(lse=False, argmax=True)),
                     ("loss + entropy", dict(lse=False, entropy=True)),
                     ("loss, label smoothing 0.1", dict(lse=False, label_smoothing=0.1)),
                     ("loss, softcap 30", dict(lse=False, softcap=30.0))]:
        print("%-40s %8.3f ms" % (name, timed(lambda kw=kw: fusedce.cross_entropy_fwd(x, t, **kw))))


if __name__ == "__main__":
    main()
