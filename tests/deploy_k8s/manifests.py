"""Rendering deploy/k8s with `kubectl kustomize` and validating what comes out: built-in kinds
with kubernetes-validate (strict), KEDA's kinds against the CRDs kept in tests/k8s_schemas.
Shared by the manifest tests."""

from __future__ import annotations

import copy
import functools
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from sluice.config.model import ModelConfig, load_models

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed (the test extras)")

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = ROOT / "tests" / "k8s_schemas"
OVERLAYS = sorted(p for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
TARGETS = [K8S / "base", *OVERLAYS, K8S]
# The oldest Kubernetes the manifests are checked against, and kubernetes-validate's newest.
K8S_VERSIONS = ("1.29", kv.latest_version())
CRDS = {"ScaledObject": "keda.sh_scaledobjects.yaml", "TriggerAuthentication": "keda.sh_triggerauthentications.yaml"}
# The CEL rules of those CRDs (x-kubernetes-validations), which JSON Schema cannot evaluate:
# each is checked by hand below, and a CRD update that brings a new one fails here until it is.
KNOWN_CEL_RULES = {
    "!has(self.minReplicaCount) || self.minReplicaCount <= (has(self.maxReplicaCount) ? self.maxReplicaCount : 100)",
}
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# What KEDA's Redis scalers read from a TriggerAuthentication (pkg/scalers/redis_scaler.go, authParams).
REDIS_AUTH_PARAMS = {"address", "addresses", "host", "hosts", "port", "ports", "username", "password", "tls",
                     "sentinelUsername", "sentinelPassword", "sentinelMaster", "cert", "key", "keyPassword", "ca"}
SECRET_ENV = {"SLUICE_REDIS_URL", "SLUICE_API_KEYS"}
METRICS_PORT = 9400


# --- rendering --------------------------------------------------------------------------------

def _kustomize() -> list[str]:
    if kubectl := shutil.which("kubectl"):
        return [kubectl, "kustomize"]
    if kustomize := shutil.which("kustomize"):
        return [kustomize, "build"]
    pytest.skip("neither kubectl nor kustomize is installed: the manifests cannot be rendered "
                "(Debian: apt-get install kubernetes-client; scripts/test-deps.sh installs it)")


@functools.cache
def _render(path: Path) -> tuple[dict, ...]:
    done = subprocess.run([*_kustomize(), str(path)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"{' '.join(_kustomize())} {path.relative_to(ROOT)} failed:\n{done.stderr}")
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def render(path: Path) -> list[dict]:
    return copy.deepcopy(list(_render(path)))


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def container(deployment: dict) -> dict:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def shutdown_timeout(c: dict) -> float:
    found = env(c).get("SLUICE_SHUTDOWN_TIMEOUT_S")
    return float(found["value"]) if found else 30.0  # Settings' default


def cpu_cores(quantity: str | int | float) -> float:
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def models_file(docs: list[dict]) -> dict[str, ModelConfig]:
    text = one(docs, "ConfigMap", "sluice-models")["data"]["models.yaml"]
    return {m.name: m for m in _load_models_text(text)}


@functools.cache
def _load_models_text(text: str) -> tuple[ModelConfig, ...]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "models.yaml"
        path.write_text(text)
        return tuple(load_models(path))


def worker_model(worker: dict) -> str:
    args = container(worker)["args"]
    assert args[0] == "worker" and "--model" in args, args
    return args[args.index("--model") + 1]


# --- KEDA's CRDs as JSON Schema ---------------------------------------------------------------

def _strict(node: Any, rules: set[str]) -> Any:
    """An OpenAPI v3 schema of a CRD as the JSON Schema the API server holds a request to:
    unknown fields are errors (kubectl's default field validation, Strict) unless the schema
    says x-kubernetes-preserve-unknown-fields; `nullable` allows null; other x-kubernetes-*
    keys go (their CEL rules are collected into `rules`)."""
    if isinstance(node, list):
        return [_strict(item, rules) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v, rules) for k, v in node.items() if not k.startswith("x-kubernetes-") and k != "nullable"}
    for rule in node.get("x-kubernetes-validations", []):
        rules.add(rule["rule"])
    if node.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if node.get("type") == "object" and "properties" in node and "additionalProperties" not in node \
            and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def crd_validator(kind: str, version: str) -> tuple[jsonschema.Validator, frozenset[str]]:
    crd = yaml.safe_load((SCHEMAS / CRDS[kind]).read_text())
    assert crd["spec"]["names"]["kind"] == kind
    served = {v["name"]: v for v in crd["spec"]["versions"] if v.get("served")}
    assert version in served, f"KEDA's CRD for {kind} serves {sorted(served)}, not {version}"
    rules: set[str] = set()
    schema = _strict(served[version]["schema"]["openAPIV3Schema"], rules)
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema), frozenset(rules)


def crd_errors(doc: dict) -> list[str]:
    """What the API server with KEDA's CRDs installed would refuse in `doc` (schema and CEL)."""
    group, _, version = doc["apiVersion"].partition("/")
    assert group == "keda.sh", doc["apiVersion"]
    validator, rules = crd_validator(doc["kind"], version)
    errors = [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
              for e in sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]
    unknown = rules - KNOWN_CEL_RULES
    assert not unknown, f"KEDA's CRD has CEL rules this test does not check yet: {unknown}"
    spec = doc.get("spec") or {}
    if doc["kind"] == "ScaledObject" and isinstance(spec.get("minReplicaCount"), int):
        if spec["minReplicaCount"] > spec.get("maxReplicaCount", 100):
            errors.append("spec: minReplicaCount must be less than or equal to maxReplicaCount")
    errors += metadata_errors(doc)
    return errors


def metadata_errors(doc: dict) -> list[str]:
    """ObjectMeta as Kubernetes checks it (a CRD's schema leaves metadata to the API server)."""
    meta = doc.get("metadata") or {}
    name = meta.get("name", "")
    errors = []
    if len(name) > 253 or not DNS_SUBDOMAIN.match(name):
        errors.append(f"metadata.name {name!r} is not a DNS subdomain")
    for version in K8S_VERSIONS:
        try:
            kv.validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta}, version, strict=True)
        except kv.ValidationError as err:
            errors.append(f"metadata: {err.message}")
    return errors


def k8s_errors(doc: dict) -> list[str]:
    errors = []
    for version in K8S_VERSIONS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as err:
            errors.append(f"{version}: {'.'.join(map(str, err.path))}: {err.message}")
        except kv.SchemaNotFoundError as err:
            errors.append(f"{version}: {err.message}")
    return errors


def validate(doc: dict) -> list[str]:
    return crd_errors(doc) if doc["apiVersion"].startswith("keda.sh/") else k8s_errors(doc)


