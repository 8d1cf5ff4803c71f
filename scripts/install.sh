#!/bin/sh
# Install gscomm for C users: the shared and static libraries, the headers and a pkg-config file.
#
#   scripts/install.sh [--prefix DIR] [--libdir DIR] [--includedir DIR] [--from DIR] [--destdir DIR]
#
#   --prefix      where it goes (default /usr/local)
#   --libdir      default PREFIX/lib; --includedir default PREFIX/include
#   --from        the directory holding the built libgscomm.so and libgscomm.a
#                 (default $CARGO_TARGET_DIR/release or target/release: run
#                 `cargo build --release` first, or `make install`)
#   --destdir     staging root prepended to every path (packagers); the .pc file still names PREFIX
#
# Installs LIBDIR/libgscomm.so.VERSION with the soname link (libgscomm.so.0.MINOR while the
# major version is 0, as cargo-c names it) and the development link libgscomm.so,
# LIBDIR/libgscomm.a, INCLUDEDIR/gsc.h and gsc_device.cuh, and LIBDIR/pkgconfig/gscomm.pc.
# The version comes from Cargo.toml, the one place it is written (build.rs checks that the
# header's GSC_VERSION_* macros agree).
set -eu

root=$(cd "$(dirname "$0")/.." && pwd)
prefix=/usr/local
libdir=
includedir=
from="${CARGO_TARGET_DIR:-$root/target}/release"
destdir=

while [ $# -gt 0 ]; do
    case "$1" in
        --prefix) prefix=$2; shift 2 ;;
        --libdir) libdir=$2; shift 2 ;;
        --includedir) includedir=$2; shift 2 ;;
        --from) from=$2; shift 2 ;;
        --destdir) destdir=$2; shift 2 ;;
        -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
    esac
done
case "$prefix" in
    /*) ;;
    *) echo "install.sh: --prefix must be an absolute path, got '$prefix'" >&2; exit 2 ;;
esac
libdir=${libdir:-$prefix/lib}
includedir=${includedir:-$prefix/include}

for f in libgscomm.so libgscomm.a; do
    if [ ! -f "$from/$f" ]; then
        echo "install.sh: $from/$f not found; build first (cargo build --release, or make install)" >&2
        exit 1
    fi
done

# The [package] version of Cargo.toml: the first `version = "..."` line.
version=$(sed -n 's/^version *= *"\([^"]*\)".*/\1/p' "$root/Cargo.toml" | head -n 1)
major=${version%%.*}
rest=${version#*.}
minor=${rest%%.*}
if [ "$major" = 0 ]; then soname="libgscomm.so.0.$minor"; else soname="libgscomm.so.$major"; fi

lib=$destdir$libdir
inc=$destdir$includedir
mkdir -p "$lib/pkgconfig" "$inc"
cp "$from/libgscomm.so" "$lib/libgscomm.so.$version.tmp"
chmod 755 "$lib/libgscomm.so.$version.tmp"
mv -f "$lib/libgscomm.so.$version.tmp" "$lib/libgscomm.so.$version"
ln -sf "libgscomm.so.$version" "$lib/$soname"
ln -sf "$soname" "$lib/libgscomm.so"
cp "$from/libgscomm.a" "$lib/libgscomm.a"
chmod 644 "$lib/libgscomm.a"
cp "$root/include/gsc.h" "$root/include/gsc_device.cuh" "$inc/"
chmod 644 "$inc/gsc.h" "$inc/gsc_device.cuh"

# Libs.private: what a static link of the Rust runtime needs besides libc (CUDA, NCCL and the
# verbs library are opened at run time, never linked).
cat > "$lib/pkgconfig/gscomm.pc" <<PC
prefix=$prefix
libdir=$libdir
includedir=$includedir

Name: gscomm
Description: GPU communication runtime: stream-, graph- and kernel-triggered point-to-point and collectives
Version: $version
Libs: -L\${libdir} -lgscomm
Libs.private: -lpthread -ldl -lm -lrt -lgcc_s
Cflags: -I\${includedir}
PC
chmod 644 "$lib/pkgconfig/gscomm.pc"
echo "installed gscomm $version into $destdir$prefix (pkg-config: PKG_CONFIG_PATH=$libdir/pkgconfig)"
