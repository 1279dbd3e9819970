"""A Docker daemon of the test's own: its own socket, exec root and data root, no iptables rules,
no default bridge, no forwarding turned on; stopped with everything it started.

The data root persists (~/.cache/sluice/docker): it is the layer cache that makes a second run
take a minute. Its containers, networks and volumes do not: a run removes what an earlier,
interrupted one left before it starts, and what it made itself before it stops.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

DATA_ROOT = Path(os.environ.get("SLUICE_DOCKER_DATA_ROOT", Path.home() / ".cache" / "sluice" / "docker"))


class DockerdUnavailable(RuntimeError):
    """The daemon cannot run on this machine (the test skips, saying why)."""


def _links() -> set[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return {line.split(":", 2)[1].strip().split("@")[0] for line in out.splitlines() if line.count(":") >= 2}


def _mounts_under(*roots: Path) -> list[str]:
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        target = line.split()[4].replace("\\040", " ")
        if any(target == str(r) or target.startswith(f"{r}/") for r in roots):
            found.append(target)
    return sorted(found, key=len, reverse=True)  # the deepest first


def _pids_mentioning(path: Path) -> list[int]:
    """Processes whose command line names `path` (this daemon's containerd and shims)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            with contextlib.suppress(OSError):
                if str(path).encode() in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
    return pids


def _is_docker(pid: int) -> bool:
    """Still one of the daemon's (docker-proxy, containerd...), not a new process with its pid."""
    try:
        return b"docker" in Path(f"/proc/{pid}/cmdline").read_bytes() or b"containerd" in Path(
            f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                todo += children
    return found


class Dockerd:
    def __init__(self, data_root: Path = DATA_ROOT) -> None:
        self.data_root = data_root
        # Short paths (containerd's sockets live under the exec root), on a tmpfs where there is one.
        runtime = "/run" if os.access("/run", os.W_OK) else None
        self.run_dir = Path(tempfile.mkdtemp(prefix="sluice-dockerd-", dir=runtime))
        self.socket = self.run_dir / "docker.sock"
        self.log = self.run_dir / "dockerd.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("DOCKER_", "COMPOSE_"))}
        self.env["DOCKER_HOST"] = f"unix://{self.socket}"
        self.proc: subprocess.Popen | None = None
        self._lock: int | None = None
        self._links_before = _links()
        self._forwarding = Path("/proc/sys/net/ipv4/ip_forward").read_text()

    def docker(self, *args: str, check: bool = True, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
        done = subprocess.run(["docker", *args], env=self.env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and done.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def start(self, lock_timeout_s: float = 900) -> None:
        self.data_root.mkdir(parents=True, exist_ok=True)
        # One daemon per data root: a concurrent run waits for this one.
        self._lock = os.open(f"{self.data_root}.lock", os.O_CREAT | os.O_RDWR, 0o644)
        deadline = time.monotonic() + lock_timeout_s
        while True:
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{self.data_root} is held by another run for {lock_timeout_s:.0f}s") from None
                time.sleep(2)
        (self.run_dir / "daemon.json").write_text("{}")  # not /etc/docker/daemon.json
        command = ["dockerd", "--config-file", str(self.run_dir / "daemon.json"),
                   "--data-root", str(self.data_root), "--exec-root", str(self.run_dir / "exec"),
                   "--host", self.env["DOCKER_HOST"], "--pidfile", str(self.run_dir / "docker.pid"),
                   "--storage-driver", "overlay2",
                   # Nothing of the host's network setup is touched: no iptables rules, no
                   # forwarding, no docker0. Compose's own bridge connects the containers, and
                   # docker-proxy publishes their ports on 127.0.0.1.
                   "--iptables=false", "--ip-forward=false", "--bridge=none", "--log-level=warn"]
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log.read_text()[-1500:]
                self.stop()
                raise DockerdUnavailable(f"dockerd did not start here:\n{tail}")
            time.sleep(0.3)
        self.remove_everything()  # what an interrupted run left (its containers would restart)

    def _answers(self) -> bool:
        """Whether the daemon answers; a starting one may hold a probe past its timeout (a loaded
        machine): that is a no, not an error, until the start's deadline."""
        try:
            return self.docker("version", "--format", "{{.Server.Version}}", check=False, timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def remove_everything(self) -> None:
        ids = self.docker("ps", "-aq", check=False).stdout.split()
        if ids:
            self.docker("rm", "-f", "-v", *ids, check=False)
        self.docker("network", "prune", "-f", check=False)
        self.docker("volume", "prune", "-f", check=False)

    def stop(self) -> list[str]:
        """Stop the daemon and whatever it left; returns what had to be cleaned up by force."""
        forced: list[str] = []
        children: list[int] = []  # containerd, docker-proxy: they go with the daemon, or below
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.remove_everything()
            children = _descendants(self.proc.pid)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                forced.append("dockerd (SIGKILL)")
                self.proc.kill()
                self.proc.wait(10)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = sorted(set(_pids_mentioning(self.run_dir)) | {p for p in children if _is_docker(p)})
            for pid in pids:
                forced.append(f"pid {pid} ({sig.name})")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if pids:
                time.sleep(2)
        for target in _mounts_under(self.run_dir, self.data_root):
            forced.append(f"mount {target}")
            subprocess.run(["umount", "-l", target], capture_output=True)
        for link in _links() - self._links_before:
            if link.startswith(("br-", "veth", "docker")):
                forced.append(f"link {link}")
                subprocess.run(["ip", "link", "delete", link], capture_output=True)
        Path("/proc/sys/net/ipv4/ip_forward").write_text(self._forwarding)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None
        return forced

    def leftovers(self) -> list[str]:
        """What is still there after stop(): processes, mounts, links (none, or the test fails)."""
        left = [f"pid {p}" for p in _pids_mentioning(self.run_dir)]
        left += [f"mount {m}" for m in _mounts_under(self.run_dir, self.data_root)]
        left += [f"link {name}" for name in _links() - self._links_before if name.startswith(("br-", "veth"))]
        if self.proc is not None and self.proc.poll() is None:
            left.append(f"dockerd {self.proc.pid}")
        return left


@contextlib.contextmanager
def private_dockerd() -> Iterator[Dockerd]:
    daemon = Dockerd()
    try:
        daemon.start()
        yield daemon
    finally:
        daemon.stop()
