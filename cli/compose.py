"""`sluice compose`: a compose file with one worker service per deployment of a models file.

The services other than the workers are those of the hand-written docker-compose.yml (redis,
api, jobs; no monitoring profile). Each model's `deployment` becomes its service's
`deploy`: replicas, resource limits (cpus, memory) and a reservation of NVIDIA GPUs: a model
with GPUs gets a service per replica (`worker-<model>-<i>`), each reserving GPUs of its own by
`device_ids`, numbered across the models in the file's order as `sluice up` does. The
models file is mounted read-only into every container, so they read the file rendered from.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml

from sluice.config.deployment import memory_bytes
from sluice.config.model import SHIPPED_MODELS_FILE, ConfigError, ModelConfig, load_models

MODELS_FILE_IN_CONTAINER = "/etc/sluice/models.yaml"
WORKER_METRICS_PORT = "9400"
WEBHOOKS_METRICS_PORT = "9401"  # deploy/prometheus.yml scrapes every webhook sender replica here
VARIANTS = ("gpu", "cpu")
# The folder of the Dockerfile when sluice runs from a checkout (absent in an installed wheel).
PROJECT_ROOT = Path(__file__).resolve().parents[1]

_API_KEYS = ("${SLUICE_API_KEYS:?set SLUICE_API_KEYS in .env, see .env.example "
             "(sluice keys new --scope admin makes a key)}")
_REDIS_HEALTHY = {"redis": {"condition": "service_healthy"}}
_API_HEALTHY = {**_REDIS_HEALTHY, "api": {"condition": "service_healthy"}}


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:  # every service written out in full, no &id001
        return True


class _Flow(list):
    """A command line, written on one line as in docker-compose.yml."""


def _flow_commands(node: Any, key: str = "") -> Any:
    if isinstance(node, dict):
        return {k: _flow_commands(v, k) for k, v in node.items()}
    return _Flow(node) if isinstance(node, list) and key in ("command", "test") else node


_Dumper.add_representer(
    _Flow, lambda d, data: d.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True))
_Dumper.add_representer(type(None), lambda d, _: d.represent_scalar("tag:yaml.org,2002:null", ""))


class ComposeError(ConfigError):
    """A models file that cannot become a compose file (the message names the model)."""


def compose_memory(value: str) -> str:
    """'10Gi' -> '10g', '512Mi' -> '512m', '2G' -> '1953125k': compose's binary units, exactly."""
    size = memory_bytes(value)
    for unit, factor in (("g", 2**30), ("m", 2**20), ("k", 2**10)):
        if size % factor == 0:
            return f"{size // factor}{unit}"
    return f"{size}b"


def compose_cpus(value: float) -> str:
    text = repr(float(value))
    return text.removesuffix(".0")


def service_name(model: ModelConfig) -> str:
    return f"worker-{model.name.lower()}"


def _worker(model: ModelConfig, base: dict[str, Any], variant: str,
            device_ids: list[str] | None = None) -> dict[str, Any]:
    """`device_ids`: the GPUs of this one replica (Docker gives every container asking for
    `count: N` the same first N GPUs, so each GPU replica is a service with its own ids)."""
    wanted = model.deployment
    if variant == "cpu" and wanted.gpus > 0:
        raise ComposeError(f"model {model.name} asks for {wanted.gpus} GPU(s) per replica (deployment.gpus): "
                           "the CPU variant has none; set gpus: 0 or leave out --cpu")
    resources: dict[str, Any] = {}
    limits = {}
    if wanted.cpus is not None:
        limits["cpus"] = compose_cpus(wanted.cpus)
    if wanted.memory is not None:
        limits["memory"] = compose_memory(wanted.memory)
    if limits:
        resources["limits"] = limits
    if device_ids:
        resources["reservations"] = {
            "devices": [{"driver": "nvidia", "device_ids": device_ids, "capabilities": ["gpu"]}]}
    deploy: dict[str, Any] = {"replicas": 1 if device_ids else wanted.replicas}
    if resources:
        deploy["resources"] = resources
    return {
        **copy.deepcopy(base),
        # Each replica has its own hostname, hence its own stable consumer name.
        "command": ["worker", "--model", model.name, "--metrics-port", WORKER_METRICS_PORT],
        "depends_on": copy.deepcopy(_API_HEALTHY),
        "healthcheck": {
            "test": ["CMD", "python", "-c", "import urllib.request; urllib.request.urlopen("
                     f"'http://127.0.0.1:{WORKER_METRICS_PORT}/metrics')"],
            "interval": "10s", "timeout": "3s", "retries": 60, "start_period": "120s",
        },
        "stop_grace_period": "60s",  # SIGTERM drains running requests
        "shm_size": "1gb",  # vLLM needs 160 MiB of /dev/shm; Docker gives 64 MiB
        "deploy": deploy,
    }


def render_compose(models: list[ModelConfig], *, variant: str = "gpu", models_file: str | None = None,
                   build_context: str | None = None) -> dict[str, Any]:
    """The compose file as a dict. `models_file`: the host path (as compose reads it, relative to
    the compose file's folder or absolute) mounted at /etc/sluice/models.yaml; None: the image's
    own models file. `build_context`: the folder of the Dockerfile; None: no build section."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, not {variant!r}")
    names: dict[str, str] = {}
    for model in models:
        seen = names.setdefault(service_name(model), model.name)
        if seen != model.name:
            raise ComposeError(f"models {seen} and {model.name} would both be the service "
                               f"{service_name(model)}")
    target = "${SLUICE_TARGET:-" + variant + "}"
    env: dict[str, Any] = {"SLUICE_REDIS_URL": "redis://redis:6379/0", "SLUICE_DATA_DIR": "/data",
                           "SLUICE_API_HOST": "0.0.0.0"}
    volumes = ["files:/data/files"]
    if models_file is not None:
        env["SLUICE_MODELS_FILE"] = MODELS_FILE_IN_CONTAINER
        volumes.append(f"{models_file.replace('$', '$$')}:{MODELS_FILE_IN_CONTAINER}:ro")
    base: dict[str, Any] = {"image": f"sluice:{target}"}
    if build_context is not None:
        base["build"] = {"context": build_context.replace("$", "$$"), "args": {"VARIANT": target}}
    base.update({"environment": env, "volumes": volumes, "restart": "unless-stopped"})

    services: dict[str, Any] = {
        "redis": {
            "image": "redis:7",
            "command": ["redis-server", "--appendonly", "yes", "--appendfsync", "everysec",
                        "--maxmemory-policy", "noeviction", "--save", ""],
            "volumes": ["redis-data:/data"],
            "healthcheck": {"test": ["CMD", "redis-cli", "ping"],
                            "interval": "5s", "timeout": "3s", "retries": 20},
            "restart": "unless-stopped",
        },
        "api": {
            **copy.deepcopy(base),
            # The api listens on 0.0.0.0 and is published: it must have keys (it refuses to start without).
            "environment": {**env, "SLUICE_API_KEYS": _API_KEYS},
            "command": ["api", "--port", "8000"],
            "ports": ["${SLUICE_API_PORT:-8000}:8000"],
            "depends_on": copy.deepcopy(_REDIS_HEALTHY),
            "healthcheck": {
                "test": ["CMD", "python", "-c",
                         "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz')"],
                "interval": "5s", "timeout": "3s", "retries": 20,
            },
        },
    }
    next_gpu = 0
    for model in models:
        if variant == "gpu" and model.deployment.gpus > 0:
            for i in range(model.deployment.replicas):  # a service per GPU replica, GPUs of its own
                ids = [str(next_gpu + k) for k in range(model.deployment.gpus)]
                next_gpu += len(ids)
                services[f"{service_name(model)}-{i}"] = _worker(model, base, variant, ids)
        else:
            services[service_name(model)] = _worker(model, base, variant)
    services["jobs"] = {**copy.deepcopy(base), "command": ["jobs"], "depends_on": copy.deepcopy(_API_HEALTHY)}
    services["webhooks"] = {**copy.deepcopy(base),  # docs/webhooks.md
                            "command": ["webhooks", "send", "--metrics-port", WEBHOOKS_METRICS_PORT],
                            "depends_on": copy.deepcopy(_API_HEALTHY)}
    return {"services": services, "volumes": {"redis-data": None, "files": None}}


def _path_for(target: Path, base_dir: Path) -> str:
    """`target` as written in a compose file in `base_dir`: relative (./x, ../x) when the two
    share a folder below /, absolute otherwise."""
    target, base_dir = target.resolve(), base_dir.resolve()
    if os.path.commonpath([target, base_dir]) == target.anchor:
        return str(target)
    relative = os.path.relpath(target, base_dir)
    return "." if relative == "." else relative if relative.startswith("..") else f"./{relative}"


def compose_file(models_file: Path | None, output: Path | None, *, variant: str = "gpu") -> str:
    """The text of the compose file for `models_file` (None: the shipped one), to be written at
    `output` (None: stdout, paths then relative to the current folder)."""
    source = Path(models_file) if models_file is not None else SHIPPED_MODELS_FILE
    base_dir = (output.parent if output is not None else Path.cwd()).resolve()
    build = _path_for(PROJECT_ROOT, base_dir) if (PROJECT_ROOT / "Dockerfile").is_file() else None
    rendered = render_compose(load_models(source), variant=variant, models_file=_path_for(source, base_dir),
                              build_context=build)
    up = "docker compose" + (f" -f {output}" if output is not None else " -f <this file>")
    header = (f"# Generated by `sluice compose{' --cpu' if variant == 'cpu' else ''}` from {source}:\n"
              "# edit that file and run the command again rather than editing this one.\n"
              f"#   {up} up -d\n"
              "# SLUICE_API_KEYS must be set (in .env beside this file, see .env.example): "
              "the api is published.\n\n")
    body = yaml.dump(_flow_commands(rendered), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     width=1000)
    return header + body


def write_compose(models_file: Path | None, output: Path | None, *, cpu: bool = False) -> str:
    """Write the compose file at `output` and say so, or return its text when there is no `output`."""
    text = compose_file(models_file, output, variant="cpu" if cpu else "gpu")
    if output is None:
        return text
    output.write_text(text)
    return f"wrote {output}\n"
