"""Plots of the C benchmarks' --json results for docs/benchmarks.md (needs matplotlib: pip install matplotlib).

    python3 benchmarks/plot_c.py OUT_DIR FILE.json [FILE.json...]

FILE.json: the output of bench_ce, bench_softmax_kd or bench_linear_ce run with --json FILE. Writes, per
program, OUT_DIR/c-<program>.svg: one horizontal bar per row (op, shape, dtype) at its percentage of the
baseline measured in the same run (copy bandwidth, or the cuBLAS GEMM of the same shape), labeled with the
absolute time; several files of one program are drawn side by side, one panel per run. Prints a markdown
table per program (shape, op, dtype, time, % of baseline, device, date) to stdout.
"""
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

XMAX = 110


def time_text(row):
    if row.get("time_us") is not None:
        return "%.1f µs" % row["time_us"]
    if row.get("time_ms") is not None:
        return "%.2f ms" % row["time_ms"]
    return "n/a"


def pct(row):
    return row.get("pct_of_baseline")


def baseline_text(doc, short=False):
    if doc.get("copy_gbps") is not None:
        return "of the in-run copy bandwidth (%.0f GB/s)" % doc["copy_gbps"]
    cublas = doc.get("cublas_tflops")
    if isinstance(cublas, dict) and short:
        return "of the in-run cuBLAS bf16 GEMM of the same shape"
    if isinstance(cublas, dict):
        return "of the in-run cuBLAS bf16 GEMM of the same shape (%s)" % ", ".join(
            "%s: %.0f TFLOP/s" % (k, v) for k, v in cublas.items() if v is not None)
    if cublas is not None:
        return "of the in-run cuBLAS bf16 GEMM (%.0f TFLOP/s)" % cublas
    return "of the in-run baseline"


def target_pct(row):
    """The row's target as a percentage of the baseline ('90%', '>= 85% of copy'), else None."""
    m = re.search(r"(\d+(?:\.\d+)?)\s*%", str(row.get("target") or ""))
    return float(m.group(1)) if m else None


def panel(ax, doc):
    rows = doc["rows"]
    y = list(range(len(rows)))
    vals = [pct(r) or 0.0 for r in rows]
    colors = ["#4c72b0" if target_pct(r) is not None or r.get("result") else "#8fb0d8" for r in rows]
    bars = ax.barh(y, [min(v, XMAX) for v in vals], color=colors)
    for b, r, v in zip(bars, rows, vals):
        text = time_text(r)
        if pct(r) is None:
            text += " (no baseline)"
        elif v > XMAX:
            text += " (%.0f %%)" % v
        yc = b.get_y() + b.get_height() / 2
        if min(v, XMAX) > 0.6 * XMAX:  # inside, at the left: clear of the target ticks
            ax.text(1, yc, text, va="center", fontsize=7, color="white")
        else:
            ax.text(b.get_width(), yc, " " + text, va="center", fontsize=7)
        t = target_pct(r)
        if t is not None:
            ax.plot([t, t], [yc - 0.4, yc + 0.4], color="black", linewidth=1)
    ax.axvline(100, color="#999999", linestyle="--", linewidth=0.8)
    ax.set_yticks(y, ["%s, %s, %s" % (r.get("op", ""), r.get("shape", ""), r.get("dtype", "")) for r in rows],
                  fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(0, XMAX)
    ax.tick_params(axis="x", labelsize=7)
    note = "; dark: rows with a target (tick)" if any(c == "#4c72b0" for c in colors) else ""
    ax.set_xlabel("%% %s%s" % (baseline_text(doc, short=True), note), fontsize=8)
    ax.set_title("%s, %s" % (doc.get("device") or "unknown device", (doc.get("date") or "")[:10]), fontsize=9)


def plot(program, docs, path):
    n = max(len(d["rows"]) for d in docs)
    fig, axes = plt.subplots(1, len(docs), figsize=(8.5 * len(docs), 1.6 + 0.26 * n), squeeze=False)
    for ax, doc in zip(axes[0], docs):
        panel(ax, doc)
    versions = sorted({str(d.get("library_version")) for d in docs if d.get("library_version")})
    fig.suptitle("%s%s" % (program, ", fusedce %s" % ", ".join(versions) if versions else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def cell(v):
    return str(v if v is not None else "").replace("|", "\\|").replace("\n", " ")


def table(program, docs):
    out = ["### %s" % program, "", "%% of baseline: %s." % "; ".join(
        "%s, %s" % (d.get("device"), baseline_text(d)) for d in docs), "",
        "| shape | op | dtype | time | % of baseline | device | date |", "|---|---|---|---|---|---|---|"]
    for d in docs:
        for r in d["rows"]:
            p = pct(r)
            out.append("| %s |" % " | ".join(cell(c) for c in (
                r.get("shape"), r.get("op"), r.get("dtype"), time_text(r), "%.1f %%" % p if p is not None else "n/a",
                d.get("device"), (d.get("date") or "")[:10])))
    return "\n".join(out)


def main(argv):
    if len(argv) < 3 or argv[1] in ("-h", "--help"):
        sys.stderr.write(__doc__)
        return 2
    out_dir, files = argv[1], argv[2:]
    by_program = {}
    for f in files:
        with open(f) as fp:
            doc = json.load(fp)
        if not isinstance(doc, dict) or "program" not in doc or not isinstance(doc.get("rows"), list):
            sys.stderr.write("%s: not a C benchmark's --json output (no program or rows)\n" % f)
            return 2
        if doc["rows"]:
            by_program.setdefault(doc["program"], []).append(doc)
    os.makedirs(out_dir, exist_ok=True)
    for program, docs in by_program.items():
        path = os.path.join(out_dir, "c-%s.svg" % program)
        plot(program, docs, path)
        print(table(program, docs))
        print()
        sys.stderr.write("wrote %s\n" % path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
