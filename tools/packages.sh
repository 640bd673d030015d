#!/usr/bin/env bash
# Prints the packages of tools/debian-packages.txt needed for one use:
#   tools/packages.sh all       everything (what tools/setup.sh installs)
#   tools/packages.sh image     a container image's build stage: all but "host"
#   tools/packages.sh runtime   only the lines tagged "runtime"
set -euo pipefail
use=${1:-all}
case "$use" in
  all | image | runtime) ;;
  *) echo "packages.sh: unknown use \"$use\" (all, image or runtime)" >&2; exit 2 ;;
esac
# A line is "package  # tag: comment"; whole-line comments are skipped.
awk -v use="$use" '
  /^[[:space:]]*(#|$)/ { next }
  {
    tag = ""
    if (match($0, /#[[:space:]]*[a-z]+/)) { tag = substr($0, RSTART, RLENGTH); sub(/#[[:space:]]*/, "", tag) }
    if (use == "all" || (use == "image" && tag != "host") || (use == "runtime" && tag == "runtime")) print $1
  }' "$(dirname "$0")/debian-packages.txt"
