#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine with the CUDA 13 toolkit needs to build and test libfusedce:
# the core packages here, then each tools/deps.d/*.sh (bindings, sample data). Idempotent and quick when
# everything is present.
set -euo pipefail
cd "$(dirname "$0")/.."
# libblis-serial-dev: BLIS, linked into the library (linear CE's CPU GEMMs); libopenblas-dev: the examples' demo.
APT_PKGS=(meson ninja-build pkg-config g++ libdlpack-dev libblis-serial-dev libopenblas-dev libhwy-dev libgtest-dev
          libcjson-dev python3 python3-pip)
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
apt_install() {  # installs the named Debian packages that are missing
  local missing=()
  for p in "$@"; do
    # "install ok installed" only: a removed package with its config left still answers dpkg -s.
    [ "$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null)" = "install ok installed" ] || missing+=("$p")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
}
apt_install "${APT_PKGS[@]}"
for f in tools/deps.d/*.sh; do
  [ -e "$f" ] || continue
  # shellcheck source=/dev/null
  source "$f"
done
