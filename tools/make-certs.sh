#!/usr/bin/env bash
# Makes a CA and one certificate per role for a pshard job (with openssl):
#   tools/make-certs.sh DIR [--hosts=localhost,127.0.0.1,...] [--days=30] [--ca=DIR] [--owner=UID[:GID]]
# DIR receives the CA (ca.pem, ca-key.pem) and a folder per role laid out as
# a Kubernetes TLS secret mounts (tls.crt, tls.key, ca.crt), to give a
# process as --tls_cert, --tls_key, --tls_ca or to mount whole:
#   server/   OU=server:  serves TLS (its names: --hosts) and calls shard 0
#   trainer/  OU=trainer: joins, fetches, pushes
#   reader/   OU=reader:  pshard status and other tools
# --ca=DIR signs with the CA already in DIR (ca.pem, ca-key.pem) instead of
# making one: new certificates for a running job (rotation). --owner gives
# the role folders to another user (root only), e.g. --owner=10001 for the
# pshard user of the container image, which must read its key. Keys are
# P-256, private files mode 0600. Each file is written whole and renamed
# into place.
set -euo pipefail
usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
(($#)) || usage
out=$1; shift
hosts=localhost,127.0.0.1
days=30
ca_dir=
owner=
for arg in "$@"; do
  case $arg in
    --hosts=*) hosts=${arg#--hosts=} ;;
    --days=*) days=${arg#--days=} ;;
    --ca=*) ca_dir=${arg#--ca=} ;;
    --owner=*) owner=${arg#--owner=} ;;
    *) echo "make-certs: unknown argument $arg" >&2; usage ;;
  esac
done
[[ $days =~ ^[1-9][0-9]*$ ]] || { echo "make-certs: --days=$days is not a positive number" >&2; exit 2; }
if [[ -n $owner ]]; then
  [[ $owner =~ ^[0-9]+(:[0-9]+)?$ ]] || { echo "make-certs: --owner=$owner is not UID or UID:GID" >&2; exit 2; }
  [[ $(id -u) == 0 ]] || { echo "make-certs: --owner needs root (chown)" >&2; exit 1; }
fi
command -v openssl >/dev/null || { echo "make-certs: openssl is not installed (apt-get install openssl)" >&2; exit 1; }
mkdir -p "$out"
umask 077
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [[ -n $ca_dir ]]; then
  for f in ca.pem ca-key.pem; do
    [[ -r $ca_dir/$f ]] || { echo "make-certs: --ca=$ca_dir has no readable $f" >&2; exit 1; }
  done
  if [[ $(realpath "$ca_dir") != $(realpath "$out") ]]; then cp "$ca_dir/ca.pem" "$ca_dir/ca-key.pem" "$out/"; fi
else
  openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
    -subj "/O=pshard/CN=pshard CA" -keyout "$out/ca-key.pem" -out "$out/ca.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

san=
IFS=, read -ra names <<<"$hosts"
for h in "${names[@]}"; do
  [[ -n $h ]] || continue
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+="IP:$h,"; else san+="DNS:$h,"; fi
done
san=${san%,}

issue() {  # role, extended key usage, subjectAltName or ""
  local role=$1 usage=$2 names=$3
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$usage"
    if [[ -n $names ]]; then echo "subjectAltName=$names"; fi
  } >"$work/$role.ext"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/O=pshard/OU=$role/CN=pshard $role" \
    -keyout "$work/$role.key" -out "$work/$role.csr" 2>/dev/null
  openssl x509 -req -in "$work/$role.csr" -CA "$out/ca.pem" -CAkey "$out/ca-key.pem" -CAcreateserial \
    -CAserial "$work/ca.srl" -days "$days" -extfile "$work/$role.ext" -out "$work/$role.crt" 2>/dev/null
  mkdir -p "$out/$role"
  if [[ -n $owner ]]; then chown "$owner" "$work/$role.key" "$work/$role.crt" "$out/$role"; fi
  cp "$out/ca.pem" "$work/$role.ca"
  chmod 0644 "$work/$role.crt" "$work/$role.ca"
  if [[ -n $owner ]]; then chown "$owner" "$work/$role.ca"; fi
  # Key first: a watcher that sees the new certificate finds its key.
  mv "$work/$role.key" "$out/$role/tls.key"
  mv "$work/$role.crt" "$out/$role/tls.crt"
  mv "$work/$role.ca" "$out/$role/ca.crt"
}
issue server serverAuth,clientAuth "$san"
issue trainer clientAuth ""
issue reader clientAuth ""
chmod 0644 "$out/ca.pem"
chmod 0755 "$out/server" "$out/trainer" "$out/reader"
echo "make-certs: $out: ca.pem and server/, trainer/, reader/ (tls.crt, tls.key, ca.crt; server names: $hosts; $days days${owner:+; owned by $owner})"
