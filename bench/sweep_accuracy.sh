#!/usr/bin/env bash
# How well pshard plan predicts a step: a sweep of the demo model over 3
# link rates x 2 latencies x 2 levers (12 points, plus the calibration run),
# each point's measured step beside the planner's prediction. Prints every
# point and, for the communication-bound ones, the largest miss; exits 1
# when a comm-bound point misses by more than --bound (default 15%).
#   bench/sweep_accuracy.sh [--out=DIR] [--bound=0.15] [-- extra pshard sweep flags]
# Runs on an otherwise idle machine: the sweep's points share its cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${TMPDIR:-/tmp}/pshard-sweep-accuracy
bound=0.15
extra=()
while (($#)); do
  case "$1" in
    --out=*) out=${1#*=} ;;
    --bound=*) bound=${1#*=} ;;
    --) shift; extra=("$@"); break ;;
    *) echo "sweep_accuracy.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
bin=${PSHARD_BUILD_DIR:-build}/bin
[[ -x $bin/pshard ]] || { echo "sweep_accuracy.sh: build pshard first (tools/setup.sh)" >&2; exit 2; }
rm -rf "$out"
"$bin/pshard" sweep --out="$out" --skip_steps=3 --measure_steps=6 --plot \
  --link_rate=300mbit,100mbit,30mbit --link_delay=1ms,10ms --weight_encoding=bf16,int8 "${extra[@]}"
awk -F, -v bound="$bound" '
  NR == 1 { for (i = 1; i <= NF; ++i) col[$i] = i; next }
  {
    err = $col["step_error"]; bound_by = $col["predicted_comm_bound"] == 1 ? "comm" : "compute"
    printf "%-8s %-5s %-5s measured %8.1f ms  predicted %8.1f ms  %+6.1f%%  (%s-bound)\n", $col["link_rate"],
           $col["link_delay"], $col["weight_encoding"], $col["measured_step_ms"], $col["predicted_step_ms"],
           100 * err, bound_by
    if (bound_by == "comm") { n++; if (err < 0) err = -err; if (err > worst) worst = err; if (err > bound) miss++ }
  }
  END {
    printf "%d comm-bound points: largest miss %.1f%% (bound %.0f%%)\n", n, 100 * worst, 100 * bound
    exit miss > 0 ? 1 : 0
  }' "$out/results.csv"
