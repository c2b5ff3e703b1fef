# shellcheck shell=bash
# API reference (docs/Doxyfile.in): sourced by tools/install-deps.sh, which defines apt_install.
# - doxygen (1.9.4 on Debian 12): `ninja -C build docs` and the abi suite's api_reference test, which fails
#   when meson found no doxygen at setup. Graphviz is not needed (HAVE_DOT = NO).
apt_install doxygen
