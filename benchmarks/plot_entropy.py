"""The plot of benchmarks/bench_entropy.py's --json output for docs/benchmarks.md (needs matplotlib).

    python3 benchmarks/plot_entropy.py OUT.svg FILE.json

Two panels of horizontal bars (ms, shorter is better): the [N, V] logits (the copy floor, the C calls, the
PyTorch path and its peers) and linear log-prob + entropy from hidden states (the GEMM floor, linear
cross-entropy, the log-prob + entropy paths, torch.compile).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    out, path = sys.argv[1], sys.argv[2]
    doc = json.load(open(path))
    rows = [r for r in doc["rows"] if r["ms"] == r["ms"]]  # drop n/a (NaN) rows
    panels = [("logits [N, V]", [r for r in rows if r["group"] in ("floor", "C", "PyTorch")
                                 and "eager" not in r["name"]]),
              ("from hidden states", [r for r in rows if r["group"] == "linear" and not r["name"].startswith("C ")])]
    fig, axes = plt.subplots(2, 1, figsize=(9, 6.4), gridspec_kw=dict(height_ratios=[len(p[1]) for p in panels]))
    for ax, (title, rs) in zip(axes, panels):
        names = [r["name"].replace(" fwd+bwd", "") for r in rs]
        colors = ["#888888" if r["group"] == "floor" or r["name"].startswith("cuBLAS") else
                  "#d62728" if "torch" in r["name"] and "fusedce" not in r["name"] else "#1f77b4" for r in rs]
        ax.barh(range(len(rs)), [r["ms"] for r in rs], color=colors)
        ax.set_yticks(range(len(rs)), names, fontsize=8)
        ax.invert_yaxis()
        for i, r in enumerate(rs):
            ax.text(r["ms"], i, " %.2f" % r["ms"], va="center", fontsize=7)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms (forward + backward where named)", fontsize=8)
    info = doc["info"]
    fig.suptitle("log-prob + entropy, N=%d V=%d H=%d bf16, T=%g, %s" % (
        info["tokens"], info["vocab"], info["hidden"], info["temperature"], info["device"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
