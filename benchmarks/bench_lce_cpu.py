#!/usr/bin/env python3
"""Linear cross-entropy on the CPU, forward + backward: libfusedce's CPU backend against PyTorch eager.

    python3 benchmarks/bench_lce_cpu.py                                # three shapes, fp32 and bf16, 2 threads
    python3 benchmarks/bench_lce_cpu.py --shapes 1024x768x32000 --threads 1,2 --json out.json
    python3 benchmarks/bench_lce_cpu.py --lib old=/tmp/old/libfusedce.so --lib new=build/libfusedce.so

Shapes are N x H x V (tokens, hidden size, vocabulary); mean reduction, no bias. For each thread count and
dtype a child process runs with OMP_NUM_THREADS set (the library's OpenMP and its BLAS calls) and
torch.set_num_threads. The implementations take turns call by call; each is timed as the median wall time of
--iters calls after --warmup:
  torch      logits = hidden @ weight.T, F.cross_entropy(logits, targets), loss.backward(): loss, dhidden,
             dweight
  fused      fusedce.ops.linear_cross_entropy_fwd(dhidden=True, dweight=True): one call, the gradients formed
             in the forward
  fwd+bwd    linear_cross_entropy_fwd (loss + lse), then linear_cross_entropy_bwd from that lse
--check compares each result's loss and dhidden with float64 (two float64 GEMMs per shape: slow).
--lib LABEL=PATH (repeated) runs each library build in its own child (FUSEDCE_LIBRARY=PATH), one after the
other for each shape, dtype and thread count, PyTorch timed again in each: builds compared in one run.
Prints a markdown table; --json writes the rows.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(args):
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "bindings", "python"))
    import fusedce.ops as fo

    torch.set_num_threads(args.threads)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    N, H, V = (int(x) for x in args.shape.split("x"))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dt)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(dt)
    targets = torch.randint(0, V, (N,), generator=g)

    def run_torch():
        h = hidden.detach().requires_grad_()
        w = weight.detach().requires_grad_()
        loss = F.cross_entropy(h @ w.T, targets)
        loss.backward()
        return loss, h.grad

    def run_fused():
        o = fo.linear_cross_entropy_fwd(hidden, weight, targets, lse=False, dhidden=True, dweight=True)
        return o.loss, o.dhidden

    def run_fwd_bwd():
        o = fo.linear_cross_entropy_fwd(hidden, weight, targets, lse=True)
        gr = fo.linear_cross_entropy_bwd(hidden, weight, targets, o.lse, dhidden=True, dweight=True)
        return o.loss, gr.dhidden

    impls = {"torch": run_torch, "fused": run_fused, "fwd+bwd": run_fwd_bwd}
    times = {k: [] for k in impls}
    for it in range(args.warmup + args.iters):
        for name, fn in impls.items():
            t0 = time.perf_counter()
            fn()
            if it >= args.warmup:
                times[name].append(time.perf_counter() - t0)
    errs = {}
    if args.check:
        h64, w64 = hidden.double(), weight.double()
        x = h64 @ w64.T
        lse = torch.logsumexp(x, -1)
        loss64 = (lse - x.gather(1, targets[:, None])[:, 0]).mean()
        p = torch.softmax(x, -1)
        p[torch.arange(N), targets] -= 1
        dh64 = (p / N) @ w64
        for name, fn in impls.items():
            loss, dh = fn()
            errs[name] = max(float((loss.double() - loss64).abs() / loss64.abs()),
                             float((dh.double() - dh64).abs().max() / dh64.abs().max()))
    rows = []
    base = statistics.median(times["torch"])
    for name in impls:
        t = statistics.median(times[name])
        rows.append({"impl": name, "dtype": args.dtype, "threads": args.threads, "shape": args.shape,
                     "ms": t * 1e3, "min_ms": min(times[name]) * 1e3, "max_ms": max(times[name]) * 1e3,
                     "torch_over_this": base / t, "err": errs.get(name)})
    print(json.dumps(rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="512x576x49152,1024x768x32000,2048x1024x32000")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--lib", action="append", default=[], metavar="LABEL=PATH")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.threads = int(args.threads)
        return child(args)
    libs = [tuple(x.split("=", 1)) for x in args.lib] or [("fusedce", None)]
    rows = []
    for shape in args.shapes.split(","):
        for th in args.threads.split(","):
            for dt in args.dtypes.split(","):
                for label, path in libs:
                    env = dict(os.environ, OMP_NUM_THREADS=th)
                    if path:
                        env["FUSEDCE_LIBRARY"] = os.path.abspath(path)
                    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--threads", th, "--dtype", dt,
                           "--shape", shape, "--iters", str(args.iters), "--warmup", str(args.warmup)]
                    if args.check:
                        cmd.append("--check")
                    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
                    got = json.loads(out.strip().splitlines()[-1])
                    for r in got:
                        r["lib"] = label
                    rows += got
    import torch
    print(f"CPU: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__}, median of {args.iters}")
    print("| N x H x V | dtype | threads | library | torch ms | fused ms | fwd+bwd ms | torch / fused | torch / fwd+bwd |"
          + (" max rel. err torch / fused / fwd+bwd |" if args.check else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if args.check else ""))
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["dtype"], r["threads"], r["lib"]), {})[r["impl"]] = r
    for (shape, dt, th, lib), g in groups.items():
        line = (f"| {shape} | {dt} | {th} | {lib} | {g['torch']['ms']:.1f} | {g['fused']['ms']:.1f} | {g['fwd+bwd']['ms']:.1f} "
                f"| {g['fused']['torch_over_this']:.2f}x | {g['fwd+bwd']['torch_over_this']:.2f}x |")
        if args.check:
            line += " " + " / ".join(f"{g[k]['err']:.1e}" for k in ("torch", "fused", "fwd+bwd")) + " |"
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"cpu": cpu_name(), "torch": torch.__version__, "rows": rows}, fh, indent=1)


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
