"""Linear cross-entropy fwd+bwd (loss, dhidden, dweight; bf16) through the library at chosen chunk sizes: a
caller's workspace of C rows of padded logits plus 1 MiB makes the library cut N into equal chunks of at
most about C tokens (src/cuda/linear_ce.cu chunk_rows). Prints ms per call for each C (median of 5).
Measurements: docs/benchmarks.md (linear cross-entropy) and the session notes.

    python3 dev/lce_chunk_probe.py N H V C[,C...] [ROUNDS]

Each round times every C, then torch.compile of F.cross_entropy((h @ w.T).float(), t) forward + backward and
one cuBLAS bf16 GEMM of the forward's shape (x3 = the three GEMMs at the in-run rate), so the rounds show the
noise.
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import torch  # noqa: E402

import fusedce  # noqa: E402
from lce_accuracy import timed as timed_median  # noqa: E402

n, h, v = (int(x) for x in sys.argv[1:4])
cs = [int(c) for c in sys.argv[4].split(",")]
rounds = int(sys.argv[5]) if len(sys.argv) > 5 else 1
hid = torch.randn(n, h, device="cuda").to(torch.bfloat16)
w = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
t = torch.randint(0, v, (n,), device="cuda")
dh = torch.empty_like(hid)
dw = torch.empty_like(w)
per_row = (v + 127) // 128 * 128 * 2


def chunk_rows(n, mx):
    chunks = -(-n // mx)
    c = -(-n // chunks)
    if c >= 256:
        up = -(-c // 128) * 128
        c = up if up <= mx else c // 128 * 128
    return c


def timed(fn, reps=5):
    """Median ms of reps calls after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    return timed_median(fn, reps)


ref = torch.compile(lambda h_, w_, t_: torch.nn.functional.cross_entropy((h_ @ w_.T).float(), t_))
hg, wg = hid.clone().requires_grad_(), w.clone().requires_grad_()


def compiled():
    hg.grad = wg.grad = None
    ref(hg, wg, t).backward()


print("N=%d H=%d V=%d" % (n, h, v))
for r in range(rounds):
    for c in cs:
        ws = torch.empty(c * per_row + (1 << 20), dtype=torch.uint8, device="cuda")
        ms = timed(lambda: fusedce.linear_cross_entropy_fwd(hid, w, t, dhidden=dh, dweight=dw, lse=False, workspace=ws))
        print("  C<=%d (chunks of %d): %.2f ms" % (c, chunk_rows(n, c + 2**20 // per_row), ms))
        del ws
    gemm = timed(lambda: hid @ w.T)
    print("  torch.compile: %.2f ms; 3 cuBLAS GEMMs %.2f ms (%.0f TFLOP/s)" % (timed(compiled), 3 * gemm,
                                                                          2 * n * h * v / gemm / 1e9))
