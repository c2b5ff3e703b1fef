#!/usr/bin/env bash
# Regenerates fusedce-sys/src/bindings.rs from include/fusedce/fusedce.h (and the DLPack types it uses)
# with Debian's bindgen CLI, formatted by rustfmt.
#
#   bindings/rust/generate.sh           rewrite fusedce-sys/src/bindings.rs
#   bindings/rust/generate.sh --check   regenerate into a temporary file; exit 1 on any difference
#
# --check formats both the committed file and the fresh output with the local rustfmt before comparing,
# so a different rustfmt version never shows up as a difference; bindgen's output itself must match.
# Needs: bindgen (Debian's package, 0.60), libclang-dev, rustfmt (tools/deps.d/rust.sh installs them).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="$here/fusedce-sys/src/bindings.rs"

mode=write
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

for tool in bindgen rustfmt; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "generate.sh: '$tool' not found (run tools/install-deps.sh; rustfmt comes with the Rust toolchain)" >&2
    exit 1
  fi
done

# Flags (bindgen 0.60):
#   allowlist fce_* functions and FCE_* macros, the fce_* / DL* types and the opaque CUstream_st and ncclComm, without
#     following typedef chains into glibc's __int64_t & co. (--no-recursive-allowlist);
#   std::os::raw C types (core::ffi's need Rust >= 1.64; Debian bookworm's rustc is 1.63);
#   the status enum as a newtype (an unknown code from a newer library stays a valid value; a Rust enum
#     would make it undefined behaviour), the other enums as plain constants for the int32_t fields;
#   size_t as usize; bindgen's layout tests kept (they run with `cargo test`).
generate() {
  (cd "$root" && bindgen include/fusedce/fusedce.h \
    --no-rustfmt-bindings \
    --no-recursive-allowlist \
    --allowlist-function 'fce_.*' \
    --allowlist-type '(fce|DL|CUstream|ncclComm).*' \
    --allowlist-var 'FCE_.*' \
    --ctypes-prefix '::std::os::raw' \
    --newtype-enum 'fce_status' \
    --no-prepend-enum-name \
    --size_t-is-usize \
    -- -Iinclude) | fmt
}

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# rustfmt with a pinned configuration, whatever rustfmt.toml the caller's directory has.
printf 'edition = "2021"\n' > "$tmp/rustfmt.toml"
fmt() { rustfmt --config-path "$tmp/rustfmt.toml" --emit stdout; }
generate > "$tmp/bindings.rs"

if [ "$mode" = write ]; then
  cp "$tmp/bindings.rs" "$out"
  echo "generate.sh: wrote ${out#"$root"/}"
  exit 0
fi

if [ ! -f "$out" ]; then
  echo "generate.sh --check: ${out#"$root"/} is missing" >&2
  exit 1
fi
fmt < "$out" > "$tmp/committed.rs"
if ! diff -u --label "committed ${out#"$root"/}" --label "regenerated from include/fusedce/fusedce.h" \
    "$tmp/committed.rs" "$tmp/bindings.rs"; then
  echo "generate.sh --check: fusedce-sys bindings are out of date; run bindings/rust/generate.sh" >&2
  exit 1
fi
echo "generate.sh --check: bindings.rs is up to date"
