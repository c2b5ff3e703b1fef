# shellcheck shell=bash
# Rust bindings (bindings/rust): sourced by tools/install-deps.sh, which defines apt_install.
# - bindgen (Debian's CLI, 0.60) + libclang-dev: bindings/rust/generate.sh regenerates
#   fusedce-sys/src/bindings.rs, and CI checks the committed file against it (generate.sh --check).
# - cargo, rustc, rustfmt: preinstalled on the project's machines (rustup, in ~/.cargo/bin); Debian's
#   packages otherwise (rustc 1.63 is enough: the crates declare rust-version = "1.63").
# No crates are needed: both crates have zero dependencies and build with `cargo --offline`.
apt_install bindgen libclang-dev
_fce_cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
if ! command -v cargo >/dev/null 2>&1 && ! [ -x "$_fce_cargo_bin/cargo" ]; then
  apt_install cargo
fi
if ! command -v rustfmt >/dev/null 2>&1 && ! [ -x "$_fce_cargo_bin/rustfmt" ]; then
  apt_install rustfmt
fi
unset _fce_cargo_bin
