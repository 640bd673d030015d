#!/usr/bin/env bash
# Makes this machine ready to run pshard's containers with Podman (no Docker
# engine needed): writes a containers.conf that works without systemd and
# with hybrid cgroups, and builds a Debian 12 base image from Debian's own
# packages with debootstrap (no image registry is needed).
#   source <(tools/containers-setup.sh)   exports CONTAINERS_CONF
# Prints `export CONTAINERS_CONF=...` on stdout; progress goes to stderr.
set -euo pipefail
base=${PSHARD_BASE_IMAGE:-localhost/debian:bookworm}
state=${PSHARD_CONTAINERS_STATE:-/var/tmp/pshard-containers}
mkdir -p "$state"
conf="$state/containers.conf"
cat > "$conf" <<'CONF'
[containers]
# Raising RLIMIT_NOFILE is refused in some sandboxes.
default_ulimits = []

[engine]
# No systemd: cgroups are managed directly.
cgroup_manager = "cgroupfs"
# crun refuses hybrid cgroup hierarchies; runc does not.
runtime = "runc"
CONF
export CONTAINERS_CONF="$conf"
if ! podman image exists "$base"; then
  rootfs="$state/rootfs"
  rm -rf "$rootfs"
  echo "containers-setup: making $base with debootstrap" >&2
  debootstrap --variant=minbase bookworm "$rootfs" "${PSHARD_DEBIAN_MIRROR:-http://deb.debian.org/debian}" >&2
  tar -C "$rootfs" -c . | podman import - "$base" >&2
  rm -rf "$rootfs"
fi
echo "export CONTAINERS_CONF=$conf"
