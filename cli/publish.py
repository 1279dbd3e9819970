"""`sluice publish` and `sluice up --from`: a configured model as one OCI artifact.

The artifact holds one layer per file: the prepared model's files (`model/...`), the model's
deployment (`models.yaml`: deployment, engine and batching configuration), its schemas
(`schemas.json`) and `sluice.json` (the Sluice version and every file's digest, also the
manifest's config). Each layer carries its path and sha256 as annotations. Pulling checks
every layer's bytes against its digest before anything is served: a tampered layer is refused.

Credentials: the Docker config (`~/.docker/config.json`, or `$DOCKER_CONFIG`) as `docker login`
wrote it, or SLUICE_REGISTRY_USERNAME and SLUICE_REGISTRY_PASSWORD; never on the command line.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

import yaml

from sluice.cli.pulled import Untrusted, machine, safe_name, vet
from sluice.cli.signing import SIGNATURE, SignatureError, sign, verify
from sluice.config.model import DEFAULT_MODEL_PATH, ModelConfig

log = logging.getLogger("sluice.up")

TITLE = "org.opencontainers.image.title"
SHA = "io.sluice.sha256"
CONFIG_MEDIA_TYPE = "application/vnd.sluice.model.config.v1+json"


class PublishError(RuntimeError):
    """A publish or pull that cannot go on; the message says why."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _reference(ref: str) -> tuple[str, str]:
    """'oci://host:port/repo:tag' or 'host:port/repo:tag' -> (hostname, 'host:port/repo:tag')."""
    ref = ref.removeprefix("oci://")
    host, _, rest = ref.partition("/")
    if not rest or "." not in host and ":" not in host and host != "localhost":
        raise PublishError(f"{ref!r}: name the registry, as REGISTRY/REPO:TAG "
                           "(localhost:5000/sluice/smollm2:v1)")
    return host, ref


def _registry(host: str, plain_http: bool | None):
    """An oras client for `host` with the credentials found, speaking the registry's scheme:
    bearer tokens (Docker Hub, GHCR, Harbor) or plain Basic auth (a registry with htpasswd)."""
    import oras.provider

    loopback = host.split(":")[0] in ("localhost", "127.0.0.1", "[::1]")
    insecure = loopback if plain_http is None else plain_http

    def client(backend: str):
        registry = oras.provider.Registry(hostname=host, insecure=insecure, auth_backend=backend)
        user = os.environ.get("SLUICE_REGISTRY_USERNAME")
        password = os.environ.get("SLUICE_REGISTRY_PASSWORD")
        if user and password:
            registry.auth.set_basic_auth(user, password)
        else:
            # The Docker config, as `docker login` wrote it ($DOCKER_CONFIG, which oras ignores, first)
            own = Path(os.environ.get("DOCKER_CONFIG", "~/.docker")).expanduser() / "config.json"
            registry.auth.load_configs(registry.get_container(f"{host}/probe:latest"),
                                       configs=[str(own)] if own.is_file() else None)
        return registry

    registry = client("token")
    if _probe(registry, host) == "basic":
        registry = client("basic")
    return registry


def _probe(registry, host: str) -> str:
    """One request before the transfer, so that an unreachable registry or missing credentials
    fail at once with their reason (oras retries both for minutes); returns the auth scheme."""
    import httpx

    basic = getattr(registry.auth, "_basic_auth", None)
    try:
        answer = httpx.get(f"{registry.prefix}://{host}/v2/", timeout=10, verify=registry._tls_verify,
                           headers={"Authorization": f"Basic {basic}"} if basic else {})
    except httpx.HTTPError as err:
        raise PublishError(f"no registry answers at {registry.prefix}://{host}: "
                           f"{type(err).__name__}: {err}") from None
    challenge = answer.headers.get("www-authenticate", "").lower()
    if not challenge.startswith("basic") and not (basic and answer.status_code == 200 and not challenge):
        return "token"
    if answer.status_code == 401:
        raise PublishError(f"the registry {host} refused the credentials given" if basic else
                           f"the registry {host} asks for credentials: `docker login {host}`, or set "
                           "SLUICE_REGISTRY_USERNAME and SLUICE_REGISTRY_PASSWORD")
    return "basic"


def _model_files(model: ModelConfig, cache_dir: Path) -> Path:
    if model.path == DEFAULT_MODEL_PATH:
        from sluice.workers.model_prep import prepare_default_model

        return prepare_default_model(cache_dir)
    found = Path(model.path).expanduser()
    if not found.is_dir():
        raise PublishError(f"model {model.name!r}: path {model.path!r} is not a directory on this machine; "
                           "publish takes a model whose files are here "
                           "(a local directory or the builtin model)")
    return found


def publish(model: ModelConfig, target: str, cache_dir: Path, *, plain_http: bool | None = None,
            sign_key: Path | None = None) -> str:
    """Push `model` as one artifact to `target`, signed with `sign_key` when given
    (cli/signing.py); returns the manifest's digest."""
    host, ref = _reference(target)
    model_dir = _model_files(model, cache_dir)
    with tempfile.TemporaryDirectory(prefix="sluice-publish-") as tmp:
        stage = Path(tmp)
        config = model.model_dump(mode="json", exclude={"version"})
        config["path"] = "model"  # a pull rewrites it to where the files land
        (stage / "models.yaml").write_text(yaml.safe_dump({"models": [config]}, sort_keys=False))
        (stage / "schemas.json").write_text(json.dumps({"input_schema": config["input_schema"],
                                                        "output_schema": config["output_schema"]}, indent=1))
        files = {f"model/{p.relative_to(model_dir)}": p for p in sorted(model_dir.rglob("*")) if p.is_file()}
        files["models.yaml"], files["schemas.json"] = stage / "models.yaml", stage / "schemas.json"
        digests = {name: _sha256(p) for name, p in files.items()}
        meta = {"sluice_version": dist_version("sluice"), "model": model.name, "files": digests}
        (stage / "sluice.json").write_text(json.dumps(meta, indent=1))
        files["sluice.json"] = stage / "sluice.json"
        digests["sluice.json"] = _sha256(stage / "sluice.json")
        try:
            signed = sign((stage / "sluice.json").read_bytes(), sign_key) if sign_key else {}
        except SignatureError as err:
            raise PublishError(str(err)) from None
        annotations = {str(p): {TITLE: name, SHA: digests[name]} for name, p in files.items()}
        (stage / "annotations.json").write_text(json.dumps(annotations))
        registry = _registry(host, plain_http)
        try:
            response = registry.push(
                target=ref, files=[str(p) for p in files.values()], disable_path_validation=True,
                annotation_file=str(stage / "annotations.json"), quiet=True,
                manifest_config=f"{stage / 'sluice.json'}:{CONFIG_MEDIA_TYPE}",
                manifest_annotations={"io.sluice.model": model.name,
                                      "io.sluice.version": meta["sluice_version"],
                                      "org.opencontainers.image.title": model.name, **signed})
        except Exception as err:  # requests' and oras' errors: say where it failed
            raise PublishError(f"pushing to {ref} failed: {type(err).__name__}: {err}") from None
    return response.headers.get("Docker-Content-Digest", "")


def pull(source: str, into: Path, *, plain_http: bool | None = None, trust: bool = False,
         public_key: Path | None = None) -> Path:
    """Pull an artifact published by `publish`, check every layer's digest, its signature by
    `public_key` when one is given (cli/signing.py), and what it asks for (cli/pulled.py:
    without `trust`, no code execution, allowed engine options only, replicas within this
    machine); return the models file that serves it (its path pointing at the pulled files)."""
    host, ref = _reference(source)
    registry = _registry(host, plain_http)
    try:
        manifest = registry.get_manifest(ref)
    except Exception as err:
        raise PublishError(f"reading {ref} failed: {type(err).__name__}: {err}") from None
    layers = manifest.get("layers") or []
    if (manifest.get("annotations") or {}).get("io.sluice.model") is None or not layers:
        raise PublishError(f"{ref} is not a model published by `sluice publish`")
    into.mkdir(parents=True, exist_ok=True)
    final = into / ref.replace("/", "_").replace(":", "_")
    stage = Path(tempfile.mkdtemp(prefix=".pull-", dir=into))
    titles: set[str] = set()
    try:
        for layer in layers:
            name = (layer.get("annotations") or {}).get(TITLE, "")
            out = (stage / name).resolve() if safe_name(name) else stage
            if not safe_name(name) or not out.is_relative_to(stage.resolve()) or name in titles:
                raise PublishError(f"{ref}: a layer has no safe file name ({name!r})")
            titles.add(name)
            try:
                registry.download_blob(ref, layer["digest"], str(out))
            except Exception as err:
                raise PublishError(f"{ref}: downloading {name} failed: {type(err).__name__}: {err}") from None
            got = _sha256(out)
            if got != layer["digest"] or layer["annotations"].get(SHA, got) != got:
                raise PublishError(f"{ref}: layer {name} does not match its digest "
                                   f"(expected {layer['digest']}, got {got}): refusing to serve it")
        signed = {k: str(v) for k, v in (manifest.get("annotations") or {}).items()}
        if public_key is not None and "sluice.json" in titles:
            try:
                verify((stage / "sluice.json").read_bytes(), signed, public_key)
            except SignatureError as err:
                raise PublishError(f"{ref}: {err}: refusing to serve it") from None
        models, notes = _vetted(ref, stage, titles, trust)
        if public_key is None and SIGNATURE in signed:
            notes.append("it is signed, but no SLUICE_ARTIFACT_PUBLIC_KEY is set to verify it with")
        shutil.rmtree(final, ignore_errors=True)
        stage.rename(final)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    for m in models:
        m["path"] = str(final / "model")
    (final / "models.yaml").write_text(yaml.safe_dump({"models": models}, sort_keys=False))
    for note in notes:
        log.warning("%s: %s", ref, note)
    return final / "models.yaml"


def _vetted(ref: str, stage: Path, titles: set[str], trust: bool) -> tuple[list[dict[str, Any]], list[str]]:
    """The pulled deployments as this machine runs them: sluice.json names only files that are
    layers (checked against its digests), and the deployments ask for nothing an artifact may
    not (cli/pulled.py)."""
    missing = {"models.yaml", "sluice.json"} - titles
    if missing:
        raise PublishError(f"{ref}: the artifact has no {', '.join(sorted(missing))}")
    try:
        meta = json.loads((stage / "sluice.json").read_text())
        models = yaml.safe_load((stage / "models.yaml").read_text())["models"]
        files = dict(meta["files"])
    except (ValueError, TypeError, KeyError, yaml.YAMLError) as err:
        raise PublishError(f"{ref}: its sluice.json or models.yaml is malformed: "
                           f"{type(err).__name__}: {err}") from None
    for name, digest in files.items():
        if not safe_name(name) or name not in titles:
            raise PublishError(f"{ref}: sluice.json names a file that is not one of its layers ({name!r})")
        if name != "sluice.json" and _sha256(stage / name) != digest:
            raise PublishError(f"{ref}: {name} does not match the digest sluice.json gives")
    if not isinstance(models, list) or not all(isinstance(m, dict) for m in models):
        raise PublishError(f"{ref}: its models.yaml has no list of models")
    cores, memory = machine()
    try:
        return vet(models, titles, trust=trust, cores=cores, memory=memory)
    except Untrusted as err:
        raise PublishError(f"{ref}: {err}") from None
