"""Deployment configuration: replicas and resources per model, and the worker processes
`sluice up` makes of them on a machine with a given number of GPUs and cores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.cli.replicas import DeploymentError, machine_gpus, plan_replicas
from sluice.config.deployment import memory_bytes
from sluice.config.model import ConfigError, load_models, parse_model


def model(name: str, **deployment: object):
    return parse_model({"name": name, "deployment": deployment})


def test_deployment_defaults_to_one_replica_and_no_gpu() -> None:
    d = parse_model({"name": "m"}).deployment
    assert (d.replicas, d.cpus, d.memory, d.gpus) == (1, None, None, 0)


@pytest.mark.parametrize(("text", "expected"), [("10Gi", 10 * 2**30), ("512Mi", 512 * 2**20), ("2G", 2 * 10**9),
                                                 ("1.5Gi", int(1.5 * 2**30)), ("4096", 4096), ("512MB", 512 * 10**6)])
def test_memory_takes_kubernetes_quantities(text: str, expected: int) -> None:
    assert memory_bytes(text) == expected
    assert model("m", memory=text).deployment.memory_bytes == expected


@pytest.mark.parametrize(("deployment", "field"), [({"memory": "lots"}, "memory"), ({"gpus": -1}, "gpus"),
                                                   ({"replicas": -2}, "replicas"), ({"cpus": 0}, "cpus"),
                                                   ({"replica": 2}, "replica")])
def test_a_bad_deployment_is_refused_naming_the_field(deployment: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"deployment\.{field}"):
        parse_model({"name": "m", "deployment": deployment}, "")


def test_scaling_is_not_a_new_version() -> None:
    assert model("m", replicas=1).deployment_key() == model("m", replicas=4, gpus=1).deployment_key()


def test_every_model_gets_its_replicas_each_with_its_own_gpus() -> None:
    plan = plan_replicas([model("big", replicas=2, gpus=2), model("small", replicas=1, gpus=1),
                          model("cpu", replicas=2)], gpus=["0", "1", "2", "3", "4"], cpus=[0, 1])
    assert [(r.name, r.model, r.gpus) for r in plan] == [
        ("big-0", "big", ("0", "1")), ("big-1", "big", ("2", "3")), ("small-0", "small", ("4",)),
        ("cpu-0", "cpu", ()), ("cpu-1", "cpu", ())]
    assert plan[0].env["CUDA_VISIBLE_DEVICES"] == "0,1" and plan[2].env["CUDA_VISIBLE_DEVICES"] == "4"
    assert "CUDA_VISIBLE_DEVICES" not in plan[3].env  # gpus: 0 leaves the devices as they are


def test_more_gpus_than_the_machine_has_is_refused_naming_the_model() -> None:
    with pytest.raises(DeploymentError) as err:
        plan_replicas([model("fits", gpus=1), model("greedy", replicas=2, gpus=1)], gpus=["0", "1"], cpus=[0])
    message = str(err.value)
    assert "'greedy'" in message and "3 in all" in message and "this machine has 2" in message
    assert "'fits'" not in message
    with pytest.raises(DeploymentError, match="'one'.*has 0"):
        plan_replicas([model("one", gpus=1)], gpus=[], cpus=[0])


def test_replicas_with_cpus_get_cores_of_their_own_while_there_are_enough() -> None:
    plan = plan_replicas([model("a", replicas=2, cpus=1), model("b", cpus=1.5)], gpus=[], cpus=[0, 1, 2, 3])
    assert [r.cpus for r in plan] == [(0,), (1,), (2, 3)]
    assert plan[2].env["SLUICE_WORKER_CPUS"] == "2,3"
    shared = plan_replicas([model("a", replicas=3, cpus=1)], gpus=[], cpus=[0, 1])
    assert [r.cpus for r in shared] == [(0,), (1,), (0,)]  # more asked than there are: shared, in turn


def test_a_model_with_no_replicas_starts_no_worker() -> None:
    assert plan_replicas([model("off", replicas=0, gpus=4)], gpus=[], cpus=[0]) == []


def test_the_machines_gpus_come_from_sluice_gpus_then_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_GPUS", "3")
    assert machine_gpus() == ["0", "1", "2"]
    monkeypatch.delenv("SLUICE_GPUS")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,5")
    assert machine_gpus() == ["2", "5"]


def test_a_pinned_worker_keeps_to_its_cores() -> None:
    code = ("import os; from sluice.cli.replicas import pin_to_cpus; pin_to_cpus('0'); "
            "print(sorted(os.sched_getaffinity(0)), os.environ['VLLM_CPU_OMP_THREADS_BIND'])")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["[0]", "0"]


def test_sluice_up_refuses_a_deployment_the_machine_cannot_hold_before_starting_anything(tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - name: light\n  - name: heavy\n    deployment: {replicas: 2, gpus: 1}\n")
    assert [m.deployment.gpus for m in load_models(models)] == [0, 1]
    env = {**os.environ, "SLUICE_GPUS": "1", "SLUICE_MODELS_FILE": str(models), "SLUICE_DATA_DIR": str(tmp_path)}
    env.pop("SLUICE_REDIS_URL", None)
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "up", "--port", "1"], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "'heavy'" in done.stderr and "this machine has 1" in done.stderr
    assert not (tmp_path / "redis").exists() and not (tmp_path / "logs").exists()
