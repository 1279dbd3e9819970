"""`sluice publish` and pulling what it pushed, against a real registry started here: one
layer per file with its digest, the deployment kept, a tampered layer refused, credentials
from the Docker config or the environment and never from the command line."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from sluice.cli.publish import PublishError, publish, pull
from sluice.config.model import load_models
from tests.cli.registry import running_registry

MODELS = """models:
  - name: tiny
    path: {path}
    deployment: {{replicas: 2, cpus: 1, memory: 2Gi}}
    dynamic_batching_config: {{max_batch_delay_ms: 20, batch_size_target: 3}}
    framework_config: {{max_model_len: 512, enforce_eager: true}}
"""


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """A model directory of a few files (the layers are what is tested, not the weights)."""
    files = tmp_path / "tiny-model"
    (files / "tokenizer").mkdir(parents=True)
    (files / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (files / "model.safetensors").write_bytes(os.urandom(300_000))
    (files / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0"}')
    models = tmp_path / "models.yaml"
    models.write_text(MODELS.format(path=files))
    return models


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sluice.cli", *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def manifest(host: str, repo: str, tag: str, auth: tuple[str, str] | None = None) -> dict:
    return httpx.get(f"http://{host}/v2/{repo}/manifests/{tag}", auth=auth,
                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()


def test_publish_then_pull_gives_back_the_files_and_the_deployment(tiny: Path, tmp_path: Path) -> None:
    with running_registry(tmp_path / "registry") as registry:
        pushed = cli("publish", "tiny", f"oci://{registry.host}/sluice/tiny:v1", "--models-file", str(tiny))
        assert pushed.returncode == 0, pushed.stderr
        assert "pushed tiny" in pushed.stdout and "sha256:" in pushed.stdout
        m = manifest(registry.host, "sluice/tiny", "v1")
        titles = {layer["annotations"]["org.opencontainers.image.title"]: layer for layer in m["layers"]}
        assert set(titles) == {"model/config.json", "model/model.safetensors", "model/tokenizer/tokenizer.json",
                               "models.yaml", "schemas.json", "sluice.json"}  # one layer per file
        for layer in m["layers"]:
            assert layer["annotations"]["io.sluice.sha256"] == layer["digest"]
        assert m["annotations"]["io.sluice.model"] == "tiny" and m["annotations"]["io.sluice.version"]
        assert m["config"]["mediaType"] == "application/vnd.sluice.model.config.v1+json"

        models_file = pull(f"oci://{registry.host}/sluice/tiny:v1", tmp_path / "pulled")
        (served,) = load_models(models_file)
        (original,) = load_models(tiny)
        assert served.deployment == original.deployment and served.deployment.replicas == 2
        assert served.deployment_key() | {"path": ""} == original.deployment_key() | {"path": ""}
        assert Path(served.path).parent == models_file.parent
        src = Path(original.path)
        for name in ("config.json", "model.safetensors", "tokenizer/tokenizer.json"):
            assert (Path(served.path) / name).read_bytes() == (src / name).read_bytes()
        meta = json.loads((models_file.parent / "sluice.json").read_text())
        assert meta["model"] == "tiny" and set(meta["files"]) >= {"model/config.json", "models.yaml"}
        schemas = json.loads((models_file.parent / "schemas.json").read_text())
        assert [f["name"] for f in schemas["input_schema"]][:1] == ["prompt"]


def test_a_tampered_layer_is_refused_and_nothing_is_left_to_serve(tiny: Path, tmp_path: Path) -> None:
    (model,) = load_models(tiny)
    with running_registry(tmp_path / "registry") as registry:
        publish(model, f"{registry.host}/sluice/tiny:v1", tmp_path)
        layer = next(x for x in manifest(registry.host, "sluice/tiny", "v1")["layers"]
                     if x["annotations"]["org.opencontainers.image.title"] == "model/model.safetensors")
        blob = registry.blob(layer["digest"])
        data = bytearray(blob.read_bytes())
        data[1000] ^= 0xFF  # one flipped byte in the weights, same size
        blob.write_bytes(bytes(data))
        with pytest.raises(PublishError, match=r"model/model.safetensors does not match its digest"):
            pull(f"oci://{registry.host}/sluice/tiny:v1", tmp_path / "pulled")
        assert [p.name for p in (tmp_path / "pulled").iterdir()] == []  # no half-pulled model
        env = {"SLUICE_DATA_DIR": str(tmp_path / "data")}
        env_clean = {k: v for k, v in os.environ.items() if k != "SLUICE_REDIS_URL"}
        up = subprocess.run([sys.executable, "-m", "sluice.cli", "up", "--from", f"oci://{registry.host}/sluice/tiny:v1"],
                            capture_output=True, text=True, timeout=120, env={**env_clean, **env})
        assert up.returncode == 2 and "does not match its digest" in up.stderr, up.stderr
        assert not (tmp_path / "data" / "redis").exists()  # refused before anything started


def test_credentials_come_from_the_environment_or_the_docker_config(tiny: Path, tmp_path: Path) -> None:
    target_of = "{}/sluice/tiny:v1".format
    with running_registry(tmp_path / "registry", users={"ops": "s3cret"}) as registry:
        target = target_of(registry.host)
        denied = cli("publish", "tiny", target, "--models-file", str(tiny),
                     env={"DOCKER_CONFIG": str(tmp_path / "none")})
        assert denied.returncode == 1 and "asks for credentials" in denied.stderr, denied.stderr
        assert httpx.get(f"http://{registry.host}/v2/sluice/tiny/tags/list").status_code == 401

        by_env = cli("publish", "tiny", target, "--models-file", str(tiny),
                     env={"SLUICE_REGISTRY_USERNAME": "ops", "SLUICE_REGISTRY_PASSWORD": "s3cret",
                          "DOCKER_CONFIG": str(tmp_path / "none")})
        assert by_env.returncode == 0, by_env.stderr

        docker = tmp_path / "docker"
        docker.mkdir()
        token = base64.b64encode(b"ops:s3cret").decode()
        (docker / "config.json").write_text(json.dumps({"auths": {registry.host: {"auth": token}}}))
        os.environ["DOCKER_CONFIG"] = str(docker)
        try:
            models_file = pull(target, tmp_path / "pulled")
        finally:
            del os.environ["DOCKER_CONFIG"]
        assert yaml.safe_load(models_file.read_text())["models"][0]["name"] == "tiny"
    assert "--password" not in cli("publish", "--help").stdout  # no way to put a secret on the command line


@pytest.mark.parametrize("ref", ["tiny:v1", "oci://sluice/tiny:v1"])
def test_a_reference_without_a_registry_is_refused_naming_the_form(ref: str, tmp_path: Path) -> None:
    with pytest.raises(PublishError, match="REGISTRY/REPO:TAG"):
        pull(ref, tmp_path)


def test_a_model_whose_files_are_not_here_cannot_be_published(tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - name: hub\n    path: HuggingFaceTB/SmolLM2-135M-Instruct\n")
    done = cli("publish", "hub", "127.0.0.1:9/x/y:z", "--models-file", str(models))
    assert done.returncode == 1 and "is not a directory on this machine" in done.stderr
