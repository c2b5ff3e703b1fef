#!/usr/bin/env python3
"""Reads meson's testlog.json and prints the ten slowest tests, then, last, one line:
`N passed, N failed, N skipped (why: count, ...)`. Exits 1 on any failure or when nothing passed.

    test_summary.py TESTLOG_JSON [--times FILE]   --times: also write every test's suite, name, result and
                                                  seconds as tab-separated lines (docs/testing.md's table)
"""
import json
import re
import sys

# A skipped test's reason: the first pattern its output matches; otherwise its output's last line.
REASONS = [
    (r"no usable (CUDA device|GPU)|cudaGetDeviceCount|fewer GPUs|no CUDA device|GPU\(s\) for \d+ ranks", "no GPU"),
    (r"libnccl", "no NCCL"),
]


def reason(r):
    out = r.get("stdout") or ""
    for pat, why in REASONS:
        if re.search(pat, out):
            return why
    lines = [l.strip() for l in out.splitlines() if l.strip()]
    return (lines[-1][:60] if lines else "exit 77, no output")


def main():
    if len(sys.argv) not in (2, 4) or (len(sys.argv) == 4 and sys.argv[2] != "--times"):
        sys.exit(__doc__)
    rows = []
    with open(sys.argv[1]) as f:
        for line in f:
            rows.append(json.loads(line))
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    why = {}
    for r in rows:
        res = r.get("result")
        if res in ("OK", "EXPECTEDFAIL"):
            counts["passed"] += 1
        elif res == "SKIP":
            counts["skipped"] += 1
            w = reason(r)
            why[w] = why.get(w, 0) + 1
        else:
            counts["failed"] += 1
            print("FAILED:", r.get("name"), res, file=sys.stderr)
    if len(sys.argv) == 4:
        with open(sys.argv[3], "w") as f:
            for r in rows:
                suite = r["name"].split(":", 1)[1].split(" / ")[0] if ":" in r["name"] else ""
                f.write("%s\t%s\t%s\t%.2f\n" % (suite, r["name"].split(" / ", 1)[-1], r.get("result"),
                                                r.get("duration", 0.0)))
    slow = sorted(rows, key=lambda r: -r.get("duration", 0.0))[:10]
    print("slowest ten:")
    for r in slow:
        print("  %8.1f s  %s" % (r.get("duration", 0.0), r.get("name")))
    skipped = "%d skipped" % counts["skipped"]
    if why:
        skipped += " (%s)" % ", ".join("%s: %d" % (w, n) for w, n in sorted(why.items(), key=lambda kv: -kv[1]))
    print("%d passed, %d failed, %s" % (counts["passed"], counts["failed"], skipped))
    return 1 if counts["failed"] or not counts["passed"] else 0


if __name__ == "__main__":
    sys.exit(main())
