#!/usr/bin/env bash
# What checkpointing every step costs: `pshard local` trains the same job
# twice, without checkpoints and with --checkpoint_every=1 (each shard
# writes its master slices and AdamW moments, fsynced, every step, while
# the trainers compute the next step), and prints the mean step time of
# each, their ratio, and the servers' mean write time per checkpoint.
#
#   bench/checkpoint_cost.sh [--bin_dir=build/bin] [--model=demo|20m] [--steps=N] [--dir=FOLDER]
# Models: demo = `pshard local`'s default (0.87M parameters), 20m = 6 x 512
# (19.3M). --dir: where the checkpoints go (default: under the run folder).
set -euo pipefail
bin=build/bin model=demo steps=100 dir=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --bin_dir=*) bin=${1#*=} ;;
    --model=*) model=${1#*=} ;;
    --steps=*) steps=${1#*=} ;;
    --dir=*) dir=${1#*=} ;;
    *) echo "checkpoint_cost.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
case $model in
  demo) sizes=() ;;
  20m) sizes=(--layers=6 --d_model=512 --heads=8 --context=64) ;;
  *) echo "checkpoint_cost.sh: --model=$model is not demo or 20m" >&2; exit 2 ;;
esac
out=$(mktemp -d /tmp/pshard-ckpt-cost.XXXXXX)
run() {  # name, extra flags...
  local name=$1; shift
  "$bin/pshard" local --steps="$steps" --log_every=0 --metrics_port_base=0 "${sizes[@]}" \
    --run_dir="$out/$name" "$@" > "$out/$name.log" 2>&1 ||
    { echo "checkpoint_cost.sh: the $name run failed (see $out/$name.log)" >&2; exit 1; }
  # trainer 0's summary: "per step: wall 38.1 ms | ..."
  sed -n 's/.*per step: wall \([0-9.]*\) ms.*/\1/p' "$out/$name.log" | head -1
}
plain=$(run plain)
ckpt_dir=${dir:-$out/checkpointing/ckpt}
every=$(run checkpointing --checkpoint_dir="$ckpt_dir" --checkpoint_every=1)
write_ms=$(cat "$out"/checkpointing/server*.log |
  sed -n 's/.*checkpoint of step [0-9]* written to .* (\([0-9]*\) ms)$/\1/p' |
  awk '{s += $1; n++} END {if (n) printf "%.1f", s / n; else print "?"}')
bytes=$(du -b "$ckpt_dir"/shard-0-of-*.step-*"$(printf '%010d' "$steps")".ckpt | cut -f1)
printf 'model %s, %s steps (run folders in %s)\n' "$model" "$steps" "$out"
printf '  no checkpoints:          %s ms per step\n' "$plain"
printf '  a checkpoint every step: %s ms per step (%s x), each shard writing %s bytes in %s ms on average\n' \
  "$every" "$(awk -v a="$every" -v b="$plain" 'BEGIN {printf "%.2f", a / b}')" "$bytes" "$write_ms"
