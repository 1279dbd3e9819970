"""The webhook sender on Kubernetes (deploy/k8s/base/webhooks.yaml): every process of Sluice's
that compose runs has its Deployment, and the sender's serves and exposes its metrics, is probed
on them, and is given the time its attempts under way need to end."""

from __future__ import annotations

import yaml

from sluice.config.settings import Settings
from tests.deploy_k8s.manifests import K8S, ROOT, container, env, one, render

SENDER_METRICS_PORT = 9401  # as in docker-compose.yml, scraped there by deploy/prometheus.yml (tests/test_deploy.py)


def test_every_process_compose_runs_has_a_deployment() -> None:
    """Compose's services of Sluice's own (Redis and the monitoring profile apart) and the
    Deployments' components are the same processes, run with the same command words."""
    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    ours = {name: s["command"] for name, s in services.items()
            if s.get("image", "").startswith("sluice:") and "profiles" not in s}
    deployments = [d for d in render(K8S) if d["kind"] == "Deployment"]
    components = {d["metadata"]["labels"]["app.kubernetes.io/component"] for d in deployments}
    assert set(ours) == components, set(ours) ^ components

    def words(args: list[str]) -> list[str]:  # the (sub)command, its options' values apart
        return [a for a in args if not a.startswith("-")][:2]

    for d in deployments:
        component = d["metadata"]["labels"]["app.kubernetes.io/component"]
        assert words(container(d)["args"])[0] == words(ours[component])[0], component
    sender = one(deployments, "Deployment", "sluice-webhooks")
    assert words(container(sender)["args"]) == words(ours["webhooks"]) == ["webhooks", "send"]
    compose_port = ours["webhooks"][ours["webhooks"].index("--metrics-port") + 1]
    assert compose_port == str(SENDER_METRICS_PORT)


def test_the_sender_serves_its_metrics_and_is_probed_on_them() -> None:
    sender = one(render(K8S / "base"), "Deployment", "sluice-webhooks")
    pod, c = sender["spec"]["template"], container(sender)
    args = c["args"]
    assert args[args.index("--metrics-port") + 1] == str(SENDER_METRICS_PORT)
    assert {"name": "metrics", "containerPort": SENDER_METRICS_PORT} in c["ports"]
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/path"] == "/metrics"
    assert annotations["prometheus.io/port"] == str(SENDER_METRICS_PORT)
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/metrics", "port": "metrics"}, probe
    # It serves /metrics once Redis answers, which it waits up to 60 s for (workers/webhooks/process.py).
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > 60
    # Every replica is a consumer of its own: one Deployment scaled, no GPU, no files volume.
    assert sender["spec"]["replicas"] >= 1
    assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert all(m["mountPath"] != "/data/files" for m in c["volumeMounts"])


def test_the_sender_has_time_to_end_its_attempts() -> None:
    """SIGTERM: attempts under way end within SLUICE_WEBHOOKS_TIMEOUT_S + 1 s (WebhookSender.run);
    the kubelet waits longer than that before its SIGKILL."""
    sender = one(render(K8S / "base"), "Deployment", "sluice-webhooks")
    set_here = env(container(sender)).get("SLUICE_WEBHOOKS_TIMEOUT_S", {}).get("value")
    timeout_s = float(set_here) if set_here is not None else Settings.model_fields["webhooks_timeout_s"].default
    assert sender["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > timeout_s + 1
