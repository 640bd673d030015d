#!/usr/bin/env bash
# Overlap benchmark: does a trainer hide its communication behind compute?
# Runs `pshard local` (N shard servers, one trainer) twice on the same model:
#   compute-bound: links as fast as the machine allows;
#   comm-bound:    every trainer-server link emulated at a rate that makes the
#                  step's transfers take about --comm_factor x the compute
#                  time measured in the first run.
# For each it reads the trainer's own per-step figures (wall, compute, comm
# busy: the time any fetch, push or host-device copy was in flight) and
# prints wall / max(compute, comm busy), goal <= 1.15: a perfectly
# overlapped step takes as long as the longer of the two.
#
#   bench/overlap.sh [--bin_dir=build/bin] [--device=cpu|cuda] [--out=DIR]
#                    [--comm_factor=2] [--steps=12] [-- extra pshard local flags]
# Default model: on cpu, 6 x 256 at batch 8 x 128; on cuda, the GPT-2 124M
# configuration with 64 micro-batches of 8 x 1024 per step in one pass
# (--fetch_once_per_step, blocks recomputed to fit them): the GPU computes
# for longer than the step's fetches and pushes take at loopback speed.
set -euo pipefail
bin=build/bin device=cpu out="" factor=2 steps=12
extra=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --bin_dir=*) bin=${1#*=} ;;
    --device=*) device=${1#*=} ;;
    --out=*) out=${1#*=} ;;
    --comm_factor=*) factor=${1#*=} ;;
    --steps=*) steps=${1#*=} ;;
    --) shift; extra=("$@"); break ;;
    *) echo "overlap.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[[ -x $bin/pshard ]] || { echo "overlap.sh: no pshard in $bin (build first, or pass --bin_dir)" >&2; exit 2; }
out=${out:-$(mktemp -d /tmp/pshard-overlap.XXXXXX)}
mkdir -p "$out"
servers=2
if [[ $device == cpu ]]; then
  model=(--layers=6 --d_model=256 --heads=8 --context=128 --seq_len=128 --batch=8)
else
  model=(--layers=12 --d_model=768 --heads=12 --context=1024 --seq_len=1024 --batch=8 --micro_batches=64
         --accumulate_on_trainer --fetch_once_per_step --recompute)
fi

# Runs one setting; prints "wall compute busy mib" per step (ms, ms, ms, MiB).
run() {
  local name=$1
  shift
  env "$@" "$bin/pshard" local --bin_dir="$bin" --run_dir="$out/$name" --servers=$servers --trainers=1 \
    --metrics_port_base=0 --steps="$steps" --log_every=0 --warmup_steps=2 --device="$device" "${model[@]}" \
    "${extra[@]}" > "$out/$name.log" 2>&1 || { echo "overlap.sh: $name run failed, see $out/$name.log" >&2; exit 1; }
  sed -nE 's/^  per step: wall ([0-9.]+) ms \| compute ([0-9.]+) ms \| comm busy ([0-9.]+) ms \|.* = ([0-9.]+) MiB on the wire.*/\1 \2 \3 \4/p' \
    "$out/$name.log"
}

report() {
  awk -v name="$1" -v w="$2" -v c="$3" -v b="$4" 'BEGIN {
    m = c > b ? c : b
    printf "%-14s: step %8.1f ms | compute %8.1f ms | comm busy %8.1f ms | step / max(compute, comm) = %.3f (goal <= 1.15)\n",
           name, w, c, b, w / m }'
}

read -r w1 c1 b1 mib < <(run compute-bound)
[[ -n ${mib:-} ]] || { echo "overlap.sh: no per-step summary in $out/compute-bound.log" >&2; exit 1; }
# Each of the trainer's links carries 1/N of the step's bytes.
rate=$(awk -v mib="$mib" -v c="$c1" -v f="$factor" -v n=$servers \
  'BEGIN { printf "%.0fkbit", mib * 1048576 * 8 / 1000 / n / (f * c / 1000) }')
read -r w2 c2 b2 _ < <(run comm-bound PSHARD_LINK_RATE="$rate")
echo "overlap: $device, $servers shard servers, 1 trainer, ${mib} MiB on the wire per step; logs in $out"
report compute-bound "$w1" "$c1" "$b1"
echo "comm-bound links: $rate each (about ${factor}x the compute time for the step's bytes)"
report comm-bound "$w2" "$c2" "$b2"
