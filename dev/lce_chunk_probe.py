"""Linear cross-entropy fwd+bwd (loss, dhidden, dweight; bf16) through the library at chosen chunk sizes: a
caller's workspace of C rows of padded logits plus 1 MiB makes the library cut N into equal chunks of at
most about C tokens (src/cuda/linear_ce.cu chunk_rows). Prints ms per call for each C (median of 5).
Measured on an H100 (2026-11-26): the time moves by up to 25 % with C, not monotonically (cuBLAS picks
other kernels per chunk shape); one chunk of all 16384 rows at V=151936 took 87.4 ms, 1280-row chunks
93.1-93.4 ms, the default 1536-row chunks 97.8-102.6 ms, while at 8192x128256 1280-row chunks were 1.8 %
slower than the default 1664.

    python3 dev/lce_chunk_probe.py N H V C[,C...]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bindings", "python"))
import torch  # noqa: E402

import fusedce  # noqa: E402

n, h, v = (int(x) for x in sys.argv[1:4])
cs = [int(c) for c in sys.argv[4].split(",")]
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


print("N=%d H=%d V=%d" % (n, h, v))
for c in cs:
    ws = torch.empty(c * per_row + (1 << 20), dtype=torch.uint8, device="cuda")

    def call():
        fusedce.linear_cross_entropy_fwd(hid, w, t, dhidden=dh, dweight=dw, lse=False, workspace=ws)

    call()
    torch.cuda.synchronize()
    ms = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    print("  C<=%d (chunks of %d): %.2f ms" % (c, chunk_rows(n, c + 2**20 // per_row), sorted(ms)[2]))
