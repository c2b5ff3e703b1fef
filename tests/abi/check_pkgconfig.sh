#!/usr/bin/env bash
# A C program builds against the uninstalled library through pkg-config and runs.
set -euo pipefail
build=$1 src=$2
export PKG_CONFIG_PATH="$build/meson-uninstalled${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
flags=$(pkg-config --cflags --libs fusedce)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cc -std=c99 -Wall -Werror "$src" $flags -o "$tmp/prog"
LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$tmp/prog"
