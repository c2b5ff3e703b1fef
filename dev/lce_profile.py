"""Where linear cross-entropy's forward + backward spends its GPU time, kernel by kernel (torch.profiler,
CUPTI: the library's cuBLAS GEMMs and its own kernels), once per mode (an FCE_FORCE_PATH value; "default"
leaves it unset; "compile" profiles torch.compile of the same loss), next to the three whole GEMMs of the same shape and chunked dweight GEMMs (K = rows per
chunk, beta = 1).

    python3 dev/lce_profile.py N H V mode[,mode...]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bindings", "python"))
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

n, h, v = (int(x) for x in sys.argv[1:4])
modes = sys.argv[4].split(",")
import fusedce.torch as ft  # noqa: E402

hid = torch.randn(n, h, device="cuda").to(torch.bfloat16).requires_grad_()
w = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, v, (n,), device="cuda")


def table(prof, title):
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = e.name[:90]
            c, tot = rows.get(k, (0, 0.0))
            rows[k] = (c + 1, tot + e.device_time_total if hasattr(e, "device_time_total") else tot + e.cuda_time_total)
    total = sum(x[1] for x in rows.values())
    print("## %s: %.2f ms of kernels per call" % (title, total / 1e3 / 3))
    for k, (c, tot) in sorted(rows.items(), key=lambda kv: -kv[1][1])[:12]:
        print("  %8.3f ms  %3d x  %s" % (tot / 1e3 / 3, c // 3, k))


def _compiled_loss(a, b, tt):
    return torch.nn.functional.cross_entropy((a @ b.T).float(), tt)


compiled = torch.compile(_compiled_loss)

for m in modes:
    run = lambda: ft.linear_cross_entropy(hid, w, t).backward()  # noqa: E731
    if m == "compile":  # torch.compile's kernels for the same call, as the peer
        run = lambda: compiled(hid, w, t).backward()  # noqa: E731
    elif m == "default":
        os.environ.pop("FCE_FORCE_PATH", None)
    else:
        os.environ["FCE_FORCE_PATH"] = m
    for _ in range(2):
        hid.grad = w.grad = None
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            hid.grad = w.grad = None
            run()
        torch.cuda.synchronize()
    table(prof, "fusedce, %s" % m)

a, b = hid.detach(), w.detach()
g = torch.randn(n, v, device="cuda").to(torch.bfloat16)
dw = torch.empty(v, h, device="cuda", dtype=torch.bfloat16)
for c in (0, 2048, 4096):
    def work():
        torch.matmul(a, b.T)
        torch.matmul(g, b)
        if c == 0:
            torch.matmul(g.T, a, out=dw)
        else:
            torch.matmul(g[:c].T, a[:c], out=dw)
            for r in range(c, n, c):
                dw.addmm_(g[r:r + c].T, a[r:r + c])
    work()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            work()
        torch.cuda.synchronize()
    table(prof, "torch: logits, dhidden GEMMs and dweight %s" % ("in one GEMM" if c == 0 else "in chunks of %d rows, bf16 accumulation" % c))
