# shellcheck shell=bash
# CUTLASS's C++ headers, for linear CE's fused sm_90a forward (src/cuda/linear_ce_fused.cu): the include tree of
# PyPI's nvidia-cutlass wheel (CUTLASS 4.2.0; its hash checked), unpacked into third_party/cutlass/include
# (git-ignored). Sourced by tools/install-deps.sh. Only where a CUDA toolkit is; a failed download leaves the
# library without the fused path (meson's -Dcutlass=auto), not the build broken.
CUTLASS_WHEEL=nvidia_cutlass-4.2.0.0-py3-none-any.whl
CUTLASS_SHA256=f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6
if { command -v nvcc || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; } >/dev/null 2>&1 &&
   [ "$(cat third_party/cutlass/WHEEL 2>/dev/null)" != "$CUTLASS_WHEEL" ]; then
  cutlass_tmp=$(mktemp -d)
  if python3 -m pip download -q --no-deps --only-binary :all: -d "$cutlass_tmp" nvidia-cutlass==4.2.0.0 &&
     python3 - "$cutlass_tmp/$CUTLASS_WHEEL" "$CUTLASS_SHA256" third_party/cutlass <<'PY'
import hashlib, os, shutil, sys, zipfile
whl, sha, dest = sys.argv[1:4]
if hashlib.sha256(open(whl, "rb").read()).hexdigest() != sha:
    sys.exit("tools/deps.d/cutlass.sh: %s does not have the expected sha256" % whl)
shutil.rmtree(dest, ignore_errors=True)
pre = "cutlass_library/source/include/"
with zipfile.ZipFile(whl) as z:
    for name in z.namelist():
        if name.startswith(pre) and not name.endswith("/"):
            out = os.path.join(dest, "include", name[len(pre):])
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(name) as f, open(out, "wb") as g:
                shutil.copyfileobj(f, g)
    # CUTLASS's license travels with its headers
    for name in z.namelist():
        if name.endswith("LICENSE.txt") and name.count("/") <= 2:
            with z.open(name) as f, open(os.path.join(dest, "LICENSE.txt"), "wb") as g:
                shutil.copyfileobj(f, g)
            break
PY
  then
    echo "$CUTLASS_WHEEL" > third_party/cutlass/WHEEL
  else
    echo "tools/deps.d/cutlass.sh: CUTLASS's headers not fetched; linear CE's fused forward will not be built" >&2
  fi
  rm -rf "$cutlass_tmp"
fi
