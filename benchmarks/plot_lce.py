"""Plot of linear cross-entropy's forward + backward for docs/benchmarks.md (needs matplotlib).

    python3 benchmarks/plot_lce.py AB.json ACCURACY.json OUT.svg
    python3 benchmarks/plot_lce.py --head-to-head H2H.json OUT.svg

AB.json: `bench_linear_ce --ab` runs gathered as {"runs": [<one --json output per shape>, ...]} (the C call
under each FCE_FORCE_PATH mode and the three whole cuBLAS GEMMs, interleaved rounds); ACCURACY.json:
`benchmarks/lce_accuracy.py --json` of the same device session (fusedce.torch and torch.compile, with the
extra memory of each). One panel per shape: ms per implementation, extra MiB beside the PyTorch bars.
H2H.json: `benchmarks/lce_accuracy.py --rounds R --json` (interleaved rounds); one panel per shape, forward +
backward and forward alone, each against its cuBLAS floor, with how many rounds fusedce led.
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"three whole cuBLAS GEMMs": "3 whole cuBLAS GEMMs (no CE)",
          "default": "C call",
          "lce_gemm:gemmex": "C call, cublasGemmEx (before)"}


def head_to_head(path, out):
    data = json.load(open(path))
    runs = data["head_to_head"]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.8 * len(runs), 3.0), squeeze=False)
    for ax, run in zip(axes[0], runs):
        ms = {r["variant"]: r["ms"] for r in run["rows"]}
        wins_b = sum(x < 1 for x in run["ratio_fwd_bwd"])
        wins_f = sum(x < 1 for x in run["ratio_forward"])
        bars = [("3 cuBLAS GEMMs (torch.matmul)", ms["three cuBLAS GEMMs (torch.matmul)"]),
                ("fusedce.torch, fwd+bwd", ms["fusedce.torch fwd+bwd"]),
                ("torch.compile, fwd+bwd", ms["torch.compile fwd+bwd"]),
                ("1 cuBLAS GEMM", ms["one GEMM, N x V x H"]),
                ("fusedce.torch, forward", ms["fusedce.torch forward"]),
                ("torch.compile, forward", ms["torch.compile forward"])]
        colors = ["#999999" if ("cuBLAS" in nm or "compile" in nm) else "#4c72b0" for nm, _ in bars]
        hb = ax.barh([b[0] for b in bars], [b[1] for b in bars], color=colors)
        for rect, b in zip(hb, bars):
            ax.text(rect.get_width(), rect.get_y() + rect.get_height() / 2, " %.1f" % b[1], va="center", fontsize=7)
        n, h, v = run["shape"]
        ax.set_title("N=%d H=%d V=%d\nfusedce ahead in %d/%d rounds (fwd+bwd), %d/%d (fwd)"
                     % (n, h, v, wins_b, run["rounds"], wins_f, run["rounds"]), fontsize=8)
        ax.set_xlabel("ms, median of %d interleaved rounds (less is better)" % run["rounds"], fontsize=8)
        ax.set_xlim(0, max(b[1] for b in bars) * 1.3)
        ax.invert_yaxis()
        ax.tick_params(labelsize=7)
    fig.suptitle("Linear cross-entropy through PyTorch, bf16, %s, torch %s" % (data["device"], data["torch"]),
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(out)


def main():
    if sys.argv[1] == "--head-to-head":
        return head_to_head(sys.argv[2], sys.argv[3])
    ab, acc, out = sys.argv[1:4]
    runs = json.load(open(ab))["runs"]
    acc_rows = json.load(open(acc))["rows"]
    fig, axes = plt.subplots(1, len(runs), figsize=(4.6 * len(runs), 3.2), squeeze=False)
    for ax, run in zip(axes[0], runs):
        rows = [r for r in run["rows"] if r["variant"] in LABELS]
        shape = rows[0]["shape"]
        n, h, v = (int(p.split("=")[1]) for p in shape.split())
        bars = [(LABELS[r["variant"]], r["time_ms"], None) for r in rows]
        for r in acc_rows:
            if r["shape"] == [n, h, v]:
                name = "fusedce.torch" if r["impl"] == "fusedce" else r["impl"]
                bars.append((name, r["ms"], r["extra_mib"]))
        names = [b[0] for b in bars]
        colors = ["#999999" if ("cuBLAS" in nm or nm == "torch.compile") else
                  "#c4a35a" if "before" in nm else "#4c72b0" for nm in names]
        hb = ax.barh(names, [b[1] for b in bars], color=colors)
        for rect, b in zip(hb, bars):
            note = "%.1f" % b[1] + ("  +%d MiB" % b[2] if b[2] is not None else "")
            ax.text(rect.get_width(), rect.get_y() + rect.get_height() / 2, " " + note, va="center", fontsize=7)
        ax.set_title("N=%d H=%d V=%d" % (n, h, v), fontsize=9)
        ax.set_xlabel("fwd + bwd, ms (less is better)", fontsize=8)
        ax.set_xlim(0, max(b[1] for b in bars) * 1.45)
        ax.invert_yaxis()
        ax.tick_params(labelsize=7)
    fig.suptitle("Linear cross-entropy, bf16, %s" % runs[0]["device"], fontsize=10)
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main()
