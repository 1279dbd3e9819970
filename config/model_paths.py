"""Where a deployment's model lives on this machine: the default model's prepared directory in the
cache, or a local path. Only paths: preparing the model (torch, transformers) is the workers' job
(`sluice.workers.model_prep`), and the api reads these paths to find a tokenizer."""

from __future__ import annotations

from pathlib import Path

from sluice.config.model import DEFAULT_MODEL_PATH

PREPARED_NAME = "SmolLM2-135M-Instruct"
# Written last by the preparation: a directory without it is a conversion cut short.
DONE_MARKER = ".sluice-prepared"


def prepared_dir(cache_dir: Path) -> Path:
    return cache_dir / "models" / PREPARED_NAME


def is_prepared(cache_dir: Path) -> bool:
    return (prepared_dir(cache_dir) / DONE_MARKER).is_file()


def local_model_dir(path: str, cache_dir: Path) -> Path | None:
    """The directory holding a deployment's model files, if this machine has it: the default
    model once prepared, or a local directory; None for a hub id or a model not prepared yet."""
    if path == DEFAULT_MODEL_PATH:
        return prepared_dir(cache_dir) if is_prepared(cache_dir) else None
    local = Path(path)
    return local if local.is_dir() else None
