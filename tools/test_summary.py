#!/usr/bin/env python3
"""Reads meson's testlog.json and prints `N passed, N failed, N skipped`; exits 1 on any failure."""
import json, sys

counts = {"passed": 0, "failed": 0, "skipped": 0}
with open(sys.argv[1]) as f:
    for line in f:
        r = json.loads(line)
        res = r.get("result")
        if res in ("OK", "EXPECTEDFAIL"):
            counts["passed"] += 1
        elif res == "SKIP":
            counts["skipped"] += 1
        else:
            counts["failed"] += 1
            print("FAILED:", r.get("name"), res, file=sys.stderr)
print("%d passed, %d failed, %d skipped" % (counts["passed"], counts["failed"], counts["skipped"]))
sys.exit(1 if counts["failed"] or not counts["passed"] else 0)
