#!/usr/bin/env bash
# Validates deploy/k8s offline: installs the validator's npm packages when
# they are missing or older than package-lock.json, shows that the validator
# rejects broken input, then validates every overlay.
# Exit status: 0 pass, 1 fail, 77 skipped (no kubectl, node or npm).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

for tool in kubectl node npm; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "$tool not found: skipping"
    exit 77
  fi
done

# npm ci writes node_modules/.package-lock.json; an older one means the lock
# changed since the last install.
installed=node_modules/.package-lock.json
if [[ ! -f $installed || package-lock.json -nt $installed || package.json -nt $installed ]]; then
  npm ci --no-audit --no-fund --loglevel=error
fi

# Both, even when the first fails: a broken overlay fails the self-test too,
# and the validation says why.
status=0
node validate.mjs --self-test || status=1
node validate.mjs || status=1
exit "$status"
