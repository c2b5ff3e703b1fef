#!/usr/bin/env bash
# Installs what a fresh Debian 12 machine with the CUDA 13 toolkit needs to build and test libfusedce.
# Idempotent: packages already present are skipped quickly.
set -euo pipefail
APT_PKGS=(meson ninja-build pkg-config g++ libdlpack-dev libopenblas-dev libgtest-dev
          libcjson-dev python3 python3-pip)
missing=()
for p in "${APT_PKGS[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
