# shellcheck shell=bash
# Python binding (bindings/python): sourced by tools/install-deps.sh, which defines apt_install.
#  - libonnx-testdata: the ONNX conformance vectors the pytest suite checks against.
#  - the pinned test requirements (cffi, numpy, pytest, onnx, ml_dtypes), installed with pip only when
#    one is missing or at another version, so a second run takes well under a second.
apt_install libonnx-testdata
if ! python3 - bindings/python/requirements-test.txt <<'PY' >/dev/null 2>&1
import sys
from importlib.metadata import version, PackageNotFoundError
for line in open(sys.argv[1]):
    line = line.split("#")[0].strip()
    if not line:
        continue
    name, want = line.split("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
then
  python3 -m pip install -q -r bindings/python/requirements-test.txt
fi
