"""Prefix affinity with real processes (docs/prefix-affinity.md): an api that tokenizes the default
model's prompts into prefix keys, two null-engine workers placing by them through Redis. With the
owners table not yet recomputed (a long heartbeat interval), each group belongs to its rank-1
live worker, and the bound is long enough that no other worker may take a request of it while
its owner has a free slot: every request of a group is served by that one worker."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import redis as redis_sync

from sluice.broker.delivery.affinity import group_of, rendezvous_ranks
from sluice.broker.keys import ModelKeys
from sluice.config.model import ModelConfig
from sluice.config.settings import Settings
from sluice.protocol.tokens import PromptLimits
from sluice.supervisor.stack import LocalStack
from tests.e2e.conftest import submit, wait_done

MODEL = "aff"
WORKERS = ["w0", "w1"]
PREAMBLES = [f"You are assistant number {k} of the affinity test. Answer briefly, plainly and politely, in "
             "English, without lists, code or tables; never ask back, keep to the point, then stop. " for k in range(4)]


async def test_each_prefix_group_is_served_by_its_owner(tmp_path: Path) -> None:
    env = {"SLUICE_LOG_LEVEL": "WARNING", "SLUICE_HEARTBEAT_INTERVAL_S": "600", "SLUICE_WORKER_TTL_S": "600",
           "SLUICE_PREFIX_AFFINITY_WAIT_MS": "60000"}
    with LocalStack(tmp_path, f"models:\n  - name: {MODEL}\n", env=env) as local:
        local.up([MODEL, MODEL], names=WORKERS, engine="null", timeout_s=120)
        r = redis_sync.Redis.from_url(local.redis_url, decode_responses=True)
        keys = ModelKeys(MODEL)
        deadline = time.monotonic() + 30
        while set(r.hkeys(f"{keys.tag}:aff:slots")) != set(WORKERS) and time.monotonic() < deadline:
            time.sleep(0.1)  # both have fetched: live, placing
        assert set(r.hkeys(f"{keys.tag}:aff:slots")) == set(WORKERS)
        sent: dict[str, str] = {}
        async with httpx.AsyncClient(base_url=local.url, timeout=60) as client:
            for n in range(24):  # one at a time: every owner always has a free slot
                prompt = f"{PREAMBLES[n % 4]}question {n}"
                rid = await submit(client, MODEL, prompt=prompt, max_tokens=2)
                assert (await wait_done(client, rid))["status"] == "done"
                sent[rid] = await _group(prompt)
        # A worker appends a request's log record after its commit (batched, every 0.1 s): done
        # is not yet logged, so the log is read until it holds them all.
        served: dict[str, str] = {}
        deadline = time.monotonic() + 30
        while not set(sent) <= set(served) and time.monotonic() < deadline:
            time.sleep(0.1)
            for _, fields in r.xrange(keys.log):
                record = json.loads(fields["data"])
                served[record["request_id"]] = record["batch_id"].split("-", 1)[0]
        r.close()
    assert all(sent.values()) and len(set(sent.values())) == 4  # four prefix groups
    by_group: dict[str, set[str]] = {}
    for rid, group in sent.items():
        by_group.setdefault(group, set()).add(served[rid])
    assert by_group == {g: {rendezvous_ranks(g, WORKERS)[0]} for g in by_group}
    assert len({w for ws in by_group.values() for w in ws}) == 2  # (these four groups: both workers own some)


async def _group(prompt: str) -> str:
    """The prompt's prefix group, as the api computes it (the default model's tokenizer)."""
    measured = await PromptLimits(Settings().cache_dir).measure(ModelConfig(name=MODEL), {"prompt": prompt}, 2)
    return group_of(list(measured.prefix))
