#!/usr/bin/env bash
# Install, build, and run the tests. Extra arguments go to ctest, e.g.
#   tools/test.sh -L unit        only the unit tests
#   tools/test.sh -LE slow       everything but the slow ones
# Tests labelled gpu skip themselves when no GPU is present.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
cd "${PSHARD_BUILD_DIR:-build}"
exec ctest --output-on-failure -j "$(nproc)" "$@"
