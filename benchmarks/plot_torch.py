"""Plots of bench_torch.py's JSON results for docs/benchmarks.md (needs matplotlib: pip install matplotlib).

    python3 benchmarks/plot_torch.py OPS.json HOST.json OUT_PREFIX
writes OUT_PREFIX-autograd.svg (forward + backward ms per implementation and op, memory beside each bar)
and OUT_PREFIX-host.svg (host µs per call against the PyTorch op replaced).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

IMPLS = ["torch eager", "torch.compile", "liger-kernel", "cut-cross-entropy", "fusedce", "fusedce in-place",
         "C call (fused)", "C fwd + bwd"]
OPS = {"ce": "cross-entropy 8192×128256", "kd": "KD forward KL, T=2", "linear_ce": "linear CE H=4096"}


def autograd(doc, path):
    rows = [r for r in doc["rows"] if r.get("ms")]
    ops = [op for op in OPS if any(r["op"] == op for r in rows)]
    fig, axes = plt.subplots(1, len(ops), figsize=(4.2 * len(ops), 3.6))
    for ax, op in zip(axes, ops):
        mine = {r["impl"]: r for r in rows if r["op"] == op}
        names = [i for i in IMPLS if i in mine]
        ms = [mine[i]["ms"] for i in names]
        colors = ["#4c72b0" if i.startswith(("fusedce", "C ")) else "#999999" for i in names]
        bars = ax.barh(names, ms, color=colors)
        for b, i in zip(bars, names):
            ax.text(b.get_width(), b.get_y() + b.get_height() / 2, " %.2f ms, +%.0f MiB" % (
                mine[i]["ms"], mine[i]["peak_mib"]), va="center", fontsize=7)
        ax.set_title(OPS[op], fontsize=9)
        ax.set_xlim(0, max(ms) * 1.9)
        ax.invert_yaxis()
        ax.tick_params(labelsize=7)
        ax.set_xlabel("forward + backward, ms", fontsize=8)
    fig.suptitle("PyTorch autograd vs the library's C calls, %s, torch %s, bf16" % (doc["device"], doc["torch"]),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


def host(doc, path):
    rows = [r for r in doc["host"] if "array_us" in r]
    labels = ["%s\n%s" % (r["call"].replace(", T per row, fp32 out", ""), r["shape"]) for r in rows]
    fig, ax = plt.subplots(figsize=(9, 3.8))
    y = range(len(rows))
    h = 0.27
    ax.barh([k - h for k in y], [r["torch_us"] for r in rows], h, label="fusedce.torch", color="#4c72b0")
    ax.barh(list(y), [r["array_us"] or 0 for r in rows], h, label="array API (fusedce.ops)", color="#8fb0d8")
    ax.barh([k + h for k in y], [r["ref_us"] for r in rows], h, label="the PyTorch op replaced", color="#999999")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("host µs per call (enqueue only, median of 400)", fontsize=8)
    ax.legend(fontsize=7)
    ax.set_title("Host cost per call, %s, torch %s" % (doc["device"], doc["torch"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    ops_json, host_json, prefix = sys.argv[1:4]
    autograd(json.load(open(ops_json)), prefix + "-autograd.svg")
    host(json.load(open(host_json)), prefix + "-host.svg")
