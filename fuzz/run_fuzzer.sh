#!/usr/bin/env bash
# Runs one libFuzzer harness for a while over its seed corpus, with the
# settings every run uses (the CI smoke and bench/fuzz.sh):
#   fuzz/run_fuzzer.sh FUZZER SEEDS WORK SECONDS [libFuzzer flags...]
# The harness's dictionary, fuzz/dict/NAME.dict for NAME_fuzzer, is used
# when there is one. New inputs go to WORK/corpus (the committed SEEDS stay
# as they are), a crashing input to WORK/crash-*, libFuzzer's output to
# WORK/log. Exits non-zero when the harness crashed, leaked, ran out of
# memory or hung.
set -euo pipefail
if (($# < 4)); then
  echo "usage: $0 FUZZER SEEDS WORK SECONDS [libFuzzer flags...]" >&2
  exit 2
fi
fuzzer=$1 seeds=$2 work=$3 seconds=$4
shift 4
rm -rf "$work"
mkdir -p "$work/corpus"
dict=$(dirname "$0")/dict/$(basename "$fuzzer" _fuzzer).dict
[[ -f $dict ]] && set -- -dict="$dict" "$@"
status=0
# -timeout: an input that takes 10 s is a hang (every wait in the harnesses
# is bounded far below it). Inputs of 64 KiB hold a whole push of the
# harnesses' model.
# Leaks inside UCX's libraries are UCX's (fuzz/lsan.supp).
LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$(cd "$(dirname "$0")" && pwd)/lsan.supp} \
"$fuzzer" "$work/corpus" "$seeds" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
  -print_final_stats=1 -artifact_prefix="$work/" "$@" >"$work/log" 2>&1 || status=$?
# The summary lines: libFuzzer's final stats, and any report.
grep -E '^(stat::|INFO: Seed:|#[0-9]+[[:space:]]+DONE)|ERROR: |SUMMARY: |fuzz invariant broken' "$work/log" || true
if ((status != 0)); then
  echo "$(basename "$fuzzer"): FAILED (exit $status); log: $work/log; input: $(ls "$work"/crash-* "$work"/leak-* \
    "$work"/oom-* "$work"/timeout-* 2>/dev/null | head -1)" >&2
  tail -n 60 "$work/log" >&2
fi
exit "$status"
