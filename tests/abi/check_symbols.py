#!/usr/bin/env python3
"""The shared library exports exactly the fce_* functions the header declares (nm -D --defined-only), and
binds no BLAS symbol at load time (nm -D --undefined-only): its GEMMs are its own copy of BLIS, linked in, which
no other BLAS in the process can stand in for."""
import re, subprocess, sys

lib, header = sys.argv[1], sys.argv[2]
out = subprocess.run(["nm", "-D", "--defined-only", lib], check=True, capture_output=True, text=True).stdout
exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
declared = set(re.findall(r"FCE_API\s+[^;(]*?\b(fce_\w+)\s*\(", open(header).read()))
bad = sorted(s for s in exported if not s.startswith("fce_"))
missing = sorted(declared - exported)
extra = sorted(exported - declared)
out = subprocess.run(["nm", "-D", "--undefined-only", lib], check=True, capture_output=True, text=True).stdout
blas = sorted(s for s in (line.split()[-1] for line in out.splitlines() if line.strip())
              if re.match(r"(cblas_|bli_|openblas_|goto_|mkl_|[sdcz]gemm|[sdcz]gemv)", s))
print(f"{len(exported)} exported, {len(declared)} declared")
for name, items in (("not fce_*", bad), ("declared but not exported", missing), ("exported but not declared", extra),
                    ("BLAS symbols bound at load time", blas)):
    if items:
        print(f"{name}: {items}")
sys.exit(1 if bad or missing or extra or blas or not declared else 0)
