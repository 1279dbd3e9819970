"""`sluice compose`: the file it writes is a valid compose file (the Compose Specification schema,
and `docker compose config` where a client is installed) carrying each model's deployment."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import jsonschema
import pytest
import typer
import yaml
from typer.testing import CliRunner

from sluice.cli.compose import ComposeError, compose_memory, render_compose, service_name
from sluice.cli.main import app
from sluice.config.model import load_models, parse_model

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "tests/deploy_schemas/compose-spec.json").read_text())
VALIDATOR = jsonschema.Draft7Validator(SCHEMA)
MODELS = """\
models:
  - name: smollm2
    deployment: {replicas: 2, cpus: 1.5, memory: 10Gi, gpus: 1}
  - name: Qwen-Small
    deployment: {replicas: 0, cpus: 2, memory: 512Mi}
"""
KEYED = {**os.environ, "SLUICE_API_KEYS": "admin:sha256:" + "0" * 64}


class _ComposeLoader(yaml.SafeLoader):
    """Compose's own tags (`!reset {}`) read as their plain values."""


_ComposeLoader.add_multi_constructor("!", lambda loader, suffix, node: loader.construct_mapping(node)
                                     if isinstance(node, yaml.MappingNode) else loader.construct_object(node))


def assert_valid(document: dict) -> None:
    errors = sorted(VALIDATOR.iter_errors(document), key=lambda e: list(e.absolute_path))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


@pytest.fixture
def models_file(tmp_path: Path) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(MODELS)
    return path


def test_the_schema_is_the_compose_specification() -> None:
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    assert SCHEMA["title"] == "Compose Specification"
    with pytest.raises(AssertionError, match="replicas"):  # the validator does reject a bad file
        assert_valid({"services": {"w": {"image": "x", "deploy": {"replicas": [1]}}}})


def test_two_models_become_worker_services_with_their_deployments(models_file: Path) -> None:
    rendered = render_compose(load_models(models_file), models_file="./models.yaml", build_context=".")
    assert_valid(rendered)
    services = rendered["services"]
    # A GPU model: a service per replica, each reserving GPUs of its own (Docker hands every
    # container asking for `count: 1` the same GPU 0); a CPU model: one service, its replicas.
    assert list(services) == ["redis", "api", "worker-smollm2-0", "worker-smollm2-1", "worker-qwen-small", "jobs",
                              "webhooks"]

    big, small = services["worker-smollm2-0"], services["worker-qwen-small"]
    assert big["command"] == ["worker", "--model", "smollm2", "--metrics-port", "9400"]
    assert small["command"] == ["worker", "--model", "Qwen-Small", "--metrics-port", "9400"]
    for i in (0, 1):
        replica = services[f"worker-smollm2-{i}"]
        assert replica["deploy"]["replicas"] == 1
        assert replica["deploy"]["resources"]["limits"] == {"cpus": "1.5", "memory": "10g"}
        assert replica["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "device_ids": [str(i)], "capabilities": ["gpu"]}]
    assert small["deploy"] == {"replicas": 0, "resources": {"limits": {"cpus": "2", "memory": "512m"}}}
    workers = ("worker-smollm2-0", "worker-smollm2-1", "worker-qwen-small")
    for name in workers:
        assert services[name]["depends_on"] == {"redis": {"condition": "service_healthy"},
                                                "api": {"condition": "service_healthy"}}
        assert "container_name" not in services[name]  # replicas need distinct containers
        assert services[name]["shm_size"] == "1gb"  # vLLM's shared memory: Docker's 64 MiB is too little

    for name in ("api", *workers, "jobs", "webhooks"):
        service = services[name]
        assert service["image"] == "sluice:${SLUICE_TARGET:-gpu}"
        assert service["build"] == {"context": ".", "args": {"VARIANT": "${SLUICE_TARGET:-gpu}"}}
        assert service["environment"]["SLUICE_MODELS_FILE"] == "/etc/sluice/models.yaml"
        assert service["environment"]["SLUICE_REDIS_URL"] == "redis://redis:6379/0"
        assert "./models.yaml:/etc/sluice/models.yaml:ro" in service["volumes"]
    assert services["api"]["environment"]["SLUICE_API_KEYS"].startswith("${SLUICE_API_KEYS:?")
    assert services["redis"]["healthcheck"]["test"] == ["CMD", "redis-cli", "ping"]
    assert set(rendered["volumes"]) == {"redis-data", "files"}


def test_gpu_ids_are_numbered_across_models_as_sluice_up_numbers_them() -> None:
    models = [parse_model({"name": "a", "deployment": {"replicas": 2, "gpus": 2}}),
              parse_model({"name": "b", "deployment": {"gpus": 1}})]
    services = render_compose(models)["services"]
    ids = {name: s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
           for name, s in services.items() if name.startswith("worker-")}
    assert ids == {"worker-a-0": ["0", "1"], "worker-a-1": ["2", "3"], "worker-b-0": ["4"]}


def test_without_deployment_a_worker_gets_one_replica_and_no_limits() -> None:
    rendered = render_compose(load_models(None))  # the shipped models file, no mount, no build
    assert_valid(rendered)
    worker = rendered["services"]["worker-smollm2"]
    assert worker["deploy"] == {"replicas": 1}
    assert "build" not in worker and "SLUICE_MODELS_FILE" not in worker["environment"]


def test_the_cpu_variant() -> None:
    cpu_only = parse_model({"name": "small", "deployment": {"replicas": 3, "memory": "2G"}})
    rendered = render_compose([cpu_only], variant="cpu")
    assert_valid(rendered)
    worker = rendered["services"]["worker-small"]
    assert worker["image"] == "sluice:${SLUICE_TARGET:-cpu}"
    assert worker["deploy"] == {"replicas": 3, "resources": {"limits": {"memory": "1953125k"}}}

    gpu = parse_model({"name": "Big-One", "deployment": {"gpus": 2}})
    with pytest.raises(ComposeError, match="Big-One"):
        render_compose([cpu_only, gpu], variant="cpu")
    with pytest.raises(ValueError, match="variant"):
        render_compose([cpu_only], variant="tpu")


def test_models_whose_service_names_collide_are_refused() -> None:
    with pytest.raises(ComposeError, match="worker-a"):
        render_compose([parse_model({"name": "A"}), parse_model({"name": "a"})])


@pytest.mark.parametrize(("quantity", "compose"), [
    ("10Gi", "10g"), ("512Mi", "512m"), ("1.5Gi", "1536m"), ("64Ki", "64k"), ("2G", "1953125k"),
    ("1000", "1000b"), ("512MB", "500000k")])
def test_memory_quantities_become_compose_byte_values(quantity: str, compose: str) -> None:
    assert compose_memory(quantity) == compose  # compose reads k/m/g as powers of 1024


def test_the_worker_command_is_one_the_cli_has(models_file: Path) -> None:
    command = render_compose(load_models(models_file))["services"]["worker-smollm2-0"]["command"]
    sub = typer.main.get_command(app).commands[command[0]]  # type: ignore[attr-defined]
    options = {opt for p in sub.params for opt in p.opts}
    assert {w for w in command if w.startswith("--")} <= options


def test_the_services_without_a_model_run_as_the_hand_written_compose_file_runs_them(models_file: Path) -> None:
    """The webhook sender serves its metrics where deploy/prometheus.yml scrapes them (as in
    docker-compose.yml), and its command is one the cli has."""
    rendered = render_compose(load_models(models_file))["services"]
    shipped = yaml.load((ROOT / "docker-compose.yml").read_text(), Loader=_ComposeLoader)["services"]
    assert rendered["webhooks"]["command"] == shipped["webhooks"]["command"] == \
        ["webhooks", "send", "--metrics-port", "9401"]
    assert rendered["jobs"]["command"] == shipped["jobs"]["command"]
    send = typer.main.get_command(app).commands["webhooks"].commands["send"]  # type: ignore[attr-defined]
    assert "--metrics-port" in {opt for p in send.params for opt in p.opts}


@pytest.mark.parametrize("files", [["docker-compose.yml"], ["docker-compose.cpu.yml"]])
def test_the_hand_written_compose_files_follow_the_schema(files: list[str]) -> None:
    for name in files:
        assert_valid(yaml.load((ROOT / name).read_text(), Loader=_ComposeLoader))


def test_the_cli_writes_the_file(models_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "compose.yml"
    result = CliRunner().invoke(app, ["compose", "--models-file", str(models_file), "-o", str(out)])
    assert result.exit_code == 0, result.output
    text = out.read_text()
    assert text.startswith(f"# Generated by `sluice compose` from {models_file}")
    rendered = yaml.safe_load(text)
    assert_valid(rendered)
    assert rendered["services"]["worker-smollm2-1"]["deploy"]["replicas"] == 1
    # The models file sits beside the output: mounted by a relative path.
    assert "./models.yaml:/etc/sluice/models.yaml:ro" in rendered["services"]["api"]["volumes"]

    printed = CliRunner().invoke(app, ["compose", "--models-file", str(models_file)])
    assert printed.exit_code == 0, printed.output
    assert yaml.safe_load(printed.stdout)["services"].keys() == rendered["services"].keys()


def test_the_cli_refuses_gpus_in_the_cpu_variant(models_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "compose.yml"
    result = CliRunner().invoke(app, ["compose", "--models-file", str(models_file), "--cpu", "-o", str(out)])
    assert result.exit_code == 2
    assert "smollm2" in result.stderr and "GPU" in result.stderr
    assert not out.exists()


def _compose_client() -> list[str] | None:
    docker = shutil.which("docker")
    if docker and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0:
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.parametrize("cpu", [False, True])
def test_docker_compose_config_accepts_the_output(tmp_path: Path, cpu: bool) -> None:
    client = _compose_client()
    if client is None:
        pytest.skip("no docker compose client here; the schema checks above still ran")
    models = tmp_path / "models.yaml"
    models.write_text(MODELS if not cpu else MODELS.replace("gpus: 1", "gpus: 0"))
    out = tmp_path / "compose.yml"
    args = ["compose", "--models-file", str(models), "-o", str(out), *(["--cpu"] if cpu else [])]
    assert CliRunner().invoke(app, args).exit_code == 0
    done = subprocess.run([*client, "-f", str(out), "config", "-q"], capture_output=True, text=True, env=KEYED,
                          cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert service_name(parse_model({"name": "smollm2"})) in out.read_text()
