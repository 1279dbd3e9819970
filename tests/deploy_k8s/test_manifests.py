"""The Kubernetes manifests (deploy/k8s): rendered with `kubectl kustomize` (or `kustomize build`),
every built-in kind checked against Kubernetes' own schemas (kubernetes-validate, strict), KEDA's
kinds against KEDA's CRDs kept in tests/k8s_schemas, and all of it against the code: the stream
keys and consumer group of sluice.broker.keys, the models file, the CLI's options."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import yaml

from sluice.broker.keys import GROUP, ModelKeys
from sluice.broker.keys import staged as staged_stream
from sluice.config.deployment import memory_bytes
from sluice.config.model import load_models
from sluice.config.tenants import DEFAULT_TENANT
from tests.cli_commands import cli_options
from tests.deploy_k8s.manifests import (
    K8S,
    METRICS_PORT,
    OVERLAYS,
    REDIS_AUTH_PARAMS,
    ROOT,
    SECRET_ENV,
    TARGETS,
    container,
    cpu_cores,
    crd_errors,
    env,
    k8s_errors,
    models_file,
    one,
    render,
    shutdown_timeout,
    validate,
    worker_model,
)

# --- the rendered manifests are valid -----------------------------------------------------------

@pytest.mark.parametrize("target", TARGETS, ids=lambda p: str(p.relative_to(K8S)) or "all")
def test_renders_to_valid_objects(target: Path) -> None:
    docs = render(target)
    assert docs
    for doc in docs:
        assert validate(doc) == [], f"{doc['kind']}/{doc['metadata']['name']} from {target.relative_to(ROOT)}"
    keys = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(keys) == len(set(keys)), keys
    # Secrets come from the cluster (`kubectl create secret`), never from the repository.
    assert "Secret" not in {d["kind"] for d in docs}


def test_the_whole_is_the_base_and_every_overlay() -> None:
    whole = {(d["kind"], d["metadata"]["name"]) for d in render(K8S)}
    parts = {(d["kind"], d["metadata"]["name"]) for t in TARGETS[:-1] for d in render(t)}
    assert whole == parts
    assert OVERLAYS, "no overlay under deploy/k8s/overlays"


def test_every_model_has_its_overlay() -> None:
    models = models_file(render(K8S / "base"))
    served = {worker_model(one(render(o), "Deployment")) for o in OVERLAYS}
    assert served == set(models), "each model of base/models.yaml needs an overlay (and each overlay a model)"
    for overlay in OVERLAYS:
        assert overlay.name == worker_model(one(render(overlay), "Deployment"))


def test_the_check_can_fail() -> None:
    """A ScaledObject KEDA's CRD refuses is refused here too, and so is a strict schema error."""
    source = yaml.safe_load((OVERLAYS[0] / "scaledobject.yaml").read_text())
    assert crd_errors(source) == []

    bad = copy.deepcopy(source)
    bad["spec"]["triggers"][1]["metadata"]["lagCount"] = 32  # metadata values are strings
    assert any("lagCount" in e and "string" in e for e in crd_errors(bad)), crd_errors(bad)
    bad = copy.deepcopy(source)
    bad["spec"]["minReplicas"] = 1  # HPA's name, not KEDA's
    assert any("minReplicas" in e for e in crd_errors(bad))
    bad = copy.deepcopy(source)
    bad["spec"]["triggers"][0]["authenticationRef"] = {"kind": "Secret", "name": "sluice"}
    assert any("authenticationRef.kind" in e for e in crd_errors(bad))
    bad = copy.deepcopy(source)
    del bad["spec"]["scaleTargetRef"]
    assert crd_errors(bad)
    bad = copy.deepcopy(source)
    bad["spec"]["minReplicaCount"], bad["spec"]["maxReplicaCount"] = 5, 2
    assert any("minReplicaCount" in e for e in crd_errors(bad))
    bad = copy.deepcopy(source)
    bad["metadata"]["name"] = "Sluice_Worker"
    assert crd_errors(bad)

    auth = yaml.safe_load((K8S / "base" / "keda-auth.yaml").read_text())
    assert crd_errors(auth) == []
    auth["spec"]["secretTargetRef"][0]["secretName"] = "sluice"
    assert crd_errors(auth)

    worker = yaml.safe_load((K8S / "base" / "worker" / "worker.yaml").read_text())
    assert k8s_errors(worker) == []
    container(worker)["argz"] = container(worker).pop("args")
    assert k8s_errors(worker)


# --- the workers and their scaling agree with the code ---------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_scaledobject_watches_the_models_streams(overlay: Path) -> None:
    docs = render(overlay)
    worker = one(docs, "Deployment")
    model = worker_model(worker)
    assert worker["metadata"]["name"] == f"sluice-worker-{model}"

    scaled = one(docs, "ScaledObject")
    target = scaled["spec"]["scaleTargetRef"]
    assert target["name"] == worker["metadata"]["name"]
    assert target.get("kind", "Deployment") == "Deployment" and target.get("apiVersion", "apps/v1") == "apps/v1"

    shards = models_file(render(K8S / "base"))[model].shards
    assert trigger_problems(scaled["spec"]["triggers"], model, shards) == []


def trigger_problems(triggers: list[dict], model: str, shards: int) -> list[str]:
    """What is wrong with a model's triggers: each interactive stream (one per shard) needs a
    pending and a lag trigger, the bulk stream a lag trigger, all on the consumer group."""
    keys = ModelKeys(model)
    streams = [k.requests for k in keys.shards(shards)]
    problems = []
    auths = {d["metadata"]["name"]: d for d in render(K8S / "base") if d["kind"] == "TriggerAuthentication"}
    by_role: dict[tuple[str, str], dict] = {}
    staged = {staged_stream(s, DEFAULT_TENANT) for s in (*streams, keys.bulk)}  # one per tenant: `default` here
    for t in triggers:
        meta = t["metadata"]
        if t["type"] != "redis-streams" or meta["stream"] not in (*streams, keys.bulk, *staged):
            problems.append(f"{t['type']} trigger on {meta.get('stream')}")
        assert t["authenticationRef"]["name"] in auths and t["authenticationRef"].get("kind", "TriggerAuthentication") \
            == "TriggerAuthentication"
        assert int(meta.get("databaseIndex", "0")) == 0
        if meta["stream"] in staged:  # outside the group: KEDA reads the stream's length
            assert "consumerGroup" not in meta and int(meta["streamLength"]) > 0
            role = "staged"
        else:
            assert meta["consumerGroup"] == GROUP and "streamLength" not in meta
            # KEDA reads the lag when lagCount is set, the pending entries otherwise: never both in one.
            role = "lag" if "lagCount" in meta else "pending"
            if role == "lag":
                assert "pendingEntriesCount" not in meta and int(meta["lagCount"]) > 0
            else:
                assert int(meta["pendingEntriesCount"]) > 0
        assert (meta["stream"], role) not in by_role
        by_role[meta["stream"], role] = t
    wanted = {(s, role) for s in streams for role in ("pending", "lag")} | {(keys.bulk, "lag")} | \
        {(s, "staged") for s in staged}
    problems += [f"no {role} trigger on {stream}" for stream, role in sorted(wanted - set(by_role))]
    # The hash tag puts every key of a shard in one cluster slot: it is in the stream names.
    assert all(stream.startswith(f"sluice:{{m:{model}") for stream, _ in by_role)
    return problems


def test_a_sharded_model_needs_triggers_on_every_shard() -> None:
    scaled = one(render(OVERLAYS[0]), "ScaledObject")
    model = worker_model(one(render(OVERLAYS[0]), "Deployment"))
    assert sorted(trigger_problems(scaled["spec"]["triggers"], model, 3)) == sorted(
        [f"no {role} trigger on sluice:{{m:{model}:{k}}}:req" for k in (1, 2) for role in ("lag", "pending")]
        + [f"no staged trigger on sluice:{{m:{model}:{k}}}:staged:req:default" for k in (1, 2)])
    more = copy.deepcopy(scaled["spec"]["triggers"])
    first = ModelKeys(model).requests
    for k in (1, 2):
        for t in scaled["spec"]["triggers"]:
            if t["metadata"]["stream"] in (first, staged_stream(first, DEFAULT_TENANT)):
                more.append(copy.deepcopy(t))
                more[-1]["name"] = f"{t['name']}-{k}"
                shard = ModelKeys(model).at(k).requests
                more[-1]["metadata"]["stream"] = shard if t["metadata"]["stream"] == first else \
                    staged_stream(shard, DEFAULT_TENANT)
    assert trigger_problems(more, model, 3) == []
    assert validate({**scaled, "spec": {**scaled["spec"], "triggers": more}}) == []


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_worker_gets_its_models_deployment(overlay: Path) -> None:
    docs = render(overlay)
    worker = one(docs, "Deployment")
    model = models_file(render(K8S / "base"))[worker_model(worker)]
    wanted = model.deployment
    c = container(worker)
    requests, limits = c["resources"].get("requests", {}), c["resources"].get("limits", {})

    # Extended resources are asked for in limits (requests, when given, must be equal).
    assert int(limits.get("nvidia.com/gpu", 0)) == wanted.gpus
    assert int(requests.get("nvidia.com/gpu", limits.get("nvidia.com/gpu", 0))) == wanted.gpus
    assert wanted.cpus is not None and wanted.memory is not None
    assert cpu_cores(requests["cpu"]) == wanted.cpus == cpu_cores(limits["cpu"])
    assert memory_bytes(requests["memory"]) == wanted.memory_bytes == memory_bytes(limits["memory"])

    scaled = one(docs, "ScaledObject")["spec"]
    assert scaled["minReplicaCount"] == wanted.replicas <= scaled["maxReplicaCount"]
    assert "replicas" not in worker["spec"], "the ScaledObject owns the count: an apply must not reset it"
    if model.continuous_batching_config is not None:  # the pending trigger can be reached
        slots = model.continuous_batching_config.max_concurrent_batch_size
        pending = [t for t in scaled["triggers"] if "pendingEntriesCount" in t["metadata"]]
        assert all(int(t["metadata"]["pendingEntriesCount"]) <= slots for t in pending)

    # Its own selector: two models' Deployments never claim each other's pods.
    labels = worker["spec"]["template"]["metadata"]["labels"]
    assert worker["spec"]["selector"]["matchLabels"].get("sluice/model") == model.name == labels["sluice/model"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_worker_drains_and_exposes_metrics(overlay: Path) -> None:
    worker = one(render(overlay), "Deployment")
    pod = worker["spec"]["template"]
    c = container(worker)
    args = c["args"]
    assert args[args.index("--metrics-port") + 1] == str(METRICS_PORT)
    assert {"name": "metrics", "containerPort": METRICS_PORT} in c["ports"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(METRICS_PORT)
    assert annotations["prometheus.io/path"] == "/metrics"
    assert c["livenessProbe"]["httpGet"]["port"] in ("metrics", METRICS_PORT)
    # SIGTERM drains running requests for SLUICE_SHUTDOWN_TIMEOUT_S: the kubelet waits longer.
    assert pod["spec"]["terminationGracePeriodSeconds"] > shutdown_timeout(c)
    assert env(c)["SLUICE_WORKER_METRICS_URL"]["value"] == f"http://$(POD_IP):{METRICS_PORT}/metrics"
    assert env(c)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def test_worker_template_asks_for_a_gpu() -> None:
    worker = yaml.safe_load((K8S / "base" / "worker" / "worker.yaml").read_text())
    assert int(container(worker)["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    tolerations = worker["spec"]["template"]["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    # Not runnable as it is: an overlay names the model.
    assert worker_model(worker) not in {m.name for m in load_models(K8S / "base" / "models.yaml")}


def test_trigger_authentication_reads_the_secret() -> None:
    auth = one(render(K8S / "base"), "TriggerAuthentication", "sluice-redis")
    refs = auth["spec"]["secretTargetRef"]
    assert {r["parameter"] for r in refs} <= REDIS_AUTH_PARAMS
    assert {r["parameter"] for r in refs} >= {"address", "password"}
    assert {r["name"] for r in refs} == {"sluice"}


# --- the api, jobs and what every process gets ---------------------------------------------------

def test_api_probes_and_shutdown() -> None:
    docs = render(K8S / "base")
    api = one(docs, "Deployment", "sluice-api")
    pod = api["spec"]["template"]
    c = container(api)
    # /readyz is 503 until every model has a live worker: the api would leave its Service
    # whenever a model has none (scaled to zero, waiting for a GPU), and nothing could queue.
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] == "/healthz", probe
    pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", ["sleep", "0"])
    assert pre_stop[0] == "sleep"
    # uvicorn waits SLUICE_SHUTDOWN_TIMEOUT_S + 2 s (cli/main.py), after the preStop pause.
    assert pod["spec"]["terminationGracePeriodSeconds"] >= float(pre_stop[1]) + math.ceil(shutdown_timeout(c)) + 2

    service = one(docs, "Service", "sluice-api")
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (port,) = service["spec"]["ports"]
    assert port["targetPort"] in ("http", 8000) and {"name": "http", "containerPort": 8000} in c["ports"]
    assert c["args"][c["args"].index("--port") + 1] == "8000"
    pdb = one(docs, "PodDisruptionBudget", "sluice-api")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    assert pdb["spec"]["minAvailable"] < api["spec"]["replicas"]


def test_secrets_come_from_the_secret_and_files_are_shared() -> None:
    docs = render(K8S)
    deployments = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Deployment"}
    for name, d in deployments.items():
        e = env(container(d))
        assert "SLUICE_REDIS_URL" in e, name
        for var in SECRET_ENV & set(e):
            assert "value" not in e[var] and e[var]["valueFrom"]["secretKeyRef"]["name"] == "sluice", (name, var)
    assert "SLUICE_API_KEYS" in env(container(deployments["sluice-api"]))  # it listens on 0.0.0.0

    def files_claim(d: dict) -> str:
        mounts = {m["mountPath"]: m["name"] for m in container(d)["volumeMounts"]}
        volumes = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
        return volumes[mounts["/data/files"]]["persistentVolumeClaim"]["claimName"]

    claim = one(docs, "PersistentVolumeClaim")
    shared = {files_claim(deployments[name]) for name in ("sluice-api", "sluice-jobs")}
    assert shared == {claim["metadata"]["name"]}
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]  # every api and jobs replica
    for d in (deployments["sluice-api"], deployments["sluice-jobs"]):
        data_dir = env(container(d))["SLUICE_DATA_DIR"]["value"]
        assert "SLUICE_FILES_DIR" not in env(container(d)) and f"{data_dir}/files" == "/data/files"


def test_every_process_reads_the_models_file_and_runs_unprivileged() -> None:
    docs = render(K8S)
    config = one(docs, "ConfigMap", "sluice-models")
    assert list(config["data"]) == ["models.yaml"]
    for d in (d for d in docs if d["kind"] == "Deployment"):
        pod = d["spec"]["template"]["spec"]
        c = container(d)
        path = Path(env(c)["SLUICE_MODELS_FILE"]["value"])
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent))
        volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
        assert volume["configMap"]["name"] == "sluice-models" and path.name in config["data"]
        # The image has no USER: the pods say who they run as.
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["image"].partition(":")[0] == "sluice"


def test_commands_exist_in_the_cli() -> None:
    for d in (d for d in render(K8S) if d["kind"] == "Deployment"):
        args = container(d)["args"]
        assert {a for a in args[1:] if a.startswith("--")} <= cli_options(args), (d["metadata"]["name"], args)
