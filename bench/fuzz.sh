#!/usr/bin/env bash
# Fuzzing benchmark: runs every libFuzzer harness of fuzz/ (ASan + UBSan)
# for a while, one after another, each from its committed seed corpus, and
# writes a table: per harness the time it ran, inputs executed, inputs per
# second, coverage (libFuzzer's edges and features at the end), its corpus
# at the end (inputs and bytes, seeds included), peak memory, and whether
# it crashed (the input is kept in the harness's work folder).
#
#   bench/fuzz.sh [--seconds=600] [--build_dir=build-fuzz] [--out=DIR] [--only=name,...]
#                 [-- extra libFuzzer flags]
# It builds the fuzzers first (PSHARD_FUZZ=1 tools/setup.sh, which also
# installs clang-14). Runs one harness at a time: on a shared machine
# start it under `nice`. Results: DIR/summary.md (the table) and
# DIR/<name>/ (log, new inputs, any crash); DIR defaults to
# <build_dir>/fuzz-bench.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=600 build=build-fuzz out="" only=""
extra=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --seconds=*) seconds=${1#*=} ;;
    --build_dir=*) build=${1#*=} ;;
    --out=*) out=${1#*=} ;;
    --only=*) only=${1#*=} ;;
    --) shift; extra=("$@"); break ;;
    *) echo "fuzz.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
out=${out:-$build/fuzz-bench}

PSHARD_FUZZ=1 PSHARD_BUILD_DIR="$build" PSHARD_CMAKE_ARGS= tools/setup.sh >/dev/null

names=()
for corpus in fuzz/corpus/*/; do
  name=$(basename "$corpus")
  if [[ -z $only || ",$only," == *",$name,"* ]]; then names+=("$name"); fi
done
mkdir -p "$out"
summary=$out/summary.md
{
  echo "| harness | seconds | executions | exec/s | coverage (edges) | features | corpus (inputs/bytes) |" \
    "peak RSS (MB) | result |"
  echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
} >"$summary"
failed=0
for name in "${names[@]}"; do
  echo "fuzz.sh: $name for $seconds s" >&2
  status=0
  started=$SECONDS
  fuzz/run_fuzzer.sh "$build/bin/${name}_fuzzer" "fuzz/corpus/$name" "$out/$name" "$seconds" "${extra[@]}" \
    >"$out/$name.stats" 2>&1 || status=$?
  elapsed=$((SECONDS - started))
  log=$out/$name/log
  final_stat() { awk -v key="stat::$1:" '$1 == key { print $2 }' "$out/$name.stats"; }
  # The last status line: "#N DONE cov: C ft: F corp: I/SIZE ..." (or the last pulse before a crash).
  last=$(grep -E '^#[0-9]+[[:space:]]+(DONE|NEW|REDUCE|pulse|INITED)' "$log" | tail -1)
  cov=$(sed -nE 's/.* cov: ([0-9]+).*/\1/p' <<<"$last")
  ft=$(sed -nE 's/.* ft: ([0-9]+).*/\1/p' <<<"$last")
  corp=$(sed -nE 's/.* corp: ([0-9]+\/[0-9]+[a-zA-Z]*).*/\1/p' <<<"$last")
  result="no crash"
  if ((status != 0)); then
    failed=1
    report=$(grep -m1 -E 'SUMMARY: |fuzz invariant broken|ERROR: libFuzzer' "$log" || echo "exit $status")
    result="CRASH: ${report//|/\\|} (input in $out/$name/)"
  fi
  echo "| $name | $elapsed | $(final_stat number_of_executed_units) | $(final_stat average_exec_per_sec) |" \
    "${cov:-?} | ${ft:-?} | ${corp:-?} | $(final_stat peak_rss_mb) | $result |" >>"$summary"
done
cat "$summary"
exit "$failed"
