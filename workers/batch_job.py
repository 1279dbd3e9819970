"""One bulk job: read an OpenAI batch input file, feed its lines onto the model's bulk stream
with a bounded number outstanding, gather the results, and write the output and error files.

Everything a job needs to resume is in Redis (which line became which request, the output
records so far), so a restarted job re-runs nothing that finished and re-submits nothing
that is still queued. One run at a time holds the job's lock; a run that loses it stops, and
every write it makes is fenced by the lock in Redis (broker/batches.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from sluice.broker.admission import Admission, QueueFull
from sluice.broker.batches import BatchStore, LockLost
from sluice.broker.files import FileStore
from sluice.broker.keys import ModelKeys
from sluice.broker.registry import ModelRegistry
from sluice.config.settings import Settings
from sluice.protocol.ids import new_request_id
from sluice.protocol.messages import FinalResult, RequestMessage, SamplingSpec
from sluice.protocol.openai import ChatCompletionRequest, CompletionRequest, chat_object, completion_object
from sluice.protocol.states import ACTIVE_BATCH_STATES as ACTIVE
from sluice.protocol.states import FINAL_BATCH_STATES as TERMINAL

log = logging.getLogger(__name__)


@dataclass
class Line:
    index: int
    custom_id: str
    model: str
    row: dict[str, Any]
    sampling: SamplingSpec


def _error_record(custom_id: str | None, code: str, message: str, rid: str | None = None) -> dict[str, Any]:
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}, "request_id": rid}


def parse_line(index: int, text: str, endpoint: str, default_max_tokens: int = 256) -> Line | dict[str, Any]:
    """A valid line, or the error record that stands for it in the error file."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        return _error_record(None, "invalid_json", f"line {index + 1}: {err}")
    if not isinstance(data, dict):
        return _error_record(None, "invalid_request", f"line {index + 1}: expected a JSON object")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return _error_record(None, "invalid_request", f"line {index + 1}: custom_id must be a non-empty string")
    if data.get("method") != "POST" or data.get("url") != endpoint:
        return _error_record(custom_id, "invalid_request",
                             f"line {index + 1}: method must be POST and url {endpoint} (the batch's endpoint)")
    schema = CompletionRequest if endpoint == "/v1/completions" else ChatCompletionRequest
    try:
        body = schema.model_validate(data.get("body"))
    except ValidationError as err:
        return _error_record(custom_id, "invalid_request", f"line {index + 1}: body: {err.errors()[0]['msg']} "
                                                           f"at {'.'.join(map(str, err.errors()[0]['loc']))}")
    bad = body.unsupported() + (["n"] if body.n != 1 else []) + (["stream"] if body.stream else [])
    if isinstance(body, CompletionRequest) and len(body.prompt) != 1:
        bad.append("prompt (one prompt per line)")
    if not body.model:
        bad.append("model (required)")
    if bad:
        return _error_record(custom_id, "invalid_request", f"line {index + 1}: not supported in a batch: "
                                                           + ", ".join(bad))
    max_tokens = body.max_tokens or default_max_tokens
    if isinstance(body, CompletionRequest):
        row: dict[str, Any] = {"prompt": body.prompt[0], "max_tokens": max_tokens}
    else:
        row = {"messages": [m.plain() for m in body.messages], "max_tokens": max_tokens}
    sampling = SamplingSpec(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p,
                            stop=body.stop or [], seed=body.seed if body.seed is not None else index,
                            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty)
    return Line(index, custom_id, body.model, row, sampling)


class BatchJob:
    def __init__(self, settings: Settings, redis: Redis, batch_id: str, *, poll_s: float = 0.2):
        self.settings = settings
        self.redis = redis
        self.batch_id = batch_id
        self.poll_s = poll_s
        self.ttl_s = settings.job_lock_ttl_s
        self.store = BatchStore(redis, settings.batch_ttl_s, settings.result_ttl_s)
        self.files = FileStore(redis, settings.files_path, settings.max_file_bytes, settings.file_ttl_s)
        self.admission = Admission(redis, status_ttl_s=settings.status_ttl_s, reply_ttl_s=settings.reply_ttl_s,
                                   cancel_ttl_s=settings.cancel_ttl_s, result_ttl_s=settings.result_ttl_s,
                                   bulk_queue_share=settings.bulk_queue_share)
        self.models = ModelRegistry(redis)
        self.token = uuid.uuid4().hex
        self._lock_expires = 0.0  # monotonic time by which the lock lapses unless refreshed
        self._lost = False
        self._finished = False  # the run is over: the lock keeper stops

    async def run(self) -> None:
        """Take the job's lock and run the job to its end.

        Returns at once when the job is final or a live runner has it (that runner finishes
        it), and stops as soon as the lock is lost: whoever holds it then owns the job, and
        this run writes nothing more (every write is fenced by the lock in Redis as well).
        """
        if not await self._acquire():
            return
        keeper = asyncio.create_task(self._keep_lock())
        try:
            await self._run_locked()
        except LockLost:
            log.warning("batch %s: lost its lock, stopped; another runner has the job", self.batch_id)
        except Exception as err:
            log.exception("batch %s failed", self.batch_id)
            with contextlib.suppress(LockLost):
                await self.store.move(self.batch_id, "failed", ACTIVE, self.token,
                                      error=f"{type(err).__name__}: {err}")
        finally:
            self._finished = True
            keeper.cancel()
            await asyncio.wait([keeper], timeout=5)
            await self.store.unlock(self.batch_id, self.token)

    async def _acquire(self) -> bool:
        """The lock, at once or once a gone runner's lock has lapsed; False when the job is
        final or a live runner holds it."""
        while True:
            asked = time.monotonic()
            if await self.store.lock(self.batch_id, self.token, self.ttl_s):
                self._lock_expires = asked + self.ttl_s
                return True
            batch = await self.store.get(self.batch_id)
            if batch is None or batch["status"] in TERMINAL:
                return False
            if await self.store.runner_alive(self.batch_id):
                log.info("batch %s: a live runner has it", self.batch_id)
                return False

    async def _keep_lock(self) -> None:
        """Refresh the lock; mark it lost when another runner holds it, it has lapsed, or Redis
        could not be reached to refresh it before it would lapse."""
        while not self._finished:  # a flag as well: redis-py can swallow a cancel (see Worker.run)
            await asyncio.sleep(self.ttl_s / 3)
            if self._finished:
                return
            asked = time.monotonic()
            try:
                if not await self.store.refresh_lock(self.batch_id, self.token, self.ttl_s):
                    break
                self._lock_expires = asked + self.ttl_s
            except RedisError as err:
                log.warning("batch %s: could not refresh its lock: %s", self.batch_id, err)
                if time.monotonic() >= self._lock_expires:
                    break
        self._lost = True

    def _check_lock(self) -> None:
        if self._lost:
            raise LockLost(self.batch_id)

    async def _record(self, index: int, record: dict[str, Any], **counts: int) -> None:
        await self.store.record(self.batch_id, self.token, index, record, counts)

    async def _run_locked(self) -> None:
        batch = await self.store.get(self.batch_id)
        if batch is None or batch["status"] in TERMINAL:
            return
        # Its rows and output files belong to whoever made the batch (the object does not show it).
        batch["owner"] = await self.store.owner(self.batch_id)
        text = (await self.files.content(batch["input_file_id"])).decode("utf-8", errors="replace")
        raw_lines = [(i, t) for i, t in enumerate(text.splitlines()) if t.strip()]
        lines: list[Line] = []
        for i, t in raw_lines:
            parsed = parse_line(i, t, batch["endpoint"])
            if isinstance(parsed, Line):
                lines.append(parsed)
            else:
                await self._record(i, parsed, failed=1)
        status = await self.store.move(self.batch_id, "in_progress", ["validating"], self.token,
                                       total=len(raw_lines))
        if status in TERMINAL:  # cancelled before any runner started it
            return
        deployed = {m.name: m for m in await self.models.all()}
        for line in [x for x in lines if x.model not in deployed]:
            await self._record(line.index, _error_record(
                line.custom_id, "model_not_found", f"model {line.model!r} is not deployed"), failed=1)
        lines = [x for x in lines if x.model in deployed]
        await self._feed(batch, lines)
        await self._finish(batch)

    async def _feed(self, batch: dict[str, Any], lines: list[Line]) -> None:
        done = await self.store.outputs(self.batch_id)
        bound = await self.store.request_ids(self.batch_id)
        todo = [x for x in lines if x.index not in done]
        outstanding: dict[int, tuple[Line, str]] = {}
        # Resume: a line bound to a request that exists is waited for, not submitted again.
        for x in [x for x in todo if x.index in bound]:
            if await self.redis.exists(ModelKeys(x.model).status(bound[x.index])):
                outstanding[x.index] = (x, bound[x.index])
        queue = [x for x in todo if x.index not in outstanding]
        cancelling = False
        while outstanding or (queue and not cancelling):
            self._check_lock()
            current = await self.store.get(self.batch_id)
            if current and current["status"] == "cancelling" and not cancelling:
                cancelling = True
                for line, rid in outstanding.values():
                    await self.admission.cancel(line.model, rid)
            while queue and not cancelling and len(outstanding) < self.settings.bulk_outstanding:
                self._check_lock()
                line = queue[0]
                # A line keeps its first id, so a submission lost with its runner is not run twice.
                rid = bound.setdefault(line.index, new_request_id())
                await self.store.bind(self.batch_id, self.token, line.index, rid)
                try:
                    await self._submit(batch, line, rid)
                except QueueFull:
                    break  # the bulk lane is full: wait for results to make room
                queue.pop(0)
                outstanding[line.index] = (line, rid)
            await self._collect(outstanding, cancelling)
            await asyncio.sleep(self.poll_s)
    async def _submit(self, batch: dict[str, Any], line: Line, rid: str) -> None:
        now = time.time()
        message = RequestMessage(id=rid, model=line.model, rows=[line.row], sampling=line.sampling,
                                 enqueued_at=now, deadline=float(batch["expires_at"]), lane="bulk",
                                 owner=batch.get("owner"))
        await self.admission.submit(message, max_queued=self.settings.max_queued)

    async def _collect(self, outstanding: dict[int, tuple[Line, str]], cancelling: bool) -> None:
        if not outstanding:
            return
        items = list(outstanding.items())
        async with self.redis.pipeline(transaction=False) as pipe:
            for _, (line, rid) in items:
                pipe.hget(ModelKeys(line.model).status(rid), "result")
            results = await pipe.execute()
        for (index, (line, rid)), raw in zip(items, results):
            if raw is None:
                continue
            del outstanding[index]
            final = FinalResult.model_validate_json(raw)
            if final.status.value == "cancelled" and cancelling:
                continue  # a cancelled batch's output holds what finished
            if final.status.value == "done":
                build = completion_object if "prompt" in line.row else chat_object
                body = build(f"cmpl-{rid.removeprefix('req-')}", line.model, int(final.timings.finished or 0),
                             [final])
                record = {"id": f"batch_req_{rid.removeprefix('req-')}", "custom_id": line.custom_id,
                          "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}
                await self._record(index, record, completed=1, output_tokens=body["usage"]["completion_tokens"])
            else:
                await self._record(index, _error_record(
                    line.custom_id, final.status.value, final.error or final.status.value, rid), failed=1)

    async def _finish(self, batch: dict[str, Any]) -> None:
        """Write the output and error files and end the batch: `completed` (or `expired`), or
        `cancelled` when a cancel landed before the runner moved it to `finalizing`."""
        status = await self.store.move(self.batch_id, "finalizing", ["in_progress"], self.token)
        if status not in ("finalizing", "cancelling"):
            log.error("batch %s: cannot finish from status %r", self.batch_id, status)
            return
        records = await self.store.outputs(self.batch_id)
        ok = [records[i] for i in sorted(records) if records[i]["response"] is not None]
        errors = [records[i] for i in sorted(records) if records[i]["response"] is None]
        # Files are the one write a Lua script cannot fence: look first, and take them back if
        # the lock turns out lost when the batch is moved to its end.
        self._check_lock()
        if not await self.store.holds_lock(self.batch_id, self.token):
            raise LockLost(self.batch_id)
        fields: dict[str, Any] = {}
        name = batch["input_file_id"]
        if ok:
            fields["output_file_id"] = (await self.files.create(
                f"{name}_output.jsonl", "batch_output", _jsonl(ok), owner=batch.get("owner")))["id"]
        if errors:
            fields["error_file_id"] = (await self.files.create(
                f"{name}_errors.jsonl", "batch_output", _jsonl(errors), owner=batch.get("owner")))["id"]
        # Rows still unfinished at the completion window's end expired with their deadline.
        expired = any(r.get("error", {}) and r["error"].get("code") == "expired" for r in errors)
        final = "cancelled" if status == "cancelling" else "expired" if expired else "completed"
        try:
            ended = await self.store.move(self.batch_id, final, [status], self.token, **fields)
        except LockLost:
            ended = ""
        if ended != final:
            for file_id in fields.values():
                await self.files.delete(file_id)
            raise LockLost(self.batch_id)
        log.info("batch %s %s: %d ok, %d errors", self.batch_id, final, len(ok), len(errors))


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()
