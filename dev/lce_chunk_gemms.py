"""Throughput of linear CE's three chunk GEMMs (cuBLAS through torch.matmul, bf16) against the chunk's
token count, for choosing chunk sizes: logits = h_c @ W^T, dhidden = dl_c @ W, dweight += dl_c^T @ h_c
(beta = 1, bf16 output).

    python3 dev/lce_chunk_gemms.py H V rows[,rows...]
"""
import sys

import torch

h, v = int(sys.argv[1]), int(sys.argv[2])
rows = [int(r) for r in sys.argv[3].split(",")]
n = max(rows)
a = torch.randn(n, h, device="cuda").to(torch.bfloat16)
w = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
g = (torch.randn(n, v, device="cuda") * 1e-3).to(torch.bfloat16)
dw = torch.zeros(v, h, device="cuda", dtype=torch.bfloat16)
out = torch.empty(n, v, device="cuda", dtype=torch.bfloat16)
dh = torch.empty(n, h, device="cuda", dtype=torch.bfloat16)


def t(fn, it=10):
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ms = []
    for _ in range(it):
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        ms.append(s.elapsed_time(e))
    return sorted(ms)[len(ms) // 2]


print("H=%d V=%d: TFLOP/s of each GEMM, and ms for N=8192 tokens in chunks of that size" % (h, v))
print("| rows | logits | dhidden | dweight (+=) | three GEMMs, 8192 tokens, ms |")
print("|---|---|---|---|---|")
for r in rows:
    f = 2.0 * r * h * v / 1e9
    m1 = t(lambda: torch.matmul(a[:r], w.T, out=out[:r]))
    m2 = t(lambda: torch.matmul(g[:r], w, out=dh[:r]))
    m3 = t(lambda: dw.addmm_(g[:r].T, a[:r]))
    print("| %d | %.0f | %.0f | %.0f | %.2f |" % (r, f / m1, f / m2, f / m3, (m1 + m2 + m3) * 8192 / r))
