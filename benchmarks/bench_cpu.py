#!/usr/bin/env python3
"""libfusedce's CPU backend against PyTorch eager on the CPU, in one process per thread count.

    python3 benchmarks/bench_cpu.py                                   # 1024 x 32000, 1 and 2 threads, fp32 and bf16
    python3 benchmarks/bench_cpu.py --rows 256 --vocab 128256 --threads 1 --dtypes bf16 --json out.json

For each thread count a child process runs with OMP_NUM_THREADS (the library's OpenMP) and
torch.set_num_threads set to it. Each op is timed as the median wall time of --iters calls after a warm-up,
the implementations taking turns call by call; the same run times a copy of the logits (x.clone(), the
memory-bound floor) and checks every result against PyTorch in float64.

Ops, on logits [rows, vocab], mean reduction:
  ce       cross-entropy loss, no gradient: F.cross_entropy / fusedce.ops.cross_entropy_fwd (loss and lse)
  ce_grad  loss and gradient: F.cross_entropy + backward / the fused C call (dlogits=True) / fusedce.torch
           autograd (cross_entropy + backward)
  ce_bwd   the backward alone: torch.autograd.grad over a recorded graph / fusedce.ops.cross_entropy_bwd
  lse      torch.logsumexp / fusedce.ops.logsumexp (fp32 out)
  softmax  torch.softmax(x / T) in the logits' dtype / fusedce.ops.temp_softmax (same dtype), T = 0.7
  kd       forward KL at T = 2 (T^2-scaled batchmean), loss and student gradient: F.kl_div over
           log_softmax + backward / fusedce.ops.kd_loss(dstudent=True)
Prints a markdown table (ms, the speedup over PyTorch); --json writes the rows; --plot FILE.svg draws
PyTorch's time over the library's per op (needs matplotlib).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
OPS = ["ce", "ce_grad", "ce_bwd", "lse", "softmax", "kd"]


def child(args):
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bindings", "python"))
    import fusedce.ops as fo
    import fusedce.torch as ft

    torch.set_num_threads(args.threads)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    N, V, T = args.rows, args.vocab, 0.7
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(N, V, generator=g) * 2).to(dt)
    xt = (torch.randn(N, V, generator=g) * 2).to(dt)
    tg = torch.randint(0, V, (N,), generator=g)
    x64, xt64 = x.double(), xt.double()

    def ce_torch_grad():
        xg = x.detach().requires_grad_()
        loss = F.cross_entropy(xg, tg)
        loss.backward()
        return loss, xg.grad

    def ce_fusedce_torch():
        xg = x.detach().requires_grad_()
        loss = ft.cross_entropy(xg, tg)
        loss.backward()
        return loss, xg.grad

    xr = x.detach().requires_grad_()
    loss_r = F.cross_entropy(xr, tg)
    lse_saved = fo.logsumexp(x)

    def kd_torch():
        s = x.detach().requires_grad_()
        loss = F.kl_div(F.log_softmax(s / 2, -1), F.log_softmax(xt / 2, -1), log_target=True,
                        reduction="batchmean") * 4
        loss.backward()
        return loss, s.grad

    impls = {
        "ce": {"torch": lambda: (F.cross_entropy(x, tg), None),
               "fusedce C": lambda: (fo.cross_entropy_fwd(x, tg).loss, None)},
        "ce_grad": {"torch": ce_torch_grad,
                    "fusedce C": lambda: (lambda o: (o.loss, o.dlogits))(fo.cross_entropy_fwd(x, tg, dlogits=True)),
                    "fusedce.torch": ce_fusedce_torch},
        "ce_bwd": {"torch": lambda: (None, torch.autograd.grad(loss_r, xr, retain_graph=True)[0]),
                   "fusedce C": lambda: (None, fo.cross_entropy_bwd(x, tg, lse_saved))},
        "lse": {"torch": lambda: (torch.logsumexp(x, -1), None),
                "fusedce C": lambda: (fo.logsumexp(x), None)},
        "softmax": {"torch": lambda: (None, torch.softmax(x / T, -1)),
                    "fusedce C": lambda: (None, fo.temp_softmax(x, temperature=T, dtype=None).probs)},
        "kd": {"torch": kd_torch,
               "fusedce C": lambda: (lambda o: (o.loss, o.dstudent))(
                   fo.kd_loss(x, xt, temperature=2.0, scale_by_t2=True, dstudent=True))},
    }

    # float64 references
    lse64 = torch.logsumexp(x64, -1)
    p64 = torch.softmax(x64, -1)
    ce64 = (lse64 - x64.gather(1, tg[:, None])[:, 0]).mean()
    dce64 = (p64 - F.one_hot(tg, V).double()) / N
    lq, lp = torch.log_softmax(x64 / 2, -1), torch.log_softmax(xt64 / 2, -1)
    kd64 = (lp.exp() * (lp - lq)).sum() / N * 4
    dkd64 = (lq.exp() - lp.exp()) * 2 / N
    ref = {"ce": (ce64, None), "ce_grad": (ce64, dce64), "ce_bwd": (None, dce64), "lse": (lse64, None),
           "softmax": (None, torch.softmax(x64 / T, -1)), "kd": (kd64, dkd64)}

    def err(got, want):
        if want is None or got is None:
            return None
        return float(((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item())

    copy = []
    for _ in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        x.clone()
        copy.append(time.perf_counter() - t0)
    copy_ms = statistics.median(copy[args.warmup:]) * 1e3
    rows = []
    for op in args.ops:
        times = {k: [] for k in impls[op]}
        for it in range(args.warmup + args.iters):
            for name, fn in impls[op].items():
                t0 = time.perf_counter()
                fn()
                if it >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
        base = statistics.median(times["torch"])
        for name, fn in impls[op].items():
            loss, grad = fn()
            t = statistics.median(times[name])
            rows.append({"op": op, "impl": name, "dtype": args.dtype, "threads": args.threads, "rows": N, "vocab": V,
                         "ms": t * 1e3, "speedup": base / t, "copy_ms": copy_ms,
                         "loss_err": err(loss, ref[op][0]), "grad_err": err(grad, ref[op][1])})
    print(json.dumps(rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.ops = args.ops.split(",")
    if args.child:
        args.threads = int(args.threads)
        return child(args)
    rows = []
    for th in args.threads.split(","):
        for dt in args.dtypes.split(","):
            env = dict(os.environ, OMP_NUM_THREADS=th)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--threads", th, "--dtype", dt,
                   "--rows", str(args.rows), "--vocab", str(args.vocab), "--ops", ",".join(args.ops),
                   "--iters", str(args.iters), "--warmup", str(args.warmup)]
            out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
            rows += json.loads(out.strip().splitlines()[-1])
    import torch
    print(f"CPU: {cpu_name()}, torch {torch.__version__}, {args.rows} x {args.vocab}, median of {args.iters}")
    print("| op | dtype | threads | copy ms | torch ms | fusedce C ms | fusedce.torch ms | C speedup | max rel. err C / torch |")
    print("|---|---|---|---|---|---|---|---|---|")
    key = lambda r: (r["op"], r["dtype"], r["threads"])  # noqa: E731
    groups = {}
    for r in rows:
        groups.setdefault(key(r), {})[r["impl"]] = r
    for (op, dt, th), g in groups.items():
        def e(r):
            v = [x for x in (r["loss_err"], r["grad_err"]) if x is not None]
            return f"{max(v):.1e}" if v else "-"
        ft = f"{g['fusedce.torch']['ms']:.1f}" if "fusedce.torch" in g else "-"
        print(f"| {op} | {dt} | {th} | {g['torch']['copy_ms']:.1f} | {g['torch']['ms']:.1f} | {g['fusedce C']['ms']:.1f} "
              f"| {ft} | {g['fusedce C']['speedup']:.2f}x | {e(g['fusedce C'])} / {e(g['torch'])} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": cpu_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)
    if args.plot:
        plot(groups, args, args.plot)


def plot(groups, args, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(dt, th) for (_, dt, th) in groups}, key=lambda c: (c[0], c[1]))
    ops = [op for op in args.ops if any(k[0] == op for k in groups)]
    fig, ax = plt.subplots(figsize=(7.5, 3.6))
    w = 0.8 / len(configs)
    for k, (dt, th) in enumerate(configs):
        ys = [groups[(op, dt, th)]["fusedce C"]["speedup"] if (op, dt, th) in groups else 0 for op in ops]
        ax.bar([i + k * w for i in range(len(ops))], ys, w, label=f"{dt}, {th} thread{'s' if th > 1 else ''}")
    ax.axhline(1.0, color="#444444", lw=0.8)
    ax.set_xticks([i + w * (len(configs) - 1) / 2 for i in range(len(ops))], ops)
    ax.set_ylabel("PyTorch eager time / libfusedce time")
    ax.set_title(f"CPU backend vs PyTorch eager, {args.rows}×{args.vocab}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def cpu_name():
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
