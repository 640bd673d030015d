#!/usr/bin/env bash
# Prints the Debian packages that own the shared libraries the given
# binaries load (run in an image's build stage, where they are installed),
# followed by the lines of tools/debian-packages.txt tagged "runtime".
set -euo pipefail
here=$(cd "$(dirname "$0")/../.." && pwd)
{
  for bin in "$@"; do
    ldd "$bin" | awk '/=> \// { print $3 }'
  done | sort -u | while read -r lib; do
    real=$(readlink -f "$lib")
    # Packages that ship the library (under either name); the C library
    # itself is in every base image.
    dpkg -S "$real" 2>/dev/null || dpkg -S "$lib" 2>/dev/null || {
      echo "runtime-packages: no package owns $lib" >&2
      exit 1
    }
  done | cut -d: -f1 | grep -v -x -e libc6 -e libgcc-s1
  "$here/tools/packages.sh" runtime
} | sort -u
