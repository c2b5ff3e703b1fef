#!/usr/bin/env python3
"""The shared library exports exactly the fce_* functions the header declares (nm -D --defined-only)."""
import re, subprocess, sys

lib, header = sys.argv[1], sys.argv[2]
out = subprocess.run(["nm", "-D", "--defined-only", lib], check=True, capture_output=True, text=True).stdout
exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
declared = set(re.findall(r"FCE_API\s+[^;(]*?\b(fce_\w+)\s*\(", open(header).read()))
bad = sorted(s for s in exported if not s.startswith("fce_"))
missing = sorted(declared - exported)
extra = sorted(exported - declared)
print(f"{len(exported)} exported, {len(declared)} declared")
for name, items in (("not fce_*", bad), ("declared but not exported", missing), ("exported but not declared", extra)):
    if items:
        print(f"{name}: {items}")
sys.exit(1 if bad or missing or extra or not declared else 0)
