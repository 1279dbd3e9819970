"""A real OCI registry for the tests: Debian's docker-registry (the distribution registry) on a
free loopback port, its storage in the test's directory, optionally behind an htpasswd file."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from sluice.supervisor.processes import free_port


@dataclass
class Registry:
    host: str  # 127.0.0.1:port
    storage: Path

    def blob(self, digest: str) -> Path:
        hexa = digest.removeprefix("sha256:")
        return self.storage / "docker/registry/v2/blobs/sha256" / hexa[:2] / hexa / "data"


@contextmanager
def running_registry(root: Path, users: dict[str, str] | None = None) -> Iterator[Registry]:
    binary = shutil.which("docker-registry")
    if binary is None:
        pytest.skip("Debian's docker-registry is not installed (scripts/test-deps.sh installs it as root)")
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    auth = ""
    if users:
        import bcrypt

        (root / "htpasswd").write_text("".join(
            f"{u}:{bcrypt.hashpw(p.encode(), bcrypt.gensalt(rounds=4)).decode()}\n" for u, p in users.items()))
        auth = f"auth:\n  htpasswd:\n    realm: sluice-tests\n    path: {root / 'htpasswd'}\n"
    (root / "config.yml").write_text(
        f"version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {root / 'data'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n{auth}")
    proc = subprocess.Popen([binary, "serve", str(root / "config.yml")], stdout=subprocess.DEVNULL,
                            stderr=open(root / "registry.log", "wb"))
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=1).status_code in (200, 401):
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"docker-registry did not start: {(root / 'registry.log').read_text()[-2000:]}")
            time.sleep(0.1)
        yield Registry(f"127.0.0.1:{port}", root / "data")
    finally:
        proc.terminate()
        proc.wait(10)
