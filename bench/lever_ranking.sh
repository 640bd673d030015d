#!/usr/bin/env bash
# Does pshard plan rank first the lever a sweep measures fastest? The demo
# job at one slow link (default 1 Gbit/s + 50 ms, where latency is what
# costs): the plan's --top levers and the baseline each run as a one-point
# sweep of --measure_steps steps after 3 skipped, --repeats times in turn
# (each lever's median counts: over 5 steps one run of a lever spread by
# about +-8% here, over 10 by about +-3%), and their measured tokens/s are
# ranked beside the plan's. Prints
# every lever's predicted and measured speedup (tokens/s over the
# baseline's, both), the plan's first pick, the fastest measured, and the
# plan's pick as a fraction of the fastest; exits 1 when that fraction is
# below --bound (default 0.95: measured within noise of the fastest).
#   bench/lever_ranking.sh [--link_rate=1gbit] [--link_delay=50ms] [--top=6] [--repeats=5] [--measure_steps=10]
#                          [--bound=0.95] [--out=DIR]
# Runs on an otherwise idle machine: each point's processes share its cores.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${TMPDIR:-/tmp}/pshard-lever-ranking
rate=1gbit delay=50ms top=6 repeats=5 measure_steps=10 bound=0.95
while (($#)); do
  case "$1" in
    --out=*) out=${1#*=} ;;
    --link_rate=*) rate=${1#*=} ;;
    --link_delay=*) delay=${1#*=} ;;
    --top=*) top=${1#*=} ;;
    --repeats=*) repeats=${1#*=} ;;
    --measure_steps=*) measure_steps=${1#*=} ;;
    --bound=*) bound=${1#*=} ;;
    *) echo "lever_ranking.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
bin=${PSHARD_BUILD_DIR:-build}/bin
[[ -x $bin/pshard ]] || { echo "lever_ranking.sh: build pshard first (tools/setup.sh)" >&2; exit 2; }
rm -rf "$out"
mkdir -p "$out"
"$bin/pshard" plan --json --link_rate="$rate" --link_delay="$delay" > "$out/plan.json"
# The levers to run: the baseline (no flags) and the plan's first --top.
/usr/bin/python3 - "$out/plan.json" "$top" > "$out/levers.txt" <<'EOF'
import json, sys
plan = json.load(open(sys.argv[1]))
print("baseline\t1.0\t")
for lever in plan["levers"][:int(sys.argv[2])]:
    # A sweep axis is --flag=value: a bare switch is =true.
    flags = " ".join(f if "=" in f else f + "=true" for f in lever["flags"].split())
    print(f"{lever['flags']}\t{lever['speedup']}\t{flags}")
EOF
[[ $repeats =~ ^[1-9][0-9]*$ ]] || { echo "lever_ranking.sh: --repeats=$repeats is not a positive number" >&2; exit 2; }
[[ $measure_steps =~ ^[1-9][0-9]*$ ]] \
  || { echo "lever_ranking.sh: --measure_steps=$measure_steps is not a positive number" >&2; exit 2; }
# Round after round, every lever once a round, so that a slower stretch of
# the machine touches them all alike; every other round in reverse order,
# so that no lever always follows the same one (the first run after the
# baseline measured 6-10% low in both runs of 2026-12-07).
n=$(wc -l < "$out/levers.txt")
for ((round = 0; round < repeats; ++round)); do
  order=$(seq 0 $((n - 1)))
  ((round % 2 == 0)) || order=$(seq $((n - 1)) -1 0)
  for i in $order; do
    IFS=$'\t' read -r name predicted flags < <(sed -n "$((i + 1))p" "$out/levers.txt")
    point=$out/$i.$round
    # shellcheck disable=SC2086  # the lever's flags are words
    "$bin/pshard" sweep --out="$point" --calibrate=false --skip_steps=3 --measure_steps="$measure_steps" \
      --link_rate="$rate" --link_delay="$delay" $flags > "$point.log" 2>&1 \
      || { echo "lever_ranking.sh: the sweep of '$name' failed: $point.log" >&2; tail -5 "$point.log" >&2; exit 1; }
    measured=$(awk -F, 'NR == 1 { for (c = 1; c <= NF; ++c) col[$c] = c; next } { print $col["measured_tokens_per_s"] }' \
      "$point/results.csv")
    printf '%s\t%s\t%s\t%s\n' "$i" "$name" "$predicted" "$measured" >> "$out/ranking.tsv"
  done
done
/usr/bin/python3 - "$out/ranking.tsv" "$bound" "$rate" "$delay" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    i, name, predicted, measured = line.rstrip("\n").split("\t")
    runs.setdefault(int(i), (name, float(predicted), []))[2].append(float(measured))
order = sorted(runs)
base = statistics.median(runs[0][2])
levers = [(runs[i][0], runs[i][1], statistics.median(runs[i][2]) / base) for i in order[1:]]
spread = {runs[i][0]: (min(runs[i][2]) / base, max(runs[i][2]) / base) for i in order[1:]}
print(f"the demo at {sys.argv[3]} + {sys.argv[4]}: baseline {base:.0f} tokens/s measured (median of "
      f"{len(runs[0][2])})")
print(f"  {'lever':96} {'predicted':>9} {'measured':>9}  runs")
for name, p, m in levers:
    low, high = spread[name]
    print(f"  {name:96} {p:8.2f}x {m:8.2f}x  {low:.2f}-{high:.2f}x")
first = levers[0]
fastest = max(levers, key=lambda l: l[2])
fraction = first[2] / fastest[2]
print(f"plan's first: {first[0]} ({first[2]:.2f}x measured)")
print(f"measured fastest: {fastest[0]} ({fastest[2]:.2f}x)")
print(f"the plan's first reaches {fraction:.3f} of the fastest measured (bound {float(sys.argv[2]):.2f})")
if first[0] != fastest[0] and spread[first[0]][1] >= spread[fastest[0]][0]:
    print("  (their runs overlap: these runs do not tell the two apart)")
sys.exit(0 if fraction >= float(sys.argv[2]) else 1)
EOF
