"""Probe: where the host time of one fusedce.torch call goes (enqueue only, median µs), piece by piece, on the
current CUDA device. Not a benchmark (benchmarks/bench_torch.py --host is); run with FUSEDCE_LIBRARY set."""
import statistics
import time

import torch

import fusedce
import fusedce.torch as ft
from fusedce import _fast
from fusedce._lib import ffi, lib


def us(f, n=400):
    """Within the launch queue (n calls of at most two launches): enqueue time, not GPU throughput."""
    for _ in range(50):
        f()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(ts) * 1e6


n, v = 16, 151936
x = (torch.randn(n, v, device="cuda") * 3).to(torch.bfloat16)
xg = x.clone().requires_grad_()
t = torch.randint(0, v, (n,), device="cuda")
loss, lse = torch.empty((), device="cuda"), torch.empty(n, device="cuda")
_fast._tables()
dev = _fast._device(x)
dt, di = dev[2], dev[3]
a_x, a_t = _fast._dl(0, x, dt, di), _fast._dl(1, t, dt, di)
o = _fast._ce_options(None, 1, -100, 0.0, 0.0, 0.0, 1.0, dev)
out = _fast._CE_OUTPUTS(_fast._at(3, loss, dt, di), 0, 0, 0, 0, 0, 0)
lo = _fast._LSE_OPTIONS(1.0)
a_l = _fast._dl(2, lse, dt, di)
rows = [
    ("empty launch (torch.cuda._sleep(0))", lambda: torch.cuda._sleep(0)),
    ("torch.empty((16,), f32, cuda)", lambda: torch.empty((n,), dtype=torch.float32, device=x.device)),
    ("_device", lambda: _fast._device(x)),
    ("_dl", lambda: _fast._dl(0, x, dt, di)),
    ("lib.fce_logsumexp (C only)", lambda: lib.fce_logsumexp(dev[0], dev[1], a_x, lo, a_l, ffi.NULL, 0)),
    ("lib.fce_cross_entropy_fwd mean (C only)",
     lambda: lib.fce_cross_entropy_fwd(dev[0], dev[1], a_x, a_t, o, out, ffi.NULL, 0)),
    ("_fast.cross_entropy_fwd", lambda: _fast.cross_entropy_fwd(x, t, None, 1, -100, 0., 0., 0., 1., False, False,
                                                                False, False)),
    ("ft.cross_entropy no grad", lambda: ft.cross_entropy(x, t)),
    ("ft.cross_entropy grad", lambda: ft.cross_entropy(xg, t)),
    ("F.cross_entropy grad", lambda: torch.nn.functional.cross_entropy(xg, t)),
]
for name, f in rows:
    print("| %s | %.1f |" % (name, us(f)))
