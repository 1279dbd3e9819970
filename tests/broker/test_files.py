"""FileStore on a private Redis and a temporary folder: uploads whole or absent, limits with a 4xx
naming the problem, metadata with a TTL, and the sweep of content whose metadata expired."""

from __future__ import annotations

import io
import os
import random
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sluice.broker.jobs.files import FileError, FileStore, LineScan, _key, read_lines, scan_lines


@pytest.fixture
def store(redis: Redis, tmp_path: Path) -> FileStore:
    return FileStore(redis, tmp_path / "files", max_bytes=1024, ttl_s=3600)


async def test_a_file_round_trips_and_its_metadata_expires(store: FileStore, redis: Redis) -> None:
    meta = await store.create("in.jsonl", "batch", b'{"a": 1}\n', owner="alice")
    assert meta["bytes"] == 9 and meta["purpose"] == "batch" and meta["owner"] == "alice"
    assert meta["expires_at"] == meta["created_at"] + 3600
    assert await store.get(meta["id"]) == meta
    assert await store.content(meta["id"]) == b'{"a": 1}\n'
    assert 0 < await redis.ttl(_key(meta["id"])) <= 3600
    short = await store.create("in.jsonl", "batch", b"{}\n", expires_after_s=60)
    assert 0 < await redis.ttl(_key(short["id"])) <= 60


async def test_list_by_purpose_oldest_first_and_delete(store: FileStore) -> None:
    first = await store.create("a.jsonl", "batch", b"{}\n")
    second = await store.create("b.jsonl", "batch_output", b"")
    assert [m["id"] for m in await store.list()] in ([first["id"], second["id"]], [second["id"], first["id"]])
    assert [m["id"] for m in await store.list("batch_output")] == [second["id"]]
    await store.delete(first["id"])
    assert not store.path(first["id"]).exists()
    with pytest.raises(FileError) as gone:
        await store.get(first["id"])
    assert gone.value.status == 404 and first["id"] in str(gone.value)


@pytest.mark.parametrize(("purpose", "data", "status", "naming"), [
    ("fine-tune", b"{}\n", 400, "purpose"),
    ("batch", b"", 400, "empty"),
    ("batch", b" \n\t\n", 400, "empty"),
    ("batch", b"x" * 1025, 413, "1024 bytes"),
])
async def test_bad_uploads_are_4xx_and_leave_nothing(store: FileStore, redis: Redis, purpose: str, data: bytes,
                                                      status: int, naming: str) -> None:
    with pytest.raises(FileError) as refused:
        await store.create("x.jsonl", purpose, data)
    assert refused.value.status == status and naming in str(refused.value)
    assert not store.root.exists() or list(store.root.iterdir()) == []
    assert [k async for k in redis.scan_iter("*")] == []


async def test_an_upload_is_read_in_chunks_and_a_big_one_stops_at_the_limit(redis: Redis, tmp_path: Path) -> None:
    class Counting(io.BytesIO):
        reads = 0

        def read(self, size: int | None = -1) -> bytes:
            Counting.reads += 1
            return super().read(size)

    store = FileStore(redis, tmp_path / "files", max_bytes=3 * 1024 * 1024)
    meta = await store.create_from("big.jsonl", "batch", Counting(b"{}\n" * 1024 * 1024))
    assert meta["bytes"] == 3 * 1024 * 1024 and Counting.reads > 2
    with pytest.raises(FileError):
        await store.create_from("huge.jsonl", "batch", Counting(b"x" * (3 * 1024 * 1024 + 1)))


async def test_content_without_metadata_or_metadata_without_content_is_not_found(
        store: FileStore, redis: Redis) -> None:
    meta = await store.create("in.jsonl", "batch", b"{}\n")
    store.path(meta["id"]).unlink()
    with pytest.raises(FileError, match="not found"):
        await store.content(meta["id"])
    with pytest.raises(FileError, match="not found"):
        await store.delete("file-absent")


async def test_the_sweep_takes_only_idle_content_whose_metadata_is_gone(store: FileStore, redis: Redis) -> None:
    kept = await store.create("kept.jsonl", "batch", b"{}\n")
    expired = await store.create("expired.jsonl", "batch", b"{}\n")
    fresh = await store.create("fresh.jsonl", "batch", b"{}\n")
    await redis.delete(_key(expired["id"]), _key(fresh["id"]))  # what their TTL does
    part = store.root / "file-upload.part"
    part.write_bytes(b"half")
    old = time.time() - 3600
    for path in (store.path(kept["id"]), store.path(expired["id"]), part):
        os.utime(path, (old, old))
    assert sorted(await store.sweep()) == sorted([expired["id"], part.name])
    assert store.path(kept["id"]).exists()
    assert store.path(fresh["id"]).exists()  # just written: its metadata may be on its way


class Trickle(io.BytesIO):
    """A file that answers each read with at most a few bytes, and counts what it gave."""

    def __init__(self, data: bytes, rng: random.Random, most: int):
        super().__init__(data)
        self.rng, self.most, self.given = rng, most, 0

    def read(self, size: int | None = -1) -> bytes:  # type: ignore[override]
        chunk = super().read(self.rng.randint(1, self.most))
        self.given += len(chunk)
        return chunk


@pytest.mark.parametrize("seed", range(40))
def test_lines_are_read_whatever_the_chunks_and_a_long_one_is_never_held(seed: int) -> None:
    rng = random.Random(seed)
    pieces = [rng.choice([b"", b"  ", b"\r", b'{"a": 1}', b"x" * rng.randint(1, 40), b"\t \xe2\x80\xa8"])
              for _ in range(rng.randint(0, 30))]
    data = b"\n".join(pieces) + rng.choice([b"", b"\n", b"\n\n"])
    limit = rng.randint(1, 20)
    expected = [(i, None if len(x) > limit else x) for i, x in enumerate(data.split(b"\n")) if x.strip()]
    assert list(read_lines(Trickle(data, rng, rng.randint(1, 50)), limit)) == expected


def test_a_scan_stops_at_the_first_line_over_a_limit() -> None:
    rng = random.Random(0)
    many = Trickle(b'{"custom_id": "x"}\n' * 100_000, rng, 4096)
    assert scan_lines(many, max_lines=10, max_line_bytes=100) == LineScan(11, None)
    assert many.given < 64 * 1024  # not the 1.9 MB file
    long = Trickle(b"{}\n\n" + b"x" * 10_000_000, rng, 1 << 20)
    assert scan_lines(long, max_lines=10, max_line_bytes=1000) == LineScan(1, 2)
    assert long.given < 3 << 20
    assert scan_lines(io.BytesIO(b"{}\n" * 10 + b"\n \n"), 10, 2) == LineScan(10, None)


async def calls(redis: Redis, command: str) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


@pytest.mark.skipif(os.environ.get("SLUICE_TEST_REDIS") == "cluster",
                    reason="counts the reads in one server's INFO commandstats")
async def test_a_keys_listing_reads_only_its_own_files(redis: Redis, tmp_path: Path) -> None:
    store = FileStore(redis, tmp_path / "files", max_bytes=1024)
    for i in range(300):
        await store.create(f"bob-{i}.jsonl", "batch", b"{}\n", owner="bob")
    mine = [(await store.create("a.jsonl", "batch", b"{}\n", owner="alice"))["id"] for _ in range(3)]
    before = await calls(redis, "get")
    assert [m["id"] for m in await store.list(owner="alice")] == mine[::-1]  # newest first
    assert await calls(redis, "get") - before == 3  # not one read of bob's 300
    assert len(await store.list()) == 303  # everyone's, for an admin


@pytest.mark.parametrize("seed", range(12))
async def test_pages_cover_a_keys_live_files_once_newest_first(redis: Redis, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    store = FileStore(redis, tmp_path / "files", max_bytes=1024)
    made: dict[str, list[str]] = {"alice": [], "bob": []}
    for _ in range(rng.randint(0, 40)):
        owner = rng.choice(list(made))
        made[owner].append((await store.create("x.jsonl", rng.choice(["batch", "batch_output"]), b"{}\n",
                                               owner=owner))["id"])
        if made[owner] and rng.random() < 0.2:  # deleted, or expired (its metadata gone)
            gone = made[owner].pop(rng.randrange(len(made[owner])))
            await (store.delete(gone) if rng.random() < 0.5 else redis.delete(_key(gone)))
    limit, after, seen = rng.randint(1, 7), None, []
    while True:
        page = await store.list(owner="alice", after=after, limit=limit)
        seen += [m["id"] for m in page]
        if len(page) < limit:
            break
        after = page[-1]["id"]
    assert seen == made["alice"][::-1]


async def test_a_key_keeps_at_most_its_quota_of_uploads(redis: Redis, tmp_path: Path) -> None:
    store = FileStore(redis, tmp_path / "files", max_bytes=1024, max_files=3)
    kept = [(await store.create_from("a.jsonl", "batch", io.BytesIO(b"{}\n"), owner="alice", upload=True))["id"]
            for _ in range(3)]
    with pytest.raises(FileError) as refused:
        await store.create_from("a.jsonl", "batch", io.BytesIO(b"{}\n"), owner="alice", upload=True)
    assert refused.value.status == 400 and "SLUICE_MAX_FILES_PER_KEY" in str(refused.value)
    assert len(os.listdir(tmp_path / "files")) == 3  # nothing written for the refused one
    await store.create_from("b.jsonl", "batch", io.BytesIO(b"{}\n"), owner="bob", upload=True)  # another key's own
    await store.create("out.jsonl", "batch_output", b"{}\n", owner="alice")  # a job's output is not refused
    await store.delete(kept[0])
    await redis.delete(_key(kept[1]))  # expired
    await store.delete((await store.list(owner="alice", purpose="batch_output"))[0]["id"])
    for _ in range(2):
        await store.create_from("a.jsonl", "batch", io.BytesIO(b"{}\n"), owner="alice", upload=True)
    with pytest.raises(FileError):
        await store.create_from("a.jsonl", "batch", io.BytesIO(b"{}\n"), owner="alice", upload=True)
    assert await redis.zcard("sluice:files:by:alice") == 3  # the gone ones' ids dropped
