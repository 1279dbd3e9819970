"""What a pulled artifact may ask for (cli/pulled.py) and the file names its sluice.json may
give, through `pull` against a registry faked in memory (the real-registry tests are in
test_publish.py): no code execution, no engine option outside the allow-list and no more
replicas than the machine holds without --trust-artifact; no file outside the pull's folder."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from sluice.cli import publish as publishing
from sluice.cli.publish import SHA, TITLE, PublishError, pull
from sluice.cli.pulled import Untrusted, safe_name, vet
from sluice.config.model import load_models

GiB = 2**30


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class FakeRegistry:
    """Serves one artifact: its layers by title, their blobs by digest."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.blobs = {digest(d): d for d in files.values()}
        self.layers = [{"digest": digest(d), "annotations": {TITLE: name, SHA: digest(d)}} for name, d in files.items()]

    def get_manifest(self, _ref: str) -> dict[str, Any]:
        return {"annotations": {"io.sluice.model": "tiny"}, "layers": self.layers}

    def download_blob(self, _ref: str, blob: str, out: str) -> None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_bytes(self.blobs[blob])


def artifact(model: dict[str, Any] | None = None, extra: dict[str, bytes] | None = None,
             listed: dict[str, str] | None = None) -> dict[str, bytes]:
    """An artifact's files as `sluice publish` writes them; `listed`: more names for sluice.json."""
    config = {"name": "tiny", "path": "model", **(model or {})}
    files = {"model/config.json": b'{"architectures": ["LlamaForCausalLM"]}',
             "model/model.safetensors": b"\0" * 64, **(extra or {}),
             "models.yaml": yaml.safe_dump({"models": [config]}).encode()}
    meta = {"model": "tiny", "files": {**{n: digest(d) for n, d in files.items()}, **(listed or {})}}
    files["sluice.json"] = json.dumps(meta).encode()
    return files


def pulled(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, files: dict[str, bytes], **kw: Any) -> Path:
    monkeypatch.setattr(publishing, "_registry", lambda *_a, **_k: FakeRegistry(files))
    return pull("oci://registry.example:5000/sluice/tiny:v1", tmp_path / "pulled", **kw)


@pytest.mark.parametrize("outside", ["../outside.txt", "../../outside.txt", "/etc/hostname", "model/../../outside.txt"])
def test_sluice_json_may_name_only_its_own_layers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                  outside: str) -> None:
    """A publisher who lists a file of the puller's (with its real digest) learns nothing: the
    pull is refused before the file is read."""
    target = Path(outside) if outside.startswith("/") else tmp_path / "outside.txt"
    if not outside.startswith("/"):
        target.write_text("the puller's own file")
    if not target.is_file():
        pytest.skip(f"{target} is not on this machine")
    read = []
    monkeypatch.setattr(publishing, "_sha256", lambda p, real=publishing._sha256: read.append(p) or real(p))
    files = artifact(listed={outside: digest(target.read_bytes())})
    with pytest.raises(PublishError, match="sluice.json names a file that is not one of its layers"):
        pulled(monkeypatch, tmp_path, files)
    assert all(Path(p).resolve() != target.resolve() for p in read)
    assert [p.name for p in (tmp_path / "pulled").iterdir()] == []


def test_a_device_named_in_sluice_json_is_refused_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    files = artifact(listed={"../" * 40 + "dev/zero": "sha256:" + "0" * 64})
    with pytest.raises(PublishError, match="not one of its layers"):
        pulled(monkeypatch, tmp_path, files)


@pytest.mark.parametrize(("model", "extra", "says"), [
    ({"framework_config": {"extra_engine_args": {"trust_remote_code": True}}}, None, "'trust_remote_code'"),
    ({"framework_config": {"extra_engine_args": {"hf_overrides": {"architectures": ["Evil"]}}}}, None,
     "'hf_overrides'"),
    ({"framework_config": {"extra_engine_args": {"load_format": "pt"}}}, None, "'load_format'"),
    ({"framework": "custom", "runtime": "os:system"}, None, "a custom runtime (os:system)"),
    (None, {"model/modeling_evil.py": b"import os\nos.system('id')\n"}, "model/modeling_evil.py: .py files"),
    (None, {"model/pytorch_model.bin": b"\x80\x04"}, "model/pytorch_model.bin: .bin files"),
])
def test_an_artifact_that_would_run_code_needs_the_operators_flag(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                   model: dict | None, extra: dict | None,
                                                                   says: str) -> None:
    files = artifact(model, extra)
    with pytest.raises(PublishError) as refused:
        pulled(monkeypatch, tmp_path, files)
    assert says in str(refused.value) and "--trust-artifact" in str(refused.value)
    assert [p.name for p in (tmp_path / "pulled").iterdir()] == []
    models_file = pulled(monkeypatch, tmp_path, files, trust=True)
    (served,) = load_models(models_file)
    assert served.framework_config.extra_engine_args == (model or {}).get("framework_config", {}).get(
        "extra_engine_args", {})


def test_allowed_engine_options_and_plain_weights_pull(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    files = artifact({"framework_config": {"extra_engine_args": {"enable_prefix_caching": True,
                                                                 "max_num_batched_tokens": 4096}},
                      "deployment": {"replicas": 1}})
    (served,) = load_models(pulled(monkeypatch, tmp_path, files))
    assert served.framework_config.extra_engine_args["max_num_batched_tokens"] == 4096
    assert Path(served.path).is_dir()


@pytest.mark.parametrize(("deployment", "cores", "memory", "replicas"), [
    ({"replicas": 256}, 2, 16 * GiB, 2),
    ({"replicas": 8, "cpus": 1.5}, 4, 16 * GiB, 2),
    ({"replicas": 8, "memory": "10Gi"}, 16, 32 * GiB, 3),
    ({"replicas": 2, "memory": "64Gi"}, 16, 32 * GiB, 1),
    ({"replicas": 2}, 16, 32 * GiB, 2),
    ({"replicas": 0}, 16, 32 * GiB, 0),
])
def test_replicas_are_capped_by_the_machine(deployment: dict, cores: int, memory: int, replicas: int) -> None:
    (got,), notes = vet([{"name": "tiny", "deployment": deployment}], ["models.yaml"], trust=False, cores=cores,
                        memory=memory)
    assert got["deployment"]["replicas"] == replicas
    assert bool(notes) == (replicas < deployment["replicas"])
    (trusted,), _ = vet([{"name": "tiny", "deployment": deployment}], [], trust=True, cores=cores, memory=memory)
    assert trusted["deployment"] == deployment


def test_every_problem_is_named_at_once() -> None:
    with pytest.raises(Untrusted) as refused:
        vet([{"name": "a", "framework": "custom", "runtime": "m:C"},
             {"name": "b", "framework_config": {"extra_engine_args": {"tokenizer": "/etc", "seed": 1}}}],
            ["x/a.py"], trust=False, cores=4, memory=GiB)
    message = str(refused.value)
    for part in ("x/a.py", "model 'a': a custom runtime", "model 'b': engine option 'seed'", "'tokenizer'"):
        assert part in message


@pytest.mark.parametrize("seed", range(20))
def test_a_safe_name_stays_inside_the_folder(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    parts = ["a", "b.json", "..", ".", "", "/", "\\", "model", "..a", "a..", "~", "\x00"]
    for _ in range(200):
        name = "".join(rng.choice(parts) + rng.choice(["/", ""]) for _ in range(rng.randint(0, 5)))
        if safe_name(name):
            assert (tmp_path / name).resolve().is_relative_to(tmp_path.resolve()), name
            assert ".." not in PurePosixPath(name).parts and not name.startswith("/"), name
    assert not any(safe_name(n) for n in ("", "/etc/hostname", "../x", "a/../../x", "a//b", "./a", "a\\..\\b", None))
    assert all(safe_name(n) for n in ("models.yaml", "model/tokenizer/tokenizer.json", "a..b", "..a"))
