"""One bulk job: read an OpenAI batch input file, feed its lines onto the model's bulk stream
with a bounded number outstanding, gather the results, and write the output and error files.

Everything a job needs to resume is in Redis (which line became which request, the output
records so far), so a restarted job re-runs nothing that finished and re-submits nothing
that is still queued. One run at a time holds the job's lock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError
from redis.asyncio import Redis

from sluice.broker.admission import Admission, QueueFull
from sluice.broker.batches import TERMINAL, BatchStore
from sluice.broker.files import FileStore
from sluice.broker.keys import ModelKeys
from sluice.broker.messages import FinalResult, RequestMessage, SamplingSpec
from sluice.broker.openai import ChatCompletionRequest, CompletionRequest, chat_object, completion_object
from sluice.broker.registry import ModelRegistry
from sluice.config.settings import Settings

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
        self.store = BatchStore(redis)
        self.files = FileStore(redis, settings.files_path, settings.max_file_bytes)
        self.admission = Admission(redis, status_ttl_s=settings.status_ttl_s, reply_ttl_s=settings.reply_ttl_s,
                                   cancel_ttl_s=settings.cancel_ttl_s)
        self.models = ModelRegistry(redis)
        self.token = uuid.uuid4().hex

    async def run(self) -> None:
        """Wait for the job's lock (another run may hold it), then run the job to its end."""
        while not await self.store.lock(self.batch_id, self.token, self.settings.job_lock_ttl_s):
            batch = await self.store.get(self.batch_id)
            if batch is None or batch["status"] in TERMINAL:
                return
            await asyncio.sleep(1.0)
        keeper = asyncio.create_task(self._keep_lock())
        try:
            await self._run_locked()
        except Exception as err:
            log.exception("batch %s failed", self.batch_id)
            await self.store.update(self.batch_id, status="failed", error=f"{type(err).__name__}: {err}")
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            await self.store.unlock(self.batch_id, self.token)

    async def _keep_lock(self) -> None:
        while True:
            await asyncio.sleep(self.settings.job_lock_ttl_s / 3)
            if not await self.store.refresh_lock(self.batch_id, self.token, self.settings.job_lock_ttl_s):
                log.error("batch %s: lost its lock", self.batch_id)

    async def _run_locked(self) -> None:
        batch = await self.store.get(self.batch_id)
        if batch is None or batch["status"] in TERMINAL:
            return
        text = (await self.files.content(batch["input_file_id"])).decode("utf-8", errors="replace")
        raw_lines = [(i, t) for i, t in enumerate(text.splitlines()) if t.strip()]
        lines: list[Line] = []
        for i, t in raw_lines:
            parsed = parse_line(i, t, batch["endpoint"])
            if isinstance(parsed, Line):
                lines.append(parsed)
            elif await self.store.record(self.batch_id, i, parsed):
                await self.store.count(self.batch_id, "failed")
        if batch["status"] == "validating":
            await self.store.update(self.batch_id, status="in_progress", total=len(raw_lines))
        deployed = {m.name: m for m in await self.models.all()}
        for line in [x for x in lines if x.model not in deployed]:
            if await self.store.record(self.batch_id, line.index, _error_record(
                    line.custom_id, "model_not_found", f"model {line.model!r} is not deployed")):
                await self.store.count(self.batch_id, "failed")
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
            current = await self.store.get(self.batch_id)
            if current and current["status"] == "cancelling" and not cancelling:
                cancelling = True
                for line, rid in outstanding.values():
                    await self.admission.cancel(line.model, rid)
            while queue and not cancelling and len(outstanding) < self.settings.bulk_outstanding:
                line = queue[0]
                rid = bound.get(line.index) or f"req-{uuid.uuid4().hex}"
                await self.store.bind(self.batch_id, line.index, rid)
                try:
                    await self._submit(batch, line, rid)
                except QueueFull:
                    break  # the bulk lane is full: wait for results to make room
                queue.pop(0)
                outstanding[line.index] = (line, rid)
            await self._collect(outstanding)
            await asyncio.sleep(self.poll_s)

    async def _submit(self, batch: dict[str, Any], line: Line, rid: str) -> None:
        now = time.time()
        message = RequestMessage(id=rid, model=line.model, rows=[line.row], sampling=line.sampling,
                                 enqueued_at=now, deadline=float(batch["expires_at"]), lane="bulk")
        await self.admission.submit(message, max_queued=self.settings.max_queued)

    async def _collect(self, outstanding: dict[int, tuple[Line, str]]) -> None:
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
            if final.status.value == "cancelled":
                continue  # a cancelled batch's output holds what finished
            if final.status.value == "done":
                build = completion_object if "prompt" in line.row else chat_object
                body = build(f"cmpl-{rid.removeprefix('req-')}", line.model, int(final.timings.finished or 0),
                             [final])
                record = {"id": f"batch_req_{rid.removeprefix('req-')}", "custom_id": line.custom_id,
                          "response": {"status_code": 200, "request_id": rid, "body": body}, "error": None}
                if await self.store.record(self.batch_id, index, record):
                    await self.store.count(self.batch_id, "completed")
                    await self.store.count(self.batch_id, "output_tokens", body["usage"]["completion_tokens"])
            elif await self.store.record(self.batch_id, index, _error_record(
                    line.custom_id, final.status.value, final.error or final.status.value, rid)):
                await self.store.count(self.batch_id, "failed")

    async def _finish(self, batch: dict[str, Any]) -> None:
        current = await self.store.get(self.batch_id)
        cancelled = current is not None and current["status"] == "cancelling"
        if not cancelled:
            await self.store.update(self.batch_id, status="finalizing")
        records = await self.store.outputs(self.batch_id)
        ok = [records[i] for i in sorted(records) if records[i]["response"] is not None]
        errors = [records[i] for i in sorted(records) if records[i]["response"] is None]
        fields: dict[str, Any] = {}
        name = batch["input_file_id"]
        if ok:
            fields["output_file_id"] = (await self.files.create(
                f"{name}_output.jsonl", "batch_output", _jsonl(ok)))["id"]
        if errors:
            fields["error_file_id"] = (await self.files.create(
                f"{name}_errors.jsonl", "batch_output", _jsonl(errors)))["id"]
        # Rows still unfinished at the completion window's end expired with their deadline.
        expired = any(r.get("error", {}) and r["error"].get("code") == "expired" for r in errors)
        status = "cancelled" if cancelled else "expired" if expired else "completed"
        await self.store.update(self.batch_id, status=status, **fields)
        log.info("batch %s %s: %d ok, %d errors", self.batch_id, status, len(ok), len(errors))


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()
