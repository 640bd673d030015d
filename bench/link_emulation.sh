#!/usr/bin/env bash
# The in-process link emulation against the kernel's: `pshard local` trains
# the same comm-bound job (2 servers, 1 trainer, 50 Mbit/s) over links that
# tc tbf shapes between network namespaces (--link_mode=kernel), then over
# the emulation (--link_mode=emulated), and prints each mean step and their
# ratio. Goal: the ratio within 10% of 1 (the emulation stands in for the
# kernel in every other benchmark and test). Needs root and iproute2.
#
#   bench/link_emulation.sh [--bin_dir=build/bin] [--steps=20] [--rate=50mbit] [--repeats=3]
# Each mode runs --repeats times, alternating; the mean step of a run is
# trainer 0's ("per step: wall ... ms"), and each mode's figure is the
# median of its runs.
set -euo pipefail
bin=build/bin steps=20 rate=50mbit repeats=3
while [[ $# -gt 0 ]]; do
  case $1 in
    --bin_dir=*) bin=${1#*=} ;;
    --steps=*) steps=${1#*=} ;;
    --rate=*) rate=${1#*=} ;;
    --repeats=*) repeats=${1#*=} ;;
    *) echo "link_emulation.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[[ $(id -u) == 0 ]] || { echo "link_emulation.sh: the kernel mode makes network namespaces: run as root" >&2; exit 1; }
out=$(mktemp -d /tmp/pshard-link-emulation.XXXXXX)
run() {  # mode, repeat
  local name=$1-$2
  "$bin/pshard" local --servers=2 --trainers=1 --steps="$steps" --log_every=0 --metrics_port_base=0 \
    --link_rate="$rate" --link_mode="$1" --run_dir="$out/$name" > "$out/$name.log" 2>&1 ||
    { echo "link_emulation.sh: the $name run failed (see $out/$name.log)" >&2; exit 1; }
  sed -n 's/.*per step: wall \([0-9.]*\) ms.*/\1/p' "$out/$name.log" | head -1
}
median() { tr ' ' '\n' | sort -g | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
kernel=() emulated=()
for ((r = 0; r < repeats; r++)); do
  kernel+=("$(run kernel "$r")")
  emulated+=("$(run emulated "$r")")
done
k=$(echo "${kernel[*]}" | median)
e=$(echo "${emulated[*]}" | median)
printf '%s steps at %s, 2 servers, 1 trainer, %s runs each (run folders in %s)\n' "$steps" "$rate" "$repeats" "$out"
printf '  kernel (tc tbf on veth):  %s ms per step (runs: %s)\n' "$k" "${kernel[*]}"
printf '  in-process emulation:     %s ms per step (runs: %s)\n' "$e" "${emulated[*]}"
awk -v e="$e" -v k="$k" 'BEGIN {
  r = e / k; printf "  emulated / kernel:        %.3f (goal: within 0.10 of 1: %s)\n", r, (r > 0.9 && r < 1.1) ? "met" : "NOT met" }'
