#!/usr/bin/env bash
# Install, build, and run the tests, in both configurations users build:
# the default one (./build), then, where the CUDA toolkit is installed, the
# CUDA + NCCL one (./build-cuda; its GPU tests skip without a device).
# Extra arguments go to both ctest runs, e.g.
#   tools/test.sh -L unit        only the unit tests
#   tools/test.sh -LE slow       everything but the slow ones
# PSHARD_TEST_CUDA=0 skips the CUDA configuration; =1 requires it. Both
# configurations require UCX and the PyTorch bridge (configure fails
# without them, rather than their tests going missing).
# A run without arguments then builds the fuzzers (./build-fuzz, clang with
# ASan + UBSan) and runs each for 20 s over its seeds, two at a time
# (ctest -L fuzz); PSHARD_TEST_FUZZ=0 skips that, =1 runs it with arguments too.
set -euo pipefail
cd "$(dirname "$0")/.."
# UCX and the PyTorch bridge are optional for users (AUTO), but not here: a
# missing library fails configure instead of leaving their tests out.
required="-DPSHARD_WITH_UCX=ON -DPSHARD_WITH_PYTHON=ON"
PSHARD_CMAKE_ARGS="$required ${PSHARD_CMAKE_ARGS:-}" tools/setup.sh
status=0
(cd "${PSHARD_BUILD_DIR:-build}" && ctest --output-on-failure -j "$(nproc)" "$@") || status=$?

nvcc=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
if [[ ${PSHARD_TEST_CUDA:-auto} == 0 ]]; then
  echo "pshard test: PSHARD_TEST_CUDA=0: the CUDA + NCCL configuration is not built or tested"
elif [[ -x $nvcc ]]; then
  started=$SECONDS
  echo "pshard test: building the CUDA + NCCL configuration in build-cuda ($nvcc)"
  PSHARD_BUILD_DIR=build-cuda PSHARD_CMAKE_ARGS="$required -DPSHARD_WITH_CUDA=ON -DPSHARD_WITH_NCCL=ON \
-DCMAKE_CUDA_COMPILER=$nvcc -DCMAKE_CUDA_ARCHITECTURES=80;90" tools/setup.sh
  # The deployment tests check files and images, not the build; the slow
  # ones run the demo's 300 steps on CPU trainers, and the python ones the
  # PyTorch bridge on the CPU: the same code in both configurations, which
  # the default configuration ran; so do the perf floors of the data path.
  (cd build-cuda && ctest --output-on-failure -j "$(nproc)" -LE 'containers|deploy|slow|python|perf' "$@") || status=$?
  echo "pshard test: the CUDA + NCCL configuration took $((SECONDS - started)) s"
elif [[ ${PSHARD_TEST_CUDA:-auto} == 1 ]]; then
  echo "pshard test: PSHARD_TEST_CUDA=1 but no CUDA compiler ($nvcc) is installed" >&2
  exit 1
else
  echo "pshard test: no CUDA toolkit ($nvcc not found): the CUDA + NCCL configuration is not built or tested"
fi
fuzz=${PSHARD_TEST_FUZZ:-auto}
if [[ $fuzz == 0 || ($fuzz == auto && $# -gt 0) ]]; then
  echo "pshard test: the fuzz smoke is not run (PSHARD_TEST_FUZZ=1 runs it)"
else
  started=$SECONDS
  echo "pshard test: building the fuzzers in build-fuzz (clang-14, ASan + UBSan)"
  PSHARD_FUZZ=1 PSHARD_BUILD_DIR=build-fuzz PSHARD_CMAKE_ARGS= tools/setup.sh
  (cd build-fuzz && ctest --output-on-failure -L fuzz -j 2) || status=$?
  echo "pshard test: the fuzz smoke took $((SECONDS - started)) s"
fi
exit "$status"
