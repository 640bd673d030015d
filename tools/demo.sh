#!/usr/bin/env bash
# The main job: install, build, and train a small GPT on a local cluster of
# 4 shard servers and 2 trainers (extra flags go to `pshard local`).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup.sh
exec "${PSHARD_BUILD_DIR:-build}/bin/pshard" local "$@"
