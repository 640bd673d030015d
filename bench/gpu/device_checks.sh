#!/usr/bin/env bash
# The checks that need an NVIDIA GPU, in one run:
#   bench/gpu/device_checks.sh BIN_DIR OUT_DIR [pshard local flags...]
# BIN_DIR holds a -DPSHARD_WITH_CUDA=ON build's binaries (pshard,
# pshard-server, pshard-trainer and its GPU plugin libpshard_gpu.so,
# cuda_gpt_test, cuda_trainer_test and, with -DPSHARD_WITH_NCCL=ON,
# nccl_group_test); every
# result goes to OUT_DIR (one log per check, and summary.txt).
#  1. cuda_gpt_test: the CUDA model against the CPU fp32 model, op by op.
#  2. cuda_trainer_test: GPU and CPU trainers on the same job agree within
#     bf16 precision; nccl_group_test: an NCCL group of one (its unique id
#     through the servers' rendezvous) trains bit-identically to no group.
#  3. The GPT-2 124M configuration (12 layers, width 768, 12 heads, context
#     1024, byte vocabulary) trains 50 steps on the GPU against a shard server
#     on the same machine; the loss must fall.
#  4. Benchmarks: gpu_compute_bench (MFU, recompute on/off, against PyTorch
#     eager), end_to_end.sh (GPU trainer against shard servers, against
#     PyTorch eager) and ../overlap.sh --device=cuda (step time against
#     max(compute, comm), compute-bound and comm-bound).
# Each check has its own time limit, so one that hangs cannot eat the rest.
# Flags after OUT_DIR (e.g. --attention=materialized) go to every pshard
# local run: the GPT-2 run, end_to_end.sh and overlap.sh.
set -uo pipefail
bin=${1:?usage: device_checks.sh BIN_DIR OUT_DIR}
out=${2:?usage: device_checks.sh BIN_DIR OUT_DIR}
shift 2
extra=("$@")
mkdir -p "$out"
summary="$out/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
note "gpu: $(cat "$out/gpu.txt")"

here=$(cd "$(dirname "$0")" && pwd)
for t in cuda_gpt_test cuda_trainer_test nccl_group_test; do
  if [[ -x $bin/$t ]]; then
    timeout 180 "$bin/$t" > "$out/$t.log" 2>&1
    note "$t: exit $? ($(grep -E '^\[  (PASSED|FAILED|SKIPPED)' "$out/$t.log" | tr '\n' ' '))"
  else
    note "$t: missing from $bin"
  fi
done

start=$(date +%s)
timeout 240 "$bin/pshard" local --bin_dir="$bin" --run_dir="$out/gpt2" --servers=1 --trainers=1 --metrics_port_base=0 \
  --layers=12 --d_model=768 --heads=12 --context=1024 --seq_len=1024 --batch=4 --steps=50 \
  --warmup_steps=10 --lr=6e-4 --min_lr=6e-5 --device=cuda --log_every=5 "${extra[@]}" > "$out/gpt2.log" 2>&1
code=$?
note "gpt2-124M, 50 steps on cuda: exit $code in $(( $(date +%s) - start )) s"
grep -E '^(pshard:|step |trainer 0 summary|  time:)' "$out/gpt2.log" | tee -a "$summary"
first=$(grep -oE '^step [0-9]+/[0-9]+ \| loss [0-9.]+' "$out/gpt2.log" | head -1 | awk '{print $5}')
last=$(grep -oE 'final loss [0-9.]+' "$out/gpt2.log" | awk '{print $3}')
if [[ -n $first && -n $last ]] && awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a) }'; then
  note "gpt2-124M loss fell: $first -> $last"
else
  note "gpt2-124M loss did NOT fall (first ${first:-?}, final ${last:-?})"
fi

if [[ -x $bin/gpu_compute_bench ]]; then
  timeout 150 "$bin/gpu_compute_bench" --torch_script="$here/torch_gpt.py" > "$out/compute_bench.log" 2>&1
  code=$?
  note "gpu_compute_bench: exit $code"
  if [[ $code -ne 0 ]]; then  # a kernel fault ends the process: the materialized attention alone
    timeout 120 "$bin/gpu_compute_bench" --attention=materialized --torch_script="$here/torch_gpt.py" \
      >> "$out/compute_bench.log" 2>&1
    note "gpu_compute_bench --attention=materialized: exit $?"
  fi
  grep -vE '^\{' "$out/compute_bench.log" | tee -a "$summary"
else
  note "gpu_compute_bench: missing from $bin"
fi
timeout 240 "$here/end_to_end.sh" "$bin" "$out/e2e" -- "${extra[@]}" > "$out/end_to_end.log" 2>&1
note "end_to_end.sh: exit $?"
grep -E '^(end to end|  )' "$out/end_to_end.log" | tee -a "$summary"
timeout 240 "$here/../overlap.sh" --bin_dir="$bin" --device=cuda --out="$out/overlap" -- "${extra[@]}" \
  > "$out/overlap.log" 2>&1
note "overlap.sh --device=cuda: exit $?"
tee -a "$summary" < "$out/overlap.log"
