# Julia binding dependencies; sourced by tools/install-deps.sh (which defines apt_install).
#  - python3-clang: libclang's Python bindings, used by tools/gen_julia.py (pure Python: any python3).
#  - Julia 1.5.3 from Debian bullseye (not in bookworm), downloaded with apt-get into the git-ignored
#    folder .julia-root/ without touching /etc or the system's package state; run it with
#    bindings/julia/run-julia.sh, which sets LD_LIBRARY_PATH.
# Idempotent: returns at once when .julia-root/ holds a working julia.
_fce_julia_deps() {
  local root="$PWD/.julia-root"
  apt_install python3-clang libpcre2-8-0 libcurl3-gnutls libgmp10 libmpfr6 libssh2-1 libgfortran5 \
              libquadmath0 debian-archive-keyring
  local stamp="bullseye julia 1.5.3, recipe 2"  # bump when the recipe below changes
  if [ "$(cat "$root/.complete" 2>/dev/null)" = "$stamp" ] && [ -x "$root/root/usr/bin/julia" ]; then
    return 0
  fi
  echo "julia.sh: downloading Debian bullseye's julia 1.5.3 into $root"
  local mirror=""
  if [ -r /etc/apt/sources.list.d/debian.sources ]; then
    # First URIs: entry of a stanza whose Suites does not name a -security suite.
    mirror=$(awk 'BEGIN{RS=""} !/Suites:[^\n]*-security/ { if (match($0, /URIs:[ \t]*[^ \t\n]+/)) {
               s = substr($0, RSTART, RLENGTH); sub(/URIs:[ \t]*/, "", s); print s; exit } }' \
               /etc/apt/sources.list.d/debian.sources)
  fi
  if [ -z "$mirror" ] && [ -r /etc/apt/sources.list ]; then
    mirror=$(awk '$1 == "deb" && $0 !~ /security/ { for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) { print $i; exit } }' \
               /etc/apt/sources.list)
  fi
  [ -n "$mirror" ] || mirror="http://deb.debian.org/debian"
  local apt_dir="$root/.apt"
  rm -rf "$root"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs" "$root/root"
  local keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  echo "deb [signed-by=$keyring] $mirror bullseye main" >"$apt_dir/sources.list"
  : >"$apt_dir/status"  # an empty dpkg status: bullseye's versions are the candidates, whatever is installed
  local opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache"
              -o "Dir::State::status=$apt_dir/status"
              -o Debug::NoLocking=1 -o APT::Sandbox::User="$(id -un)")
  apt-get -q "${opts[@]}" update >/dev/null
  # libunwind8 too: bookworm's libunwind 1.6 makes julia 1.5 segfault whenever an exception is thrown from
  # compiled code (its backtrace walk); bullseye's 1.3.2 works.
  local pkgs=(julia julia-common libjulia1 libdsfmt-19937-1 libhttp-parser2.9 libmbedcrypto3 libmbedx509-0
              libmbedtls12 libgit2-1.1 libffi7 libllvm9 libopenlibm3 libutf8proc2 libunwind8)
  (cd "$apt_dir/debs" && apt-get -q "${opts[@]}" download "${pkgs[@]}" >/dev/null)
  local deb
  for deb in "$apt_dir"/debs/*.deb; do dpkg -x "$deb" "$root/root"; done
  local libdir="$root/root/usr/lib/x86_64-linux-gnu" so
  for so in libpcre2-8.so.0 libcurl-gnutls.so.4 libgmp.so.10 libmpfr.so.6 libssh2.so.1 libgfortran.so.5 \
            libquadmath.so.0; do
    ln -sf "/usr/lib/x86_64-linux-gnu/$so" "$libdir/$so"
  done
  rm -rf "$apt_dir"
  # the check also throws and catches an exception in compiled code (the libunwind problem above)
  bash bindings/julia/run-julia.sh --startup-file=no \
    -e 'using Test; f(x) = x > 0 ? error("x") : x; try f(1) catch end; VERSION == v"1.5.3" || exit(1)'
  echo "$stamp" >"$root/.complete"
}
_fce_julia_deps
unset -f _fce_julia_deps
