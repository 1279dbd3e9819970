"""The running `sluice up`'s record in its data directory: a lock that one `sluice up` at a time
holds on that directory, and the URL of the Redis it runs, which operator commands (`sluice dlq`)
use by default."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import TextIO
from urllib.parse import urlsplit, urlunsplit

LOCK = "up.lock"
REDIS_URL = "redis-url"


class DataDirBusy(RuntimeError):
    pass


class UpLock:
    """An exclusive lock on `data_dir`, held while this process lives (the kernel drops it if it is
    killed); the running stack's Redis URL is written beside it and removed on release."""

    def __init__(self, data_dir: Path):
        self.data_dir = Path(data_dir)
        self._file: TextIO | None = None

    def acquire(self) -> UpLock:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        f = open(self.data_dir / LOCK, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip()
            f.close()
            raise DataDirBusy(f"another sluice up{f' (pid {holder})' if holder else ''} is running on "
                              f"{self.data_dir}; stop it, or give this one another SLUICE_DATA_DIR") from None
        f.truncate(0)
        f.write(str(os.getpid()))
        f.flush()
        self._file = f
        return self

    def record_redis(self, url: str) -> None:
        (self.data_dir / REDIS_URL).write_text(url + "\n")

    def release(self) -> None:
        (self.data_dir / REDIS_URL).unlink(missing_ok=True)
        if self._file is not None:
            self._file.close()  # drops the lock
            self._file = None


def running_redis_url(data_dir: Path) -> str | None:
    """The Redis URL of the `sluice up` running on `data_dir`, or None if none runs there (a
    record that a killed one left behind is not believed: its lock is free)."""
    record = Path(data_dir) / REDIS_URL
    if not record.is_file():
        return None
    try:
        with open(Path(data_dir) / LOCK) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return record.read_text().strip() or None  # held: it runs
            return None
    except FileNotFoundError:
        return None


def shown(url: str) -> str:
    """A Redis URL without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}{f':{parts.port}' if parts.port else ''}"
    return urlunsplit(parts._replace(netloc=netloc))
