"""Vocabulary-parallel cross-entropy on one GPU, one rank's share: the partial call over a shard of
[N, V/W] bf16 logits, the combine of W ranks' records (the other ranks' emulated by this one's), and the
shard's gradient from the combined lse; CUDA events, median of 20 calls, next to the unsharded fused call
(forward + dlogits) over the whole [N, V]. No communication: an all-gather of [W, N, 7] fp32 adds its own
time (docs/benchmarks.md; ../shared/docs/scale-out.md measured 15-23 µs for [8192, 3] on two H100s).

    python3 dev/vp_probe.py [N] [V] [W]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import fusedce  # noqa: E402
from lce_accuracy import timed as timed_median  # noqa: E402

args = sys.argv[1:4]
n, v, w = (int(a) for a in args + ["8192", "128256", "2"][len(args):])
vl = -(-v // w)
x = torch.randn(n, vl, device="cuda").to(torch.bfloat16)
t = torch.randint(0, v, (n,), device="cuda")
full = torch.randn(n, v, device="cuda").to(torch.bfloat16)


def timed(fn, reps=20):
    """Median ms of reps calls after one warm-up call."""
    fn()
    return timed_median(fn, reps)


rec = fusedce.cross_entropy_partial(x, t, vocab_start=0, vocab_total=v)
recs = rec.unsqueeze(0).repeat(w, 1, 1).contiguous()
out = fusedce.cross_entropy_combine(recs, t, vocab_total=v)
dl = torch.empty_like(x)
p = timed(lambda: fusedce.cross_entropy_partial(x, t, vocab_start=0, vocab_total=v, records=rec))
c = timed(lambda: fusedce.cross_entropy_combine(recs, t, vocab_total=v))
g = timed(lambda: fusedce.cross_entropy_bwd(x, t, out.lse, vocab_start=0, vocab_total=v, dlogits=dl))
dfull = torch.empty_like(full)
u = timed(lambda: fusedce.cross_entropy_fwd(full, t, dlogits=dfull))
gb = n * vl * 2 / 1e9
print("%s, N=%d V=%d W=%d (shard %d columns, bf16)" % (torch.cuda.get_device_name(), n, v, w, vl))
print("| step | ms | GB/s |")
print("|---|---|---|")
print("| partial (records) | %.3f | %.0f |" % (p, gb / p * 1e3))
print("| combine (W records) | %.3f | |" % c)
print("| shard gradient | %.3f | %.0f |" % (g, 2 * gb / g * 1e3))
print("| forward + dlogits per rank (no exchange) | %.3f | |" % (p + c + g))
print("| unsharded fused forward + dlogits, whole V | %.3f | %.0f |" % (u, 2 * n * v * 2 / 1e9 / u * 1e3))
