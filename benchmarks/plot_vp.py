"""The plot of benchmarks/bench_vp.py's --json output for docs/benchmarks.md (needs matplotlib).

    python3 benchmarks/plot_vp.py OUT.svg FILE.json

One group of bars per scaling (strong: V split over the ranks; weak: V per rank; or --linear's one group),
one bar per implementation: forward + backward per rank in ms (the ranks' mean), the fused one-GPU call as
a line.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    out, path = sys.argv[1], sys.argv[2]
    doc = json.load(open(path))
    rows = doc["rows"]
    impls = []
    for r in rows:
        if r["scaling"] != "one GPU" and r["impl"] not in impls:
            impls.append(r["impl"])
    mean = {}
    for r in rows:
        mean.setdefault((r["scaling"], r["impl"]), []).append(r["ms"])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    width = 0.8 / len(impls)
    scalings = []
    for r in rows:
        if r["scaling"] != "one GPU" and r["scaling"] not in scalings:
            scalings.append(r["scaling"])
    for i, impl in enumerate(impls):
        xs, ys = [], []
        for j, sc in enumerate(scalings):
            v = mean.get((sc, impl))
            if v:
                xs.append(j + (i - (len(impls) - 1) / 2) * width)
                ys.append(sum(v) / len(v))
        bars = ax.bar(xs, ys, width, label=impl)
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    one = [r["ms"] for r in rows if r["scaling"] == "one GPU"]
    if one:
        ax.axhline(sum(one) / len(one), color="gray", ls="--", lw=1,
                   label="fusedce on one GPU, whole V (%.2f ms)" % (sum(one) / len(one)))
    n = rows[0]["n"]

    def label(sc):
        r = next(r for r in rows if r["scaling"] == sc)
        if sc == "strong":
            return "strong: V=%d split over %d" % (r["v"], doc["world"])
        if sc == "weak":
            return "weak: V=%d per rank" % r["v_local"]
        return "%s: V=%d split over %d" % (sc, r["v"], doc["world"])

    ax.set_xticks(list(range(len(scalings))), [label(sc) for sc in scalings])
    linear = any(sc.startswith("linear") for sc in scalings)
    ax.set_ylabel("forward + backward per rank, ms")
    ax.set_title("Vocabulary-parallel %scross-entropy, N=%d bf16, %s x %d (PyTorch path)" % (
        "linear " if linear else "", n, doc["device"], doc["world"]), fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
