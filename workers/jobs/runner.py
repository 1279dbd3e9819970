"""One bulk job: read an OpenAI batch input file, feed its lines onto the model's bulk stream
with a bounded number outstanding, gather the results, and write the output and error files.

Everything a job needs to resume is in Redis (which line became which request, the output
records so far), so a restarted job re-runs nothing that finished and re-submits nothing
that is still queued. One run at a time holds the job's lock (workers/jobs/lock.py); a run that
loses it stops, and every write it makes is fenced by the lock in Redis (broker/jobs/store.py).
Parsing lines and building output lines is pure code (workers/jobs/lines.py); feeding and
collecting is workers/jobs/feed.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import tempfile
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from redis.asyncio import Redis

from sluice.broker.intake.admission import Admission
from sluice.broker.intake.cancels import Cancels
from sluice.broker.intake.status_reads import StatusReads
from sluice.broker.jobs.files import FileStore, read_lines
from sluice.broker.jobs.store import JobStore, LockLost
from sluice.broker.limits import AdmissionLimits
from sluice.broker.registry import ModelRegistry
from sluice.broker.replies.notifications import DoneListener
from sluice.config.settings import Settings
from sluice.protocol.states import ACTIVE_BATCH_STATES, FINAL_BATCH_STATES, BatchState
from sluice.protocol.tokens import PromptLimits
from sluice.workers.jobs.feed import FeedLimits, LineFeed
from sluice.workers.jobs.lines import Line, LineCheck, Record, Rules, jsonl
from sluice.workers.jobs.lock import JobLock

log = logging.getLogger(__name__)

# The lines checked at once, off the event loop: at most this many, or the first past this size.
_CHUNK_LINES = 256
_CHUNK_BYTES = 4 * 1024 * 1024
# The models' tokenizers, read once a process (for each cache folder), not once a job.
_PROMPT_LIMITS: dict[Path, PromptLimits] = {}


def _checked_chunk(lines: Iterator[tuple[int, bytes | None]],
                   check: LineCheck) -> list[tuple[int, Line | Record]]:
    """The file's next lines, checked (an empty list at its end)."""
    out: list[tuple[int, Line | Record]] = []
    size = 0
    for index, raw in lines:
        out.append((index, check(index, raw)))
        size += len(raw or b"")
        if len(out) >= _CHUNK_LINES or size >= _CHUNK_BYTES:
            break
    return out


class JobRunner:
    def __init__(self, settings: Settings, redis: Redis, job_id: str, *, poll_s: float = 1.0):
        """`poll_s`: how often outstanding lines are re-read when no final is announced."""
        self.settings = settings
        self.redis = redis
        self.job_id = job_id
        self.store = JobStore(redis, settings.batch_ttl_s, settings.result_ttl_s)
        self.files = FileStore(redis, settings.files_path, settings.max_file_bytes, settings.file_ttl_s)
        # A line's admission waits for neither the disk nor replicas (SLUICE_DURABILITY and
        # SLUICE_REDIS_WAIT_REPLICAS are the api's).
        limits = AdmissionLimits.of(settings, strict=False, wait_replicas=0)
        self.admission = Admission(redis, limits)
        self.cancels, self.statuses = Cancels(redis, limits), StatusReads(redis, limits)
        self.models = ModelRegistry(redis)
        self.done = DoneListener(redis, recheck_s=poll_s)
        self.lock = JobLock(self.store, job_id, settings.job_lock_ttl_s)

    @property
    def token(self) -> str:
        return self.lock.token

    async def run(self) -> None:
        """Take the job's lock and run the job to its end.

        Returns at once when the job is final or a live runner has it (that runner finishes
        it), and stops as soon as the lock is lost: whoever holds it then owns the job, and
        this run writes nothing more (every write is fenced by the lock in Redis as well).
        """
        rules = await self._rules()
        if not await self.lock.acquire():
            return
        self.done.start()
        try:
            await self._run_locked(rules)
        except LockLost:
            log.warning("batch %s: lost its lock, stopped; another runner has the job", self.job_id)
        except Exception as err:
            log.exception("batch %s failed", self.job_id)
            with contextlib.suppress(LockLost):
                await self.store.move(self.job_id, BatchState.FAILED, ACTIVE_BATCH_STATES, self.token,
                                      error=f"{type(err).__name__}: {err}")
        finally:
            await self.done.close()
            await self.lock.release()

    async def _record(self, index: int, record: Record, **counts: int) -> None:
        await self.store.record(self.job_id, self.token, index, record, counts)

    async def _rules(self) -> Rules:
        """What every line is checked against, read before the job's lock is taken: reading a
        model's tokenizer holds the GIL (1.2 s for the default model's on a loaded machine),
        which would stall the keeper of a lock already held (a 2 s lock was lost to it)."""
        models = {m.name: m for m in await self.models.all()}
        limits = _PROMPT_LIMITS.setdefault(self.settings.cache_dir, PromptLimits(self.settings.cache_dir))
        await asyncio.to_thread(lambda: [limits.loaded(m) for m in models.values()])
        return Rules(models, self.settings.max_prompt_chars, limits)

    async def _run_locked(self, rules: Rules) -> None:
        batch = await self.store.get(self.job_id)
        if batch is None or batch["status"] in FINAL_BATCH_STATES:
            return
        # Its rows and output files belong to whoever made the batch (the object does not show it).
        batch["owner"] = await self.store.owner(self.job_id)
        batch["tenant"] = await self.store.tenant(self.job_id)  # (each row is its tenant's request)
        with await self.files.open(batch["input_file_id"]) as source:
            total = await self._validate(source, batch["endpoint"], rules)
            if total is None:
                await self.store.move(self.job_id, BatchState.FAILED, ACTIVE_BATCH_STATES, self.token,
                                      error=f"input file: more than {self.settings.max_batch_lines} requests "
                                            "(SLUICE_MAX_BATCH_LINES)")
                return
            status = await self.store.move(self.job_id, BatchState.IN_PROGRESS, [BatchState.VALIDATING],
                                           self.token, total=total)
            if status in FINAL_BATCH_STATES:  # cancelled before any runner started it
                return
            feed = LineFeed(store=self.store, admission=self.admission, cancels=self.cancels,
                            statuses=self.statuses, done=self.done, job_id=self.job_id, batch=batch,
                            token=self.token, record=self._record, check_lock=self.lock.check,
                            limits=FeedLimits.of(self.settings))
            async with contextlib.aclosing(self._lines(source, batch["endpoint"], rules)) as lines:
                await feed.run(lines)
        await self._finish(batch)

    def _check(self, endpoint: str, rules: Rules) -> LineCheck:
        """Each line passes the checks of the route it names, against the models deployed now."""
        return LineCheck(endpoint, max_line_bytes=self.settings.max_batch_line_bytes, rules=rules)

    async def _checked(self, source: BinaryIO,
                       check: LineCheck) -> AsyncGenerator[list[tuple[int, Line | Record]], None]:
        """The input file's lines from its start, checked a chunk at a time in a thread: memory
        holds one chunk, and the event loop stays free to keep the job's lock."""
        await asyncio.to_thread(source.seek, 0)
        lines = read_lines(source, self.settings.max_batch_line_bytes)
        while chunk := await asyncio.to_thread(_checked_chunk, lines, check):
            self.lock.check()
            yield chunk

    async def _validate(self, source: BinaryIO, endpoint: str, rules: Rules) -> int | None:
        """Record every line that cannot run; the number of requests in the file, or None when
        it has more than the limit (reading stops there)."""
        check = self._check(endpoint, rules)
        async for chunk in self._checked(source, check):
            if check.total > self.settings.max_batch_lines:
                return None
            for index, parsed in chunk:
                if not isinstance(parsed, Line):
                    await self._record(index, parsed, failed=1)
        return check.total

    async def _lines(self, source: BinaryIO, endpoint: str, rules: Rules) -> AsyncGenerator[Line, None]:
        """The valid lines, read again as the feed needs them (those recorded as errors are
        skipped by the feed, as every line with a record is)."""
        async for chunk in self._checked(source, self._check(endpoint, rules)):
            for _, parsed in chunk:
                if isinstance(parsed, Line):
                    yield parsed

    async def _finish(self, batch: dict[str, Any]) -> None:
        """Write the output and error files and end the batch: `completed` (or `expired`), or
        `cancelled` when a cancel landed before the runner moved it to `finalizing`."""
        status = await self.store.move(self.job_id, BatchState.FINALIZING, [BatchState.IN_PROGRESS],
                                       self.token)
        if status not in (BatchState.FINALIZING, BatchState.CANCELLING):
            log.error("batch %s: cannot finish from status %r", self.job_id, status)
            return
        with tempfile.TemporaryFile() as ok, tempfile.TemporaryFile() as errors:
            counts, expired = await self._spool(ok, errors)
            # Files are the one write a Lua script cannot fence: look first, and take them back
            # if the lock turns out lost when the batch is moved to its end.
            self.lock.check()
            if not await self.store.holds_lock(self.job_id, self.token):
                raise LockLost(self.job_id)
            fields: dict[str, Any] = {}
            name = batch["input_file_id"]
            for field, suffix, spooled, n in (("output_file_id", "output", ok, counts[0]),
                                              ("error_file_id", "errors", errors, counts[1])):
                if n:
                    await asyncio.to_thread(spooled.seek, 0)
                    fields[field] = (await self.files.create_from(
                        f"{name}_{suffix}.jsonl", "batch_output", spooled, owner=batch.get("owner"),
                        tenant=batch.get("tenant")))["id"]
        final = (BatchState.CANCELLED if status == BatchState.CANCELLING
                 else BatchState.EXPIRED if expired else BatchState.COMPLETED)
        try:
            ended = await self.store.move(self.job_id, final, [status], self.token, **fields)
        except LockLost:
            ended = ""
        if ended != final:
            for file_id in fields.values():
                await self.files.delete(file_id)
            raise LockLost(self.job_id)
        log.info("batch %s %s: %d ok, %d errors", self.job_id, final.value, *counts)

    async def _spool(self, ok: BinaryIO, errors: BinaryIO) -> tuple[tuple[int, int], bool]:
        """Write the output and error records, in input order, a chunk of them at a time (never
        all in memory); their counts, and whether a row expired (it was still unfinished at the
        completion window's end)."""
        lines = sorted(await self.store.recorded(self.job_id))
        counts, expired = [0, 0], False
        for start in range(0, len(lines), _CHUNK_LINES):
            records = await self.store.records(self.job_id, lines[start:start + _CHUNK_LINES])
            good = [r for r in records if r["response"] is not None]
            bad = [r for r in records if r["response"] is None]
            expired = expired or any((r.get("error") or {}).get("code") == "expired" for r in bad)
            counts[0], counts[1] = counts[0] + len(good), counts[1] + len(bad)
            await asyncio.to_thread(ok.write, jsonl(good))
            await asyncio.to_thread(errors.write, jsonl(bad))
        return (counts[0], counts[1]), expired
