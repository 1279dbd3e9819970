"""LocalStack: Redis, apis and workers as child processes of this one.

`sluice up`, the benchmarks and the tests all start Sluice through it, so "start Redis, the
api and a worker" is written once. Every process can be started, killed and started again
(the fault tests and `sluice bench chaos` do).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sluice.supervisor.processes import EmbeddedRedis, free_port, stop_processes, wait_ready

CLI = [sys.executable, "-m", "sluice.cli"]


@dataclass
class LocalStack:
    """`data_dir` holds the local Redis's AOF, the api's data and the process logs.

    `redis_url` uses a running Redis instead of starting one. `models_yaml` (text) or
    `models_file` name the deployments; `env` is added to every child's environment.
    `output`: "inherit" (the children write to this terminal), "quiet", or "logs" (one file
    per process under data_dir/logs)."""

    data_dir: Path
    models_yaml: str | None = None
    models_file: Path | None = None
    redis_url: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    output: str = "quiet"
    strict: bool = False  # the local Redis fsyncs every write
    appendonly: bool = True
    redis_password: str | None = None
    redis_tls: tuple[Path, Path] | None = None
    redis_port: int | None = None  # a free one if None
    host: str = "127.0.0.1"
    logs_dir: Path | None = None  # with output="logs"; data_dir/logs if not given
    # Children in sessions of their own: a terminal's Ctrl-C reaches this process alone, which
    # stops them in order (workers drain while Redis still answers; `sluice up` sets it)
    own_session: bool = False
    redis: EmbeddedRedis | None = None
    apis: dict[int, subprocess.Popen] = field(default_factory=dict)  # port -> process
    workers: dict[str, subprocess.Popen] = field(default_factory=dict)  # name -> process
    jobs: subprocess.Popen | None = None
    webhooks: subprocess.Popen | None = None  # the webhook sender (docs/webhooks.md)

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if self.models_yaml is not None:
            self.models_file = self.data_dir / "models.yaml"
            self.models_file.write_text(self.models_yaml)

    # -- Redis --------------------------------------------------------------------------------

    def start_redis(self) -> str:
        """Start the local Redis unless a URL was given; returns the URL the children use."""
        if self.redis_url is None or self.redis is not None:
            if self.redis is None:
                self.redis = EmbeddedRedis(self.data_dir / "redis", self.redis_port,
                                           appendonly=self.appendonly, password=self.redis_password,
                                           tls=self.redis_tls, strict=self.strict,
                                           own_session=self.own_session)
            self.redis.start()
            self.redis_url = self.redis.url
        return self.redis_url

    def restart_redis(self, down_s: float = 0.0) -> float:
        """kill -9 the local Redis and start it again on its port and data; returns the
        seconds it was down."""
        assert self.redis is not None, "only a local Redis can be restarted"
        t0 = time.monotonic()
        self.redis.stop(kill=True)
        time.sleep(down_s)
        self.redis.start()
        return time.monotonic() - t0

    @property
    def child_env(self) -> dict[str, str]:
        env = {**os.environ, "SLUICE_DATA_DIR": str(self.data_dir / "data"), **self.env}
        if self.redis_url:
            env["SLUICE_REDIS_URL"] = self.redis_url
        if self.models_file:
            env["SLUICE_MODELS_FILE"] = str(self.models_file)
        return env

    # -- processes ----------------------------------------------------------------------------

    def _spawn(self, args: list[str], log: str, **env: str) -> subprocess.Popen:
        if self.output == "logs":
            logs = self.logs_dir or self.data_dir / "logs"
            logs.mkdir(parents=True, exist_ok=True)
            with open(logs / f"{log}.log", "ab") as out:
                return subprocess.Popen([*CLI, *args], env={**self.child_env, **env}, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=self.own_session)
        # quiet: to /dev/null; inherit: to this process's own stdout and stderr (None)
        sink = subprocess.DEVNULL if self.output == "quiet" else None
        return subprocess.Popen([*CLI, *args], env={**self.child_env, **env}, stdout=sink, stderr=sink,
                                start_new_session=self.own_session)

    def start_api(self, port: int | None = None, *args: str, log: str | None = None, **env: str) -> str:
        """One api process (on `port`, or a free one); returns its URL."""
        port = port or free_port()
        self.apis[port] = self._spawn(["api", "--host", self.host, "--port", str(port), *args],
                                      log or f"api-{port}", **env)
        return self.api_url(port)

    def api_url(self, port: int | None = None) -> str:
        port = port or next(iter(self.apis))
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{port}"

    @property
    def url(self) -> str:
        """The first api's URL."""
        return self.api_url()

    def start_worker(self, model: str, name: str | None = None, *, engine: str | None = None,
                     log: str | None = None, **env: str) -> subprocess.Popen:
        name = name or f"{model}-w{len(self.workers)}"
        args = ["worker", "--model", model, "--name", name, *(["--engine", engine] if engine else [])]
        self.workers[name] = self._spawn(args, log or name, **env)
        return self.workers[name]

    def start_jobs(self) -> subprocess.Popen:
        self.jobs = self._spawn(["jobs"], "jobs")
        return self.jobs

    def start_webhooks(self) -> subprocess.Popen:
        self.webhooks = self._spawn(["webhooks", "send"], "webhooks")
        return self.webhooks

    @property
    def processes(self) -> list[subprocess.Popen]:
        """Workers first: stopped in this order, they drain their requests while the api
        still answers."""
        return [*self.workers.values(), *([self.jobs] if self.jobs else []),
                *([self.webhooks] if self.webhooks else []), *self.apis.values()]

    def wait_ready(self, timeout_s: float = 600, cancelled: Callable[[], bool] = lambda: False,
                   probe: str = "readyz") -> bool:
        """Until every api answers /readyz (its models have live workers; /healthz for an api
        started without workers); raises if a child exits first."""
        live = [p for p in self.processes if p.poll() is None]  # not those a test killed earlier
        for port in self.apis:
            if not wait_ready(self.api_url(port), live, timeout_s=timeout_s, cancelled=cancelled,
                              probe=probe):
                return False
        return True

    def kill(self, proc: subprocess.Popen, sig: signal.Signals = signal.SIGKILL) -> None:
        proc.send_signal(sig)
        if sig == signal.SIGKILL:
            proc.wait()

    def stop(self, timeout_s: float = 60) -> None:
        stop_processes(self.processes, timeout_s=timeout_s)
        if self.redis is not None:
            self.redis.stop()

    # -- the common shape: one call ---------------------------------------------------------

    def up(self, workers: list[str], *, engine: str | None = None, jobs: bool = False,
           api_port: int | None = None, api_args: tuple[str, ...] = (), timeout_s: float = 600,
           names: list[str] | None = None) -> LocalStack:
        """Redis, one worker per name in `workers` (a model name each), the jobs worker if asked,
        one api; returns once the api is ready. Stops what it started if that fails."""
        try:
            self.start_redis()
            for i, model in enumerate(workers):
                self.start_worker(model, names[i] if names else None, engine=engine)
            if jobs:
                self.start_jobs()
            self.start_api(api_port, *api_args)
            self.wait_ready(timeout_s, probe="readyz" if workers else "healthz")
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
