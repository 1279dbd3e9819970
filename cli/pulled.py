"""What a model pulled with `sluice up --from oci://...` may ask for.

An artifact is someone else's configuration: unless the operator passes --trust-artifact, it
may not run code on this machine (a custom runtime, vLLM's trust_remote_code or hf_overrides,
Python or pickled files beside the weights), may set only the engine options of an allow-list,
and gets no more worker replicas than this machine has cores (and memory for). Digests prove
that the bytes are the ones published, not that the publisher is to be trusted.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import PurePosixPath
from typing import Any

from pydantic import ValidationError

from sluice.config.model import ModelConfig

# Engine options (vLLM's AsyncEngineArgs, through framework_config.extra_engine_args) that tune
# performance and read nothing but the pulled files: any other needs --trust-artifact.
SAFE_ENGINE_ARGS = frozenset({
    "max_num_batched_tokens", "enable_prefix_caching", "enable_chunked_prefill", "max_logprobs",
    "swap_space", "cpu_offload_gb", "tensor_parallel_size", "pipeline_parallel_size",
    "disable_sliding_window", "disable_cascade_attn", "max_num_partial_prefills",
    "max_long_partial_prefills", "long_prefill_token_threshold", "kv_cache_memory_bytes",
    "num_gpu_blocks_override", "enable_expert_parallel", "max_parallel_loading_workers",
})
# Files that run code when loaded (Python modules a remote-code model imports; pickles).
CODE_SUFFIXES = frozenset({".py", ".pyc", ".so", ".pkl", ".pickle", ".pt", ".pth", ".bin", ".ckpt"})
FLAG = "--trust-artifact"


class Untrusted(ValueError):
    """What the artifact asks for that needs the operator's --trust-artifact; one problem a line."""


def safe_name(name: object) -> bool:
    """A file name as a layer title or sluice.json may give it: relative, no '..', no empty or
    absolute part, no backslash; it stays inside the folder it is pulled into."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and all(part not in ("", ".", "..") for part in name.split("/"))


def machine() -> tuple[int, int]:
    """This machine's cores (those this process may use) and memory in bytes."""
    return len(os.sched_getaffinity(0)), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def vet(models: list[dict[str, Any]], files: Iterable[str], *, trust: bool,
        cores: int, memory: int) -> tuple[list[dict[str, Any]], list[str]]:
    """The artifact's deployments as this machine will run them, and notes on what was lowered
    (replicas); Untrusted listing every problem when it asks for more than an artifact may."""
    problems: list[str] = []
    if not trust:
        problems += [f"file {name}: {PurePosixPath(name).suffix} files can run code when loaded"
                     for name in files if PurePosixPath(name).suffix.lower() in CODE_SUFFIXES]
    out, notes = [], []
    for raw in models:
        try:
            model = ModelConfig.model_validate(raw)
        except ValidationError as err:
            raise Untrusted(f"its models.yaml does not load: {err}") from None
        if not trust:
            problems += _asks(model)
        raw = dict(raw)
        capped = _replicas(model, cores, memory)
        if capped < model.deployment.replicas and not trust:
            notes.append(f"model {model.name!r}: {capped} replica(s), not the {model.deployment.replicas} "
                         f"its artifact asks for (this machine has {cores} core(s) and "
                         f"{memory / 2**30:.1f} GiB)")
            raw["deployment"] = {**(raw.get("deployment") or {}), "replicas": capped}
        out.append(raw)
    if problems:
        raise Untrusted("; ".join(problems) + f". Pass {FLAG} to serve it anyway")
    return out, notes


def _asks(model: ModelConfig) -> list[str]:
    """What `model`'s deployment asks for that an artifact may not."""
    where = f"model {model.name!r}"
    problems = []
    if model.framework == "custom" or model.runtime is not None:
        problems.append(f"{where}: a custom runtime ({model.runtime}) runs the artifact's choice of code")
    for name in sorted(model.framework_config.extra_engine_args):
        if name not in SAFE_ENGINE_ARGS:
            problems.append(f"{where}: engine option {name!r} is not one an artifact may set "
                            f"({', '.join(sorted(SAFE_ENGINE_ARGS))})")
    return problems


def _replicas(model: ModelConfig, cores: int, memory: int) -> int:
    """The most replicas of `model` this machine holds: one a core at least, and their cpus
    and memory within the machine's."""
    d = model.deployment
    most = cores
    if d.cpus:
        most = min(most, int(cores // d.cpus))
    if d.memory_bytes:
        most = min(most, memory // d.memory_bytes)
    return max(min(d.replicas, most), min(d.replicas, 1))
