#!/usr/bin/env bash
# Soak: a job of 8 shard servers and 8 trainers (a small model) trains for
# about --minutes while processes are SIGKILLed at random (trainers, and
# with --kill_servers servers too); `pshard local` restarts them and the
# job rolls back and redoes what they lost. Every 10 s each server's
# resident memory and open file descriptors are sampled. At the end the
# job's checkpoints are compared byte for byte with those of the same job
# run undisturbed: an update lost or applied twice would differ.
#
#   bench/soak.sh [--bin_dir=build/bin] [--minutes=10] [--kill_every=5-20] [--kill_servers] [--out=DIR]
#
# Bounds checked (after the first minute, to the end, per server): resident
# memory grows by at most 32 MiB and open descriptors by at most 16.
set -euo pipefail
bin=build/bin minutes=10 kill_every=5-20 kill_servers=0 out=""
while [[ $# -gt 0 ]]; do
  case $1 in
    --bin_dir=*) bin=${1#*=} ;;
    --minutes=*) minutes=${1#*=} ;;
    --kill_every=*) kill_every=${1#*=} ;;
    --kill_servers) kill_servers=1 ;;
    --out=*) out=${1#*=} ;;
    *) echo "soak.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
[[ $kill_every =~ ^([0-9]+)-([0-9]+)$ ]] || { echo "soak.sh: --kill_every=$kill_every is not MIN-MAX seconds" >&2; exit 2; }
kill_min=${BASH_REMATCH[1]} kill_max=${BASH_REMATCH[2]}
out=${out:-$(mktemp -d /tmp/pshard-soak.XXXXXX)}
mkdir -p "$out"
job=(--servers=8 --trainers=8 --layers=2 --d_model=64 --heads=2 --context=32 --seq_len=32 --batch=4
     --log_every=0 --metrics_port_base=0 --checkpoint_every=1 --checkpoint_keep=2)

# Steps for about `minutes` of undisturbed training, from a short run.
"$bin/pshard" local "${job[@]}" --steps=20 --run_dir="$out/calibrate" --checkpoint_dir="$out/calibrate/ckpt" \
  > "$out/calibrate.log" 2>&1 || { echo "soak.sh: calibration run failed ($out/calibrate.log)" >&2; exit 1; }
step_ms=$(sed -n 's/.*per step: wall \([0-9.]*\) ms.*/\1/p' "$out/calibrate.log" | head -1)
steps=$(awk -v m="$minutes" -v s="$step_ms" 'BEGIN {printf "%d", m * 60000 / s}')
echo "soak: $step_ms ms per step undisturbed: $steps steps for about $minutes minutes (folder $out)"

echo "soak: the undisturbed run"
"$bin/pshard" local "${job[@]}" --steps="$steps" --run_dir="$out/plain" --checkpoint_dir="$out/plain/ckpt" \
  > "$out/plain.log" 2>&1 || { echo "soak.sh: the undisturbed run failed ($out/plain.log)" >&2; exit 1; }

echo "soak: the run with kills"
"$bin/pshard" local "${job[@]}" --steps="$steps" --run_dir="$out/soak" --checkpoint_dir="$out/soak/ckpt" \
  --trainer_restarts=100000 --server_restarts=100000 > "$out/soak.log" 2>&1 &
launcher=$!
samples=$out/samples.csv
echo "seconds,shard,rss_kib,fds" > "$samples"
kills=0 trainer_kills=0 server_kills=0
start=$SECONDS next_sample=$SECONDS next_kill=$((SECONDS + kill_min + RANDOM % (kill_max - kill_min + 1)))
while kill -0 "$launcher" 2> /dev/null; do
  if ((SECONDS >= next_sample)); then
    for ((s = 0; s < 8; s++)); do
      pid=$(pgrep -f "pshard-server --shard_index=$s .*$out/soak/" | head -1 || true)
      [[ -n $pid ]] || continue
      rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2> /dev/null || echo "")
      fds=$(ls "/proc/$pid/fd" 2> /dev/null | wc -l)
      [[ -n $rss ]] && echo "$((SECONDS - start)),$s,$rss,$fds" >> "$samples"
    done
    next_sample=$((next_sample + 10))
  fi
  # No kills in the last steps: a server killed while the job shuts down
  # loses its final checkpoint, and the comparison would fail for it.
  logged=0
  [[ -f $out/soak/trainer0.steps.jsonl ]] && logged=$(wc -l < "$out/soak/trainer0.steps.jsonl")
  if ((SECONDS >= next_kill && logged + 40 < steps)); then
    if ((kill_servers && RANDOM % 3 == 0)); then
      victim=$(pgrep -f "pshard-server --shard_index=$((RANDOM % 8)) .*$out/soak/" | head -1 || true)
      [[ -n $victim ]] && kill -9 "$victim" && server_kills=$((server_kills + 1))
    else
      victim=$(pgrep -f "pshard-trainer .*--rank=$((RANDOM % 8)) .*$out/soak/" | head -1 || true)
      [[ -n $victim ]] && kill -9 "$victim" && trainer_kills=$((trainer_kills + 1))
    fi
    next_kill=$((SECONDS + kill_min + RANDOM % (kill_max - kill_min + 1)))
  fi
  sleep 1
done
status=0
wait "$launcher" || status=$?
elapsed=$((SECONDS - start))
echo "soak: the run with kills took $elapsed s and exited $status; $trainer_kills trainers and $server_kills servers killed"
((status == 0)) || { echo "soak.sh: the run with kills failed ($out/soak.log)"; tail -20 "$out/soak.log"; exit 1; }

verdict=0
same=0
for f in "$out"/plain/ckpt/shard-*-of-8.step-"$(printf '%010d' "$steps")".ckpt; do
  if cmp -s "$f" "$out/soak/ckpt/$(basename "$f")"; then same=$((same + 1)); else verdict=1; echo "soak: $(basename "$f") differs"; fi
done
echo "soak: $same of 8 final shard checkpoints equal the undisturbed run's byte for byte"
((same == 8)) || verdict=1
# Growth from the first sample after a minute to the last, per server.
awk -F, -v rss_bound=$((32 * 1024)) -v fd_bound=16 '
  NR > 1 && $1 >= 60 {
    if (!($2 in first_rss)) { first_rss[$2] = $3; first_fds[$2] = $4 }
    last_rss[$2] = $3; last_fds[$2] = $4
    if ($3 > max_rss[$2]) max_rss[$2] = $3
  }
  END {
    bad = 0
    for (s in first_rss) {
      grow = last_rss[s] - first_rss[s]; fgrow = last_fds[s] - first_fds[s]
      printf "soak: server %d: RSS %.1f -> %.1f MiB (max %.1f), fds %d -> %d\n", s, first_rss[s] / 1024,
             last_rss[s] / 1024, max_rss[s] / 1024, first_fds[s], last_fds[s]
      if (grow > rss_bound || fgrow > fd_bound) bad = 1
    }
    exit bad
  }' "$samples" || { echo "soak: a server grew past the bounds (32 MiB, 16 descriptors)"; verdict=1; }
((verdict == 0)) && echo "soak: PASSED" || echo "soak: FAILED"
exit "$verdict"
