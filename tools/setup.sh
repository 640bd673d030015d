#!/usr/bin/env bash
# Installs the Debian packages pshard needs (as root; a no-op when present)
# and builds it in Release mode into ./build.
#   tools/setup.sh            install + configure + build
#   PSHARD_BUILD_DIR=dir      build elsewhere
#   PSHARD_CMAKE_ARGS="..."   extra CMake arguments (the images build without tests)
#   PSHARD_PACKAGES=image     install the image build stage's share of the list
#   PSHARD_PACKAGES=bench     also install the benchmarks' baselines (python3-torch)
#   PSHARD_FUZZ=1             the fuzz build instead: clang-14, PSHARD_WITH_FUZZERS (ASan +
#                             UBSan), only the harnesses and what they link, into build-fuzz
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t packages < <(tools/packages.sh "${PSHARD_PACKAGES:-all}")
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
fuzz_args=() targets=()
if [[ ${PSHARD_FUZZ:-0} == 1 ]]; then
  build=${PSHARD_BUILD_DIR:-build-fuzz}
  # Debug information for the sanitizers' reports.
  fuzz_args=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14
             -DPSHARD_WITH_FUZZERS=ON -DPSHARD_WITH_UCX=ON -DPSHARD_BUILD_TESTS=OFF -DPSHARD_BUILD_BENCH=OFF)
  targets=(--target fuzzers)
fi
# shellcheck disable=SC2086  # PSHARD_CMAKE_ARGS is a list of arguments
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release "${fuzz_args[@]}" ${PSHARD_CMAKE_ARGS:-} >/dev/null
cmake --build "$build" -j "$jobs" "${targets[@]}"
