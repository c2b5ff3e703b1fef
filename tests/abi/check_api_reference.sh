#!/usr/bin/env bash
# The API reference builds from the public header with no Doxygen warning (docs/Doxyfile.in sets
# WARN_IF_UNDOCUMENTED and WARN_AS_ERROR=FAIL_ON_WARNINGS), and documents the header's functions.
#   check_api_reference.sh DOXYGEN DOXYFILE HTML_DIR     (DOXYGEN empty: not found when meson configured)
set -uo pipefail
doxygen=$1 doxyfile=$2 html=$3
if [ -z "$doxygen" ]; then
  echo "api_reference: doxygen was not found when this build dir was configured; install it" \
       "(bash tools/install-deps.sh: tools/deps.d/docs.sh) and run meson setup --reconfigure" >&2
  exit 1
fi
out=$("$doxygen" "$doxyfile" 2>&1)
rc=$?
[ -z "$out" ] || printf '%s\n' "$out"
# Doxygen 1.9.4 labels warnings "warning:", and "error:" under WARN_AS_ERROR.
n=$(printf '%s\n' "$out" | grep -c -E '(warning|error):' || true)
if [ "$rc" -ne 0 ] || [ "$n" -ne 0 ]; then
  echo "api_reference: doxygen exited with $rc and printed $n warning(s) (fix the header's doc comments)" >&2
  exit 1
fi
# Not an empty reference: the header's page lists its functions (a header without a documented file
# block would document nothing, and warn about nothing).
page=$html/fusedce_8h.html
for sym in fce_handle_create fce_cross_entropy_fwd fce_linear_cross_entropy_bwd fce_ce_options_t; do
  grep -q "$sym" "$page" 2>/dev/null || { echo "api_reference: $sym missing from $page" >&2; exit 1; }
done
echo "api_reference: $html/index.html, no warnings"
