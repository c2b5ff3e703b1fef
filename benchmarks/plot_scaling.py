"""Scaling curves of the vocabulary-parallel losses from `vp_nccl --bench` logs (tests/multi/run_vp_nccl.sh
PROGRAM W --bench, one log per number of ranks): each `@result {json}` line is one rank's timing; a step takes
its slowest rank's time. For CE forward, CE forward + dlogits, KD forward KL (8192 rows) and linear CE
forward + backward: per-rank time, efficiency against the one-GPU fused call over V in the same run (strong:
t_1 / (W * t_W) with V split; weak: t_1 / t_W with V_local = V on every rank) and the record exchange's
share. With --torch, bench_vp.py JSON files (Liger-Kernel's vocab-parallel CE and fusedce through PyTorch)
add their forward + backward per rank. Prints a markdown table; --svg draws the efficiency curves and
--json writes the aggregated data.

    python3 benchmarks/plot_scaling.py LOG... [--torch JSON...] [--svg FILE] [--json FILE]
"""
import argparse
import json
import re

# (label, op, what): the curves
CURVES = [("CE forward", "ce", "fwd"), ("CE forward + dlogits", "ce", "fwd_dlogits"),
          ("KD forward KL (8192 rows)", "kd", "fwd"), ("linear CE forward + backward", "linear_ce", "fwd_bwd")]


def load(paths):
    """{(ranks, op, scaling, what, N): slowest rank's value}"""
    worst = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                m = re.search(r"@result (\{.*\})", line)
                if not m:
                    continue
                r = json.loads(m.group(1))
                key = (r["ranks"], r["op"], r["scaling"], r["what"], r["N"])
                worst[key] = max(worst.get(key, 0.0), r["ms"])
    return worst


def series(worst):
    """Per curve and scaling: [(ranks, ms, efficiency)], and the exchange's share per number of ranks."""
    out = {}
    ranks = sorted({k[0] for k in worst})
    for label, op, what in CURVES:
        n = 8192
        for sc in ("strong", "weak"):
            pts = []
            for w in ranks:
                t = worst.get((w, op, sc, what, n))
                one = worst.get((w, op, "one", what, n))
                if t is None or one is None:
                    continue
                eff = one / (w * t) if sc == "strong" else one / t
                pts.append(dict(ranks=w, ms=t, one_gpu_ms=one, efficiency=eff))
            out["%s, %s" % (label, sc)] = pts
    share = {}
    for w in ranks:
        ag = worst.get((w, "exchange", "-", "all_gather_k4", 8192))
        fwd = worst.get((w, "ce", "strong", "fwd", 8192))
        if ag is not None and fwd:
            share[w] = dict(all_gather_us=ag * 1e3, share_of_ce_forward=ag / fwd,
                            all_gather_k7_us=worst.get((w, "exchange", "-", "all_gather_k7", 8192), 0) * 1e3)
    return out, share


def torch_rows(paths):
    rows = []
    for path in paths:
        doc = json.load(open(path))
        best = {}
        for r in doc["rows"]:
            key = (doc["world"], r["scaling"], r["impl"])
            best[key] = max(best.get(key, 0.0), r["ms"])
        rows += [dict(ranks=k[0], scaling=k[1], impl=k[2], ms=v) for k, v in sorted(best.items())]
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--torch", nargs="*", default=[])
    ap.add_argument("--svg")
    ap.add_argument("--json")
    ap.add_argument("--title", default="")
    args = ap.parse_args()
    worst = load(args.logs)
    curves, share = series(worst)
    print("| curve | ranks | per-rank ms (slowest rank) | one GPU ms | efficiency |")
    print("|---|---|---|---|---|")
    for name, pts in curves.items():
        for p in pts:
            print("| %s | %d | %.3f | %.3f | %.0f %% |" % (name, p["ranks"], p["ms"], p["one_gpu_ms"],
                                                      100 * p["efficiency"]))
    print()
    print("| ranks | all-gather of [8192, 4] records (µs) | [8192, 7] (µs) | share of the strong CE forward |")
    print("|---|---|---|---|")
    for w, s in sorted(share.items()):
        print("| %d | %.1f | %.1f | %.0f %% |" % (w, s["all_gather_us"], s["all_gather_k7_us"],
                                                 100 * s["share_of_ce_forward"]))
    trows = torch_rows(args.torch)
    if trows:
        print()
        print("| ranks | scaling | implementation (PyTorch, forward + backward) | ms per rank (slowest) |")
        print("|---|---|---|---|")
        for r in trows:
            print("| %d | %s | %s | %.3f |" % (r["ranks"], r["scaling"], r["impl"], r["ms"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(curves=curves, exchange=share, torch=trows), f, indent=1)
    if args.svg:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
        for ax, sc in zip(axes, ("strong", "weak")):
            for label, _, _ in CURVES:
                pts = curves.get("%s, %s" % (label, sc), [])
                if pts:
                    ax.plot([p["ranks"] for p in pts], [100 * p["efficiency"] for p in pts], marker="o", label=label)
            ax.set_title("%s scaling (V = 128256%s)" % (sc, " split" if sc == "strong" else " per rank"))
            ax.set_xlabel("ranks (GPUs)")
            ax.set_xticks(sorted({p["ranks"] for v in curves.values() for p in v}))
            ax.grid(alpha=0.3)
        axes[0].set_ylabel("efficiency vs one GPU's fused call (%)")
        axes[0].set_ylim(0, 110)
        axes[1].legend(fontsize=8, loc="lower left")
        if args.title:
            fig.suptitle(args.title, fontsize=10)
        fig.tight_layout()
        fig.savefig(args.svg)


if __name__ == "__main__":
    main()
