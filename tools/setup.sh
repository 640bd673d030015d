#!/usr/bin/env bash
# Installs the Debian packages pshard needs (as root; a no-op when present)
# and builds it in Release mode into ./build.
#   tools/setup.sh            install + configure + build
#   PSHARD_BUILD_DIR=dir      build elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t packages < <(grep -v '^\s*#' tools/debian-packages.txt | grep -v '^\s*$')
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "pshard setup: missing packages: ${missing[*]}; run as root (or: sudo $0)" >&2
    exit 1
  fi
  echo "pshard setup: installing ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
build=${PSHARD_BUILD_DIR:-build}
jobs=$(nproc)
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" -j "$jobs"
