"""Signed artifacts: `publish --sign-key` signs sluice.json (the digests of every file), and a
pull with SLUICE_ARTIFACT_PUBLIC_KEY serves only what that key signed: unsigned, signed by
another key, or changed after signing (a re-signed-less sluice.json or models.yaml) is refused.
A registry faked in memory takes the push and serves the pull."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from sluice.cli import publish as publishing
from sluice.cli.publish import SHA, TITLE, PublishError, publish, pull
from sluice.cli.signing import SIGNATURE
from sluice.config.model import ModelConfig, load_models

REF = "registry.example:5000/sluice/tiny:v1"


class MemoryRegistry:
    """Takes one push as oras would and serves it back."""

    def __init__(self) -> None:
        self.blobs: dict[str, bytes] = {}
        self.manifest: dict[str, Any] = {}

    def push(self, *, files: list[str], annotation_file: str, manifest_annotations: dict[str, str],
             **_: Any) -> SimpleNamespace:
        notes = json.loads(Path(annotation_file).read_text())
        layers = []
        for path in files:
            data = Path(path).read_bytes()
            digest = "sha256:" + hashlib.sha256(data).hexdigest()
            self.blobs[digest] = data
            layers.append({"digest": digest, "annotations": notes[path]})
        self.manifest = {"annotations": dict(manifest_annotations), "layers": layers}
        return SimpleNamespace(headers={"Docker-Content-Digest": "sha256:" + "0" * 64})

    def get_manifest(self, _ref: str) -> dict[str, Any]:
        return json.loads(json.dumps(self.manifest))

    def download_blob(self, _ref: str, digest: str, out: str) -> None:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_bytes(self.blobs[digest])

    def replace(self, title: str, data: bytes) -> None:
        """A layer changed by whoever controls the registry, its digests made to match."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        self.blobs[digest] = data
        for layer in self.manifest["layers"]:
            if layer["annotations"][TITLE] == title:
                layer["digest"] = digest
                layer["annotations"][SHA] = digest


def keypair(where: Path, name: str) -> tuple[Path, Path]:
    key = Ed25519PrivateKey.generate()
    private, public = where / f"{name}.pem", where / f"{name}.pub.pem"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> MemoryRegistry:
    fake = MemoryRegistry()
    monkeypatch.setattr(publishing, "_registry", lambda *_a, **_k: fake)
    return fake


@pytest.fixture
def model(tmp_path: Path) -> ModelConfig:
    files = tmp_path / "tiny-model"
    files.mkdir()
    (files / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (files / "model.safetensors").write_bytes(b"\0" * 128)
    return ModelConfig(name="tiny", path=str(files))


def test_a_signed_artifact_pulls_with_its_key_and_nothing_else_does(registry: MemoryRegistry, model: ModelConfig,
                                                                   tmp_path: Path) -> None:
    ours, ours_pub = keypair(tmp_path, "ours")
    _, theirs_pub = keypair(tmp_path, "theirs")
    publish(model, REF, tmp_path, sign_key=ours)
    assert registry.manifest["annotations"][SIGNATURE]
    (served,) = load_models(pull(REF, tmp_path / "pulled", public_key=ours_pub))
    assert served.name == "tiny"
    with pytest.raises(PublishError, match="does not verify"):
        pull(REF, tmp_path / "other", public_key=theirs_pub)
    assert list((tmp_path / "other").iterdir()) == []


@pytest.mark.parametrize("change", ["unsigned", "models.yaml", "sluice.json", "garbled"])
def test_an_artifact_changed_after_signing_is_refused(registry: MemoryRegistry, model: ModelConfig, tmp_path: Path,
                                                      change: str) -> None:
    ours, ours_pub = keypair(tmp_path, "ours")
    publish(model, REF, tmp_path, sign_key=ours)
    if change == "unsigned":
        del registry.manifest["annotations"][SIGNATURE]
    elif change == "garbled":
        registry.manifest["annotations"][SIGNATURE] = "not base64!"
    else:
        # The registry's owner swaps in a deployment of its own, digests and all.
        evil = b"models:\n- name: tiny\n  path: model\n  framework_config: {extra_engine_args: {seed: 1}}\n"
        registry.replace("models.yaml", evil)
        if change == "sluice.json":
            meta = json.loads(registry.blobs[next(x["digest"] for x in registry.manifest["layers"]
                                                  if x["annotations"][TITLE] == "sluice.json")])
            meta["files"]["models.yaml"] = "sha256:" + hashlib.sha256(evil).hexdigest()
            registry.replace("sluice.json", json.dumps(meta).encode())
    with pytest.raises(PublishError) as refused:
        pull(REF, tmp_path / "pulled", public_key=ours_pub)
    assert any(s in str(refused.value) for s in ("not signed", "does not verify", "does not match")), refused.value
    assert list((tmp_path / "pulled").iterdir()) == []


def test_without_a_configured_key_a_signature_is_not_checked(registry: MemoryRegistry, model: ModelConfig,
                                                             tmp_path: Path) -> None:
    publish(model, REF, tmp_path)  # unsigned
    assert SIGNATURE not in registry.manifest["annotations"]
    assert load_models(pull(REF, tmp_path / "pulled"))[0].name == "tiny"


def test_a_key_that_is_not_ed25519_is_refused_by_name(registry: MemoryRegistry, model: ModelConfig,
                                                      tmp_path: Path) -> None:
    (tmp_path / "bad.pem").write_text("not a key")
    with pytest.raises(PublishError, match="signing key .*bad.pem"):
        publish(model, REF, tmp_path, sign_key=tmp_path / "bad.pem")
    publish(model, REF, tmp_path)
    with pytest.raises(PublishError, match="SLUICE_ARTIFACT_PUBLIC_KEY .*bad.pem"):
        pull(REF, tmp_path / "pulled", public_key=tmp_path / "bad.pem")
