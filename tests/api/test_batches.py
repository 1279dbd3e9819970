"""Files and batches at the api: limits refused with a 400 naming them (and their setting)
before anything is queued."""

from __future__ import annotations

import io
import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, BinaryIO

import httpx
import pytest
from fastapi import FastAPI
from redis.asyncio import Redis

from sluice.broker.jobs.files import FileStore
from sluice.config.settings import Settings
from tests.api.keyed_app import ALICE, client, keyed_app


class Jobs:
    """Stands for the Celery client: records the batches sent to the jobs worker."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def send_task(self, _name: str, args: list[str], **_kw: Any) -> None:
        self.sent.extend(args)


@pytest.fixture
def limits() -> dict[str, Any]:
    return {"max_batch_lines": 5, "max_batch_line_bytes": 200}


@pytest.fixture
async def app(redis: Redis, settings: Settings, tmp_path: Path, limits: dict[str, Any]) -> AsyncIterator[FastAPI]:
    async with keyed_app(settings, tmp_path, **limits) as app:
        app.state.sluice.celery = Jobs()
        yield app


@pytest.fixture
async def alice(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with client(app, ALICE) as c:
        yield c


def request(i: int, prompt: str = "hi") -> bytes:
    return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": prompt}}).encode()


async def upload(c: httpx.AsyncClient, data: bytes, purpose: str = "batch") -> str:
    r = await c.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": purpose})
    assert r.status_code == 200, r.text
    return r.json()["id"]


async def create(c: httpx.AsyncClient, file_id: str, **extra: Any) -> httpx.Response:
    return await c.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/completions", **extra})


@pytest.mark.parametrize(("lines", "says"), [
    ([request(i) for i in range(6)], "has more than 5 requests, the limit for one batch (SLUICE_MAX_BATCH_LINES)"),
    ([request(0), request(1, "x" * 300)], "line 2 of file {id} is longer than 200 bytes, the limit for one request "
                                          "(SLUICE_MAX_BATCH_LINE_BYTES)"),
    ([request(0), b"", b" " * 300, request(1, "x" * 300)], "line 4 of file"),
])
async def test_a_batch_over_a_file_limit_is_refused_at_create(app: FastAPI, alice: httpx.AsyncClient,
                                                              lines: list[bytes], says: str) -> None:
    file_id = await upload(alice, b"\n".join(lines))
    r = await create(alice, file_id)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says.format(id=file_id) in error["message"] and error["param"] == "input_file_id"
    assert app.state.sluice.celery.sent == []
    assert (await alice.get("/v1/batches")).json()["data"] == []


async def test_a_batch_at_the_file_limits_is_created(app: FastAPI, alice: httpx.AsyncClient) -> None:
    lines = [request(i) for i in range(5)] + [b"", b"  "]
    lines[0] = request(0, "x" * (200 - len(request(0, ""))))
    assert len(lines[0]) == 200
    file_id = await upload(alice, b"\n".join(lines) + b"\n")
    r = await create(alice, file_id)
    assert r.status_code == 200, r.text
    assert app.state.sluice.celery.sent == [r.json()["id"]]


@pytest.mark.parametrize("metadata", [
    {f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}, {"k": "v" * 7_000_000},
])
async def test_batch_metadata_is_bounded_as_openai_bounds_it(app: FastAPI, alice: httpx.AsyncClient,
                                                             metadata: dict[str, str]) -> None:
    file_id = await upload(alice, request(0))
    r = await create(alice, file_id, metadata=metadata)
    assert r.status_code in (413, 422), r.text
    if r.status_code == 422:
        assert r.json()["error"]["param"] == "metadata" and "at most 16 keys" in r.json()["error"]["message"]
    assert app.state.sluice.celery.sent == []
    largest = {f"k{i:02d}" + "k" * 61: "v" * 512 for i in range(16)}
    r = await create(alice, file_id, metadata=largest)
    assert r.status_code == 200 and r.json()["metadata"] == largest


class Reads(io.BufferedReader):
    """A file that records the size of each read."""

    sizes: list[int] = []

    def read(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        chunk = super().read(size)
        Reads.sizes.append(len(chunk))
        return chunk


async def test_a_download_streams_the_file_from_disk(alice: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytes(random.Random(0).getrandbits(8) for _ in range(1 << 16)) * 80  # 5 MiB
    file_id = await upload(alice, data)
    opened = FileStore.open

    async def recording(self: FileStore, fid: str) -> BinaryIO:
        return Reads(await opened(self, fid))  # type: ignore[arg-type]

    monkeypatch.setattr(FileStore, "open", recording)
    monkeypatch.setattr(Path, "read_bytes", lambda _: pytest.fail("the file was read whole"))
    Reads.sizes = []
    async with alice.stream("GET", f"/v1/files/{file_id}/content") as r:
        assert r.status_code == 200 and r.headers["content-length"] == str(len(data))
        got = b"".join([chunk async for chunk in r.aiter_raw()])
    assert got == data
    assert max(Reads.sizes) <= 1 << 20 and sum(Reads.sizes) == len(data)
    r = await alice.get("/v1/files/file-nope/content")
    assert r.status_code == 404


@pytest.mark.parametrize("limits", [{"max_files_per_key": 3}])
async def test_files_are_listed_newest_first_by_page_and_a_key_keeps_its_quota(alice: httpx.AsyncClient) -> None:
    ids = [await upload(alice, request(i)) for i in range(3)]
    r = await alice.post("/v1/files", files={"file": ("in.jsonl", request(9))}, data={"purpose": "batch"})
    assert r.status_code == 400 and "SLUICE_MAX_FILES_PER_KEY" in r.json()["error"]["message"], r.text
    first = (await alice.get("/v1/files", params={"limit": 2})).json()
    assert [f["id"] for f in first["data"]] == [ids[2], ids[1]] and first["has_more"] is True
    assert (first["first_id"], first["last_id"]) == (ids[2], ids[1])
    rest = (await alice.get("/v1/files", params={"limit": 2, "after": first["last_id"]})).json()
    assert [f["id"] for f in rest["data"]] == [ids[0]] and rest["has_more"] is False
    assert all("owner" not in f for f in first["data"] + rest["data"])
    assert (await alice.get("/v1/files", params={"limit": 0})).status_code == 422
    assert (await alice.delete(f"/v1/files/{ids[0]}")).status_code == 200
    await upload(alice, request(9))  # room again
