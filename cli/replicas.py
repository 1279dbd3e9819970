"""Which worker processes a models file asks for on this machine, and what each one gets.

Every model's `deployment.replicas` workers; a replica with `gpus: N` gets N devices of its
own (`CUDA_VISIBLE_DEVICES`), in the file's order; one with `cpus: C` gets ceil(C) cores of
its own where the machine has them (the worker pins itself and vLLM's CPU threads to them).
A file that asks for more GPUs than the machine has is refused, naming the model.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from sluice.config.model import ModelConfig


class DeploymentError(ValueError):
    """The machine cannot run the deployments as configured; the message names the model."""


@dataclass(frozen=True)
class Replica:
    model: str
    name: str
    gpus: tuple[str, ...] = ()
    cpus: tuple[int, ...] = ()
    env: dict[str, str] = field(default_factory=dict)


def machine_gpus() -> list[str]:
    """The GPUs this machine lends: SLUICE_GPUS (ids, comma-separated, or a count) if set, else
    CUDA_VISIBLE_DEVICES if set, else what `nvidia-smi -L` lists."""
    for var in ("SLUICE_GPUS", "CUDA_VISIBLE_DEVICES"):
        value = os.environ.get(var)
        if value is not None:
            value = value.strip()
            if var == "SLUICE_GPUS" and value.isdigit():
                return [str(i) for i in range(int(value))]
            return [g.strip() for g in value.split(",") if g.strip() and g.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(listed.stdout.splitlines()) if line.startswith("GPU ")]


def machine_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def plan_replicas(models: list[ModelConfig], gpus: list[str] | None = None,
                  cpus: list[int] | None = None) -> list[Replica]:
    gpus = machine_gpus() if gpus is None else gpus
    cpus = machine_cpus() if cpus is None else cpus
    wanted = sum(m.deployment.total_gpus for m in models)
    if wanted > len(gpus):
        first = next(m for i, m in enumerate(models)
                     if sum(x.deployment.total_gpus for x in models[:i + 1]) > len(gpus))
        d = first.deployment
        raise DeploymentError(
            f"model {first.name!r}: its deployment asks for {d.gpus} GPU(s) per replica x {d.replicas} "
            f"replica(s), and the models file {wanted} in all, but this machine has {len(gpus)}"
            f"{' (' + ','.join(gpus) + ')' if gpus else ''}: lower gpus or replicas, "
            "or run it where the GPUs are")
    out: list[Replica] = []
    next_gpu = next_cpu = 0
    for m in models:
        d = m.deployment
        for i in range(d.replicas):
            env: dict[str, str] = {}
            own_gpus = tuple(gpus[next_gpu:next_gpu + d.gpus])
            next_gpu += d.gpus
            if own_gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(own_gpus)
            own_cpus: tuple[int, ...] = ()
            if d.cpus is not None and cpus:
                n = min(math.ceil(d.cpus), len(cpus))
                own_cpus = tuple(cpus[(next_cpu + k) % len(cpus)] for k in range(n))
                next_cpu += n
                env["SLUICE_WORKER_CPUS"] = ",".join(map(str, own_cpus))
            out.append(Replica(m.name, f"{m.name}-{i}", own_gpus, own_cpus, env))
    return out


def pin_to_cpus(spec: str) -> list[int]:
    """In the worker, before the engine starts: keep this process (and the engine's children)
    on the cores SLUICE_WORKER_CPUS names, and vLLM's CPU threads with them."""
    chosen = sorted({int(c) for c in spec.split(",") if c.strip()})
    os.sched_setaffinity(0, chosen)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, chosen)))
    os.environ.setdefault("OMP_NUM_THREADS", str(len(chosen)))
    return chosen
