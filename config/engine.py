"""Engine options (the seeds' VLLMConfig, also accepted as `framework_config`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_BLOCK_SIZE = 16  # vLLM's KV-cache block size when none is set (the CPU backend's too)


class VLLMConfig(BaseModel):
    """vLLM engine options with the product documents' defaults.

    Fields the installed vLLM no longer knows (for example `max_seq_len_to_capture`)
    are accepted here; the engine adapter reports them once as ignored.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_num_seqs: int = Field(default=256, gt=0)
    max_model_len: int | None = Field(default=None, gt=0)
    max_seq_len_to_capture: int = Field(default=8192, gt=0)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    block_size: int | None = Field(default=None, gt=0)
    # vLLM's automatic prefix caching: a prompt's leading blocks already in the KV cache skip
    # their prefill. On by default (vLLM's own default too, stated here so that the deployment
    # says it and placement can count on it: docs/prefix-affinity.md).
    enable_prefix_caching: bool = True
    device_group: str | None = None  # ignored for CUDA acceleration
    # Sluice additions: the dtype (tests pin float32 so that batching cannot change
    # greedy results), eager mode (fast start on the CPU), a KV cache size in GiB for
    # the CPU backend (vLLM's kv_cache_memory_bytes; when unset, gpu_memory_utilization
    # is the share of RAM reserved), and any other AsyncEngineArgs field by name.
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    enforce_eager: bool = False
    seed: int = 0
    # "priority": the engine runs lower `priority` first and preempts for it (vLLM's option);
    # "fcfs": the request's priority only picks its queue lane.
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    cpu_kvcache_space_gib: float | None = Field(default=None, gt=0)
    extra_engine_args: dict[str, Any] = Field(default_factory=dict)

    @property
    def cache_block_size(self) -> int:
        """Tokens per KV-cache block: the one set, or vLLM's default."""
        return self.block_size or DEFAULT_BLOCK_SIZE
