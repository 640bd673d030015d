#!/usr/bin/env bash
# End-to-end GPU benchmark: a GPU trainer training GPT-2 124M (12 x 768, 12
# heads, context 1024, byte vocabulary) against shard servers on the same
# machine, against PyTorch eager (bench/gpu/torch_gpt.py: forward + backward
# of the same model, batch and sequence length on the same GPU, bf16
# weights, scaled_dot_product_attention), measured in the same run.
#
# The trainer runs each step's K micro-batches in one pass
# (--fetch_once_per_step), so every unit is fetched and pushed once per step
# whatever K: with enough tokens per step the fetches are amortised. Its rate
# is that of the last logging window (steps after the first window, whose
# start-up it leaves out); goal: ratio >= 0.8.
#
#   bench/gpu/end_to_end.sh BIN_DIR [OUT_DIR] [--micro_batches=8] [--batch=16]
#                           [--servers=8] [--steps=12] [--python=python3]
#                           [-- extra pshard local flags, e.g. --recompute]
set -euo pipefail
bin=${1:?usage: end_to_end.sh BIN_DIR [OUT_DIR] [flags]}
shift
out=""
if [[ $# -gt 0 && $1 != --* ]]; then out=$1; shift; fi
micro=8 batch=16 servers=8 steps=12 python=python3
extra=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --micro_batches=*) micro=${1#*=} ;;
    --batch=*) batch=${1#*=} ;;
    --servers=*) servers=${1#*=} ;;
    --steps=*) steps=${1#*=} ;;
    --python=*) python=${1#*=} ;;
    --) shift; extra=("$@"); break ;;
    *) echo "end_to_end.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
here=$(cd "$(dirname "$0")" && pwd)
out=${out:-$(mktemp -d /tmp/pshard-e2e.XXXXXX)}
mkdir -p "$out"
model=(--layers=12 --d_model=768 --heads=12 --context=1024)

"$python" "$here/torch_gpt.py" "${model[@]}" --batch="$batch" --seq_len=1024 --iters=20 > "$out/torch.json" \
  2> "$out/torch.log" || { echo "end_to_end.sh: the PyTorch baseline failed, see $out/torch.log" >&2; exit 1; }
torch_rate=$(tail -1 "$out/torch.json" | "$python" -c 'import json, sys; print(json.load(sys.stdin)["tokens_per_s"])')

half=$(( steps / 2 ))
"$bin/pshard" local --bin_dir="$bin" --run_dir="$out/pshard" --servers="$servers" --trainers=1 \
  --metrics_port_base=0 "${model[@]}" --seq_len=1024 --batch="$batch" --micro_batches="$micro" \
  --accumulate_on_trainer --fetch_once_per_step --steps="$steps" --log_every="$half" --warmup_steps=2 \
  --lr=6e-4 --min_lr=6e-5 --device=cuda "${extra[@]}" > "$out/pshard.log" 2>&1 ||
  { echo "end_to_end.sh: the pshard run failed, see $out/pshard.log" >&2; exit 1; }
# "step 12/12 | loss 2.345 | 123.4k tok/s (cluster) | ..." of the last window.
pshard_rate=$(grep -E '^step [0-9]+/[0-9]+ \|' "$out/pshard.log" | tail -1 |
  awk -F'|' '{ r = $3; gsub(/ tok\/s \(cluster\)| /, "", r); m = 1
               if (r ~ /k$/) { m = 1e3; sub(/k$/, "", r) } else if (r ~ /M$/) { m = 1e6; sub(/M$/, "", r) }
               printf "%.0f", r * m }')
grep -E '^(pshard:|step |trainer 0 summary|  time:|  per step:)' "$out/pshard.log"
awk -v p="$pshard_rate" -v t="$torch_rate" -v k="$micro" -v b="$batch" -v n="$servers" 'BEGIN {
  printf "end to end: pshard %d tok/s (%d micro-batches of %d x 1024 per step, %d shard servers on this machine)\n", p, k, b, n
  printf "            PyTorch eager forward+backward %d tok/s (batch %d x 1024)\n", t, b
  printf "            ratio %.2f (goal >= 0.8)\n", p / t }'
