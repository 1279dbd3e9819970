"""The compose file, the Prometheus config and the Grafana dashboard agree with the code."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.metrics import MetricWrapperBase

import sluice.api.metrics  # noqa: F401  (registers the api's metrics)
import sluice.workers.metrics  # noqa: F401  (registers the workers' metrics)
from sluice.workers.webhooks import metrics as webhook_metrics
from tests.cli_commands import cli_options

ROOT = Path(__file__).resolve().parents[1]


class _ComposeLoader(yaml.SafeLoader):
    """Compose's own tags (`!reset`) read as plain values."""


_ComposeLoader.add_multi_constructor("!", lambda loader, suffix, node: None)


def compose(name: str = "docker-compose.yml") -> dict:
    return yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader)


def test_services_and_their_wiring() -> None:
    services = compose()["services"]
    assert {"redis", "api", "worker", "jobs", "prometheus", "grafana"} <= set(services)
    redis = services["redis"]
    command = " ".join(redis["command"])
    for setting in ("--appendonly yes", "--appendfsync everysec", "--maxmemory-policy noeviction"):
        assert setting in command
    assert redis["volumes"] and redis["healthcheck"]
    for name in ("api", "worker", "jobs"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert services["worker"]["depends_on"]["api"]["condition"] == "service_healthy"
    devices = services["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    assert "container_name" not in services["worker"]  # --scale needs distinct containers
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]


def test_service_commands_exist_in_the_cli() -> None:
    for name in ("api", "worker", "jobs", "webhooks"):
        command = compose()["services"][name]["command"]
        options = cli_options(command)
        for word in command[1:]:
            if word.startswith("--"):
                assert word in options, f"{name}: {word} is not an option of sluice {' '.join(command)}"


def test_dashboard_shows_only_metrics_that_exist() -> None:
    known = set(REGISTRY._names_to_collectors)  # noqa: SLF001
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/sluice.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bsluice_[a-z0-9_]+", e)}
    assert len(used) >= 12
    assert used <= known, used - known
    scraped = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    assert {j["job_name"] for j in scraped["scrape_configs"]} == {"sluice-api", "sluice-worker", "sluice-webhooks"}


def dashboard_panels() -> list[dict]:
    return json.loads((ROOT / "deploy/grafana/dashboards/sluice.json").read_text())["panels"]


def test_prometheus_scrapes_every_metrics_port_of_the_compose_file() -> None:
    """Each service started with --metrics-port is scraped on that port, every replica of it."""
    scraped = {j["job_name"]: j for j in yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())["scrape_configs"]}
    for service, job in (("worker", "sluice-worker"), ("webhooks", "sluice-webhooks")):
        command = compose()["services"][service]["command"]
        port = int(command[command.index("--metrics-port") + 1])
        (sd,) = scraped[job]["dns_sd_configs"]
        assert sd["names"] == [service] and sd["type"] == "A" and sd["port"] == port, (service, sd)


def test_the_dashboard_shows_the_webhook_senders_metrics() -> None:
    """Deliveries by endpoint and outcome, the retry backlog, the oldest pending delivery: every
    metric of workers/webhooks/metrics.py, on panels of their own."""
    sender = {f"{c._name}_total" if c._type == "counter" else c._name  # noqa: SLF001
              for c in vars(webhook_metrics).values() if isinstance(c, MetricWrapperBase)}
    assert sender == {"sluice_webhook_deliveries_total", "sluice_webhook_backlog",
                      "sluice_webhook_oldest_pending_seconds"}
    by_metric = {m: [p for p in dashboard_panels() if any(m in t["expr"] for t in p["targets"])] for m in sender}
    assert all(by_metric.values()), [m for m, panels in by_metric.items() if not panels]
    deliveries = by_metric["sluice_webhook_deliveries_total"][0]["targets"][0]["expr"]
    assert re.search(r"by \((endpoint, outcome|outcome, endpoint)\)", deliveries), deliveries


def test_the_queue_panel_shows_waiting_and_running() -> None:
    """sluice_queue_depth counts waiting requests only (api/metrics.py): the panel that shows it
    shows sluice_queue_running beside it, their sum being the load on the model's workers."""
    (panel,) = [p for p in dashboard_panels() if any("sluice_queue_depth" in t["expr"] for t in p["targets"])]
    assert any("sluice_queue_running" in t["expr"] for t in panel["targets"]), panel["targets"]


def test_docker_compose_config_accepts_the_files() -> None:
    docker = shutil.which("docker")
    if docker is None or subprocess.run([docker, "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no docker compose client here; the YAML checks above still ran")
    keyed = {**os.environ, "SLUICE_API_KEYS": "admin:sha256:" + "0" * 64}
    for files in (["docker-compose.yml"], ["docker-compose.yml", "docker-compose.cpu.yml"],
                  ["docker-compose.yml", "docker-compose.cpu.yml", "docker-compose.local.yml",
                   "tests/deploy/compose.test.yml"]):
        args = [a for f in files for a in ("-f", str(ROOT / f))]
        # --env-file: not a .env of the checkout's own
        done = subprocess.run([docker, "compose", "--env-file", os.devnull, *args, "config", "--quiet"],
                              capture_output=True, text=True, env=keyed)
        assert done.returncode == 0, done.stderr
    unkeyed = {k: v for k, v in keyed.items() if k != "SLUICE_API_KEYS"}
    done = subprocess.run([docker, "compose", "--env-file", os.devnull, "-f", str(ROOT / "docker-compose.yml"),
                           "config", "--quiet"], capture_output=True, text=True, env=unkeyed)
    assert done.returncode != 0 and "sluice keys new" in done.stderr, done.stderr


def test_the_published_api_requires_keys_from_env() -> None:
    """Compose refuses to start without SLUICE_API_KEYS, and .env.example documents it."""
    api = compose()["services"]["api"]
    assert "0.0.0.0" in str(compose()["x-sluice"]["environment"]["SLUICE_API_HOST"]) and api["ports"]
    required = api["environment"]["SLUICE_API_KEYS"]
    assert required.startswith("${SLUICE_API_KEYS:?") and "sluice keys new" in required
    assert api["environment"]["SLUICE_REDIS_URL"]  # the shared settings are still merged in
    example = (ROOT / ".env.example").read_text()
    assert re.search(r"^SLUICE_API_KEYS=admin:sha256:", example, re.M) and "sluice keys new" in example


def test_compose_build_args_are_declared_in_the_dockerfile() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    args = compose()["x-sluice"]["build"]["args"]
    for name in args:
        assert re.search(rf"^ARG {name}\b", dockerfile, re.M), name
    # One base for every stage, a build argument (the classic builder builds every stage: a
    # stage per variant would pull both bases), defaulting to an official image.
    assert args["BASE_IMAGE"] == "${SLUICE_BASE_IMAGE:-python:3.11-slim}"
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim$", dockerfile, re.M)
    froms = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    assert froms[0] == "${BASE_IMAGE}" and all(f in ("${BASE_IMAGE}", "system") for f in froms), froms
    assert "# syntax=" not in dockerfile  # BuildKit would pull the frontend image: not offline


def test_the_dockerfile_copies_every_package_and_no_whole_context() -> None:
    """Sluice's packages are copied by name (the context may hold a wheelhouse of a GB)."""
    dockerfile = (ROOT / "Dockerfile").read_text()
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    tops = {d.split("/")[0] for d in setuptools["package-dir"].values()}
    copied = {m.group(1) for m in re.finditer(r"^COPY (\w+) \1/$", dockerfile, re.M)}
    assert tops == copied, tops ^ copied
    assert not re.search(r"^COPY \. ", dockerfile, re.M)
    assert "COPY wheelhouse/ /wheelhouse/" in dockerfile and (ROOT / "wheelhouse" / "README.md").is_file()
    assert "sluice models prepare" in dockerfile  # the default model, prepared at build time


def test_the_local_override_builds_what_cannot_be_pulled() -> None:
    """docker-compose.local.yml: redis and Prometheus from Debian's packages on the same base;
    the default file keeps the official images; Grafana (no Debian package) leaves the profile."""
    default, local = compose()["services"], compose("docker-compose.local.yml")["services"]
    assert default["redis"]["image"] == "redis:7" and "build" not in default["redis"]
    for name, binary in (("redis", "redis-server"), ("prometheus", "prometheus")):
        build = local[name]["build"]
        assert build["args"]["BASE_IMAGE"] == "${SLUICE_BASE_IMAGE:-debian:bookworm-slim}"
        dockerfile = (ROOT / build["context"] / "Dockerfile").read_text()
        assert re.search(r"^ARG BASE_IMAGE=", dockerfile, re.M)
        assert f"install -y --no-install-recommends {binary}" in dockerfile
        assert local[name]["image"].endswith(":local")
    assert "grafana" in local and "monitoring" not in str(local["grafana"])
    worker = default["worker"]
    assert worker["shm_size"]  # vLLM's engine needs more /dev/shm than Docker's 64 MiB
    assert "${SLUICE_WORKER_ENGINE:-vllm}" in worker["command"]
    for name in ("api", "prometheus", "grafana"):
        assert all(p.startswith("${SLUICE_PUBLISH_ADDRESS:-0.0.0.0}:") for p in default[name]["ports"]), name
