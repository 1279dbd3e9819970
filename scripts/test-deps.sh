#!/usr/bin/env bash
# System packages some tests use, installed where this machine allows it (root with apt):
# Debian's docker-registry (the OCI distribution registry: `sluice publish` tests) and
# chromium (the dashboard's page test) and docker-compose (`config -q` on what `sluice compose`
# writes). Without them those tests skip, saying why.
set -uo pipefail
want=()
command -v docker-registry >/dev/null 2>&1 || want+=(docker-registry)
command -v chromium >/dev/null 2>&1 || want+=(chromium)
command -v docker-compose >/dev/null 2>&1 || want+=(docker-compose)
[ ${#want[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "test-deps: not root with apt-get; tests needing ${want[*]} will skip" >&2
  exit 0
fi
echo "test-deps: installing ${want[*]} (Debian packages, once)" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q --no-install-recommends "${want[@]}" >/dev/null 2>&1 \
  || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q --no-install-recommends "${want[@]}" >/dev/null 2>&1; } \
  || echo "test-deps: could not install ${want[*]}; those tests will skip" >&2
# The package starts a registry on :5000 as a service; the tests start their own.
service docker-registry stop >/dev/null 2>&1 || true
exit 0
