#!/usr/bin/env bash
# Slow-link levers benchmark: what each lever buys back at an emulated slow
# link (default 100 Mbit/s + 2 ms one way, each node's interface: every
# server and trainer on its own node). For one model it runs `pshard
# local` once per setting and prints, per setting, the step time, the
# exposed communication, the bytes per step on the slow link (trainer 0's,
# fetched + pushed) and the final loss (mean of the last 10 steps), with each
# ratio against stage 3 bf16 measured in the same run:
#   stage3_bf16        the baseline: ZeRO stage 3, bf16 both ways
#   kept               --reshard_after_forward=false
#   int8_weights       --weight_encoding=int8
#   int8_grads         --grad_encoding=int8
#   int4_grads         --grad_encoding=int4 (error feedback on)
#   group2             --fabric_group_size=2: each member fetches and pushes
#                      half of every unit over the slow link, the group
#                      all-gathers and reduces the rest on its fabric, which
#                      is emulated too (default 10 Gbit/s + 50 us one way per
#                      member: a fast network inside a site, not free)
#   best               all of the above together (int8 weights, int4
#                      gradients, units kept, groups of 2)
# Goal for `best`: >= 4x fewer bytes and >= 3x shorter steps than stage3_bf16,
# final loss within 2%.
#
#   bench/levers.sh [--bin_dir=build/bin] [--model=demo|20m] [--steps=N] [--batch=B]
#                   [--link_rate=100mbit] [--link_delay=2ms] [--fabric_rate=10gbit] [--fabric_delay=50us]
#                   [--out=DIR] [-- extra pshard local flags]
# Models: demo = `pshard local`'s default GPT (4 x 128, 0.87M parameters);
# 20m = 6 x 512 (19.3M parameters). Steps default to 300 (demo) and 30 (20m).
set -euo pipefail
bin=build/bin model=demo steps="" batch=8 rate=100mbit delay=2ms fabric_rate=10gbit fabric_delay=50us out=""
extra=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --bin_dir=*) bin=${1#*=} ;;
    --model=*) model=${1#*=} ;;
    --steps=*) steps=${1#*=} ;;
    --batch=*) batch=${1#*=} ;;
    --link_rate=*) rate=${1#*=} ;;
    --link_delay=*) delay=${1#*=} ;;
    --fabric_rate=*) fabric_rate=${1#*=} ;;
    --fabric_delay=*) fabric_delay=${1#*=} ;;
    --out=*) out=${1#*=} ;;
    --) shift; extra=("$@"); break ;;
    *) echo "levers.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[[ -x $bin/pshard ]] || { echo "levers.sh: no pshard in $bin (build first, or pass --bin_dir)" >&2; exit 2; }
case $model in
  demo) shape=(); steps=${steps:-300} ;;
  20m) shape=(--layers=6 --d_model=512 --heads=8 --context=64 --seq_len=64); steps=${steps:-30} ;;
  *) echo "levers.sh: --model=$model: expected demo or 20m" >&2; exit 2 ;;
esac
out=${out:-$(mktemp -d /tmp/pshard-levers.XXXXXX)}
mkdir -p "$out"

names=(stage3_bf16 kept int8_weights int8_grads int4_grads group2 best)
declare -A flags=(
  [stage3_bf16]="--encoding=bf16"
  [kept]="--reshard_after_forward=false"
  [int8_weights]="--weight_encoding=int8"
  [int8_grads]="--grad_encoding=int8"
  [int4_grads]="--grad_encoding=int4"
  [group2]="--fabric_group_size=2 --fabric_rate=$fabric_rate --fabric_delay=$fabric_delay"
  [best]="--weight_encoding=int8 --grad_encoding=int4 --reshard_after_forward=false --fabric_group_size=2 --fabric_rate=$fabric_rate --fabric_delay=$fabric_delay"
)

# Runs one setting; prints "wall exposed mib loss" (ms, ms, MiB per step, nats).
run() {
  local name=$1
  # shellcheck disable=SC2086  # the flags are words
  "$bin/pshard" local --bin_dir="$bin" --run_dir="$out/$name" --servers=4 --trainers=2 --metrics_port_base=0 \
    --steps="$steps" --log_every=0 --batch="$batch" --link_rate="$rate" --link_delay="$delay" "${shape[@]}" \
    ${flags[$name]} "${extra[@]}" > "$out/$name.log" 2>&1 ||
    { echo "levers.sh: $name run failed, see $out/$name.log" >&2; exit 1; }
  local loss
  loss=$(sed -nE 's/^trainer 0 summary: .* final loss ([0-9.]+) .*/\1/p' "$out/$name.log")
  sed -nE 's/^  per step: wall ([0-9.]+) ms \|.* exposed comm ([0-9.]+) ms \|.* = ([0-9.]+) MiB on the wire.*/\1 \2 \3/p' \
    "$out/$name.log" | head -1 | sed "s/\$/ $loss/"
}

echo "levers: model $model, $steps steps, batch $batch x seq per trainer, 4 servers, 2 trainers, link $rate + $delay," \
  "fabric (groups) $fabric_rate + $fabric_delay"
printf '%-13s %10s %10s %11s %8s | %9s %9s %7s\n' setting "step ms" "exposed" "MiB/step" loss \
  "faster" "fewer B" "loss"
base=""
for name in "${names[@]}"; do
  read -r wall exposed mib loss < <(run "$name")
  [[ -n $base ]] || base="$wall $mib $loss"
  read -r bwall bmib bloss <<< "$base"
  awk -v n="$name" -v w="$wall" -v e="$exposed" -v m="$mib" -v l="$loss" -v bw="$bwall" -v bm="$bmib" -v bl="$bloss" \
    'BEGIN { printf "%-13s %10.1f %10.1f %11.2f %8.3f | %8.2fx %8.2fx %+6.1f%%\n", n, w, e, m, l, bw / w, bm / m,
             100 * (l / bl - 1) }'
done
echo "logs in $out"
