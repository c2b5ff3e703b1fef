#!/usr/bin/env bash
# The installed package works for a consumer: `meson install --destdir` into a temporary root (no root
# needed), then checks of the tree (header, library and its soname, fusedce.pc, documentation) and C programs
# compiled with the installed fusedce.pc's flags and run against the installed library. Leaves nothing behind
# (meson itself rewrites <build>/meson-logs/install-log.txt).
#   check_install.sh MESON BUILD_DIR SOURCE_ROOT PREFIX LIBDIR INCLUDEDIR DOCDIR ABI VERSION PROGRAM.c...
# LIBDIR, INCLUDEDIR and DOCDIR are absolute (prefix included), as meson configured them.
set -euo pipefail
meson=$1 build=$2 src=$3 prefix=$4 libdir=$5 includedir=$6 docdir=$7 abi=$8 version=$9
shift 9
tmp=$(mktemp -d "${TMPDIR:-/tmp}/fusedce-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
root=$tmp/root
fail() { echo "install_tree: $*" >&2; exit 1; }

"$meson" install -C "$build" --no-rebuild --skip-subprojects --quiet --destdir "$root" \
    >"$tmp/install.log" 2>&1 || { cat "$tmp/install.log" >&2; fail "meson install --destdir failed"; }
echo "== installed tree"
(cd "$root" && find . \( -type f -o -type l \) | sort)

# The header, as in the sources.
cmp -s "$src/include/fusedce/fusedce.h" "$root$includedir/fusedce/fusedce.h" ||
  fail "$includedir/fusedce/fusedce.h missing or different"
# The library: libfusedce.so.<version> with soname libfusedce.so.<ABI>, the soname link and the dev link.
lib=$root$libdir/libfusedce.so
[ -f "$lib.$version" ] || fail "$lib.$version missing"
[ -e "$lib.$abi" ] && [ -e "$lib" ] || fail "link $lib.$abi or $lib missing"
soname=$(readelf -d "$lib.$version" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = "libfusedce.so.$abi" ] || fail "soname is '$soname', not libfusedce.so.$abi"
# Documentation: README, LICENSE, CHANGELOG and every docs/*.md, laid out as in the sources (relative links
# hold).
docs=(README.md LICENSE CHANGELOG.md)
for f in "$src"/docs/*.md; do docs+=("docs/${f##*/}"); done
for f in "${docs[@]}"; do
  cmp -s "$src/$f" "$root$docdir/$f" || fail "$docdir/$f missing or different (docs/meson.build lists docs/*.md)"
done

# fusedce.pc: the installed one first.
pcdir=$root$libdir/pkgconfig
[ -f "$pcdir/fusedce.pc" ] || fail "$pcdir/fusedce.pc missing"
echo "== fusedce.pc"
cat "$pcdir/fusedce.pc"
export PKG_CONFIG_PATH=$pcdir${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
# Keep system paths (prefix /usr): a pkg-config that drops -I/usr/include before relocating would lose it.
export PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1 PKG_CONFIG_ALLOW_SYSTEM_LIBS=1
unset PKG_CONFIG_SYSROOT_DIR
[ "$(pkg-config --modversion fusedce)" = "$version" ] || fail "pkg-config --modversion is not $version"
url=$(sed -n 's/^URL: *//p' "$pcdir/fusedce.pc")
case $url in ''|*example.invalid*) fail "URL '$url'" ;; esac
# DLPack: in Requires when meson found it through pkg-config, else on the compiler's default include path.
case $(pkg-config --variable=dlpack_header fusedce) in
  pkg-config) pkg-config --print-requires fusedce | grep -q '^dlpack' || fail "Requires lacks dlpack" ;;
  system) echo '#include <dlpack/dlpack.h>' | cc -E -x c - >/dev/null 2>&1 ||
            fail "dlpack_header=system but <dlpack/dlpack.h> is not on the default include path" ;;
  *) fail "fusedce.pc has no dlpack_header variable" ;;
esac

# The flags, relocated into the destdir. pkg-config --define-prefix takes the prefix as the .pc's directory
# less lib/pkgconfig: right for libdir lib, wrong for a multiarch libdir (lib/x86_64-linux-gnu gives
# <prefix>/lib). Then PKG_CONFIG_SYSROOT_DIR, which prepends the destdir to -I and -L.
guess=$(pkg-config --define-prefix --variable=prefix fusedce)
if [ "$guess" = "$root$prefix" ]; then
  how="pkg-config --define-prefix"
  flags=$(pkg-config --define-prefix --cflags --libs fusedce)
else
  how="PKG_CONFIG_SYSROOT_DIR=<destdir> pkg-config"
  how+=" (--define-prefix guessed prefix ${guess#"$root"} for libdir $libdir)"
  flags=$(PKG_CONFIG_SYSROOT_DIR=$root pkg-config --cflags --libs fusedce)
fi
echo "== $how: $flags"
for want in "-I$root$includedir" "-L$root$libdir"; do
  [[ " $flags " == *" $want "* ]] || fail "flags lack $want"
done

export LD_LIBRARY_PATH=$root$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
for prog in "$@"; do
  name=$(basename "$prog" .c)
  # shellcheck disable=SC2086
  cc -std=c99 -Wall -Werror "$prog" $flags -o "$tmp/$name"
  loaded=$(ldd "$tmp/$name" | sed -n 's/^[[:space:]]*libfusedce\.so\.[0-9]* => \([^ ]*\).*/\1/p')
  [ "$loaded" = "$lib.$abi" ] || fail "$name loads libfusedce from '$loaded', not $lib.$abi"
  echo "== $name"
  "$tmp/$name"
done
echo "install_tree: ok"
