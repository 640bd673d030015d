#!/usr/bin/env bash
# Prints the packages of tools/debian-packages.txt needed for one use:
#   tools/packages.sh all       everything but "bench" (what tools/setup.sh installs)
#   tools/packages.sh bench     everything, with the benchmarks' baselines ("bench")
#   tools/packages.sh image     a container image's build stage: all but "host" and "bench"
#   tools/packages.sh runtime   only the lines tagged "runtime"
set -euo pipefail
use=${1:-all}
case "$use" in
  all | bench | image | runtime) ;;
  *) echo "packages.sh: unknown use \"$use\" (all, bench, image or runtime)" >&2; exit 2 ;;
esac
# A line is "package  # tag: comment"; whole-line comments are skipped.
awk -v use="$use" '
  /^[[:space:]]*(#|$)/ { next }
  {
    tag = ""
    if (match($0, /#[[:space:]]*[a-z]+/)) { tag = substr($0, RSTART, RLENGTH); sub(/#[[:space:]]*/, "", tag) }
    if (use == "bench" || (use == "all" && tag != "bench") || (use == "image" && tag != "host" && tag != "bench") ||
        (use == "runtime" && tag == "runtime")) print $1
  }' "$(dirname "$0")/debian-packages.txt"
