"""The readers of `sluice bench chaos`'s load (bench/chaos_load.py): SSE readers of a request's
events, Responses streams of a background response, long polls. Each follows its request to its
final through either api, resuming where it broke off; what each saw goes to the audit
(bench/chaos_audit.py)."""
from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import AsyncIterator

import httpx

from sluice.bench.chaos_audit import FINAL_STATES, Reader, Tracked, final_texts
from sluice.bench.sse import sse_events
from sluice.protocol.openai_responses import response_id

# A Responses stream's terminal events, and the request state each stands for ("incomplete" is
# done at max_output_tokens; "failed" stands for expired too).
RESPONSE_ENDS = {"response.completed": "done", "response.incomplete": "done", "response.failed": "failed",
                 "response.cancelled": "cancelled"}


class Readers:
    """The load's readers (a base of bench/chaos_load.py's Load, which sets these)."""

    urls: list[str]
    rng: random.Random
    hangups: float
    late_readers: float
    follow_until: float = math.inf  # (monotonic) readers give up after it

    async def _readers(self, http: httpx.AsyncClient, t: Tracked, api: int) -> None:
        """The reader from the start and, for a share of requests, one joining mid-stream."""
        first = Reader("first")
        t.readers.append(first)
        tasks = [self._stream(http, t, first, api, hang_up=t.every_reader)]
        if t.every_reader or self.rng.random() < self.late_readers:
            # A structured request's second reader is a Responses stream of its background response.
            late = Reader("responses" if t.kind == "structured" else "late")
            t.readers.append(late)
            tasks.append(self._stream(http, t, late, api + 1, join_after=self.rng.uniform(0.05, 1.5)))
        await asyncio.gather(*tasks)

    async def _stream(self, http: httpx.AsyncClient, t: Tracked, rd: Reader, api: int,
                      join_after: float = 0.0, hang_up: bool = False) -> None:
        """Follow the SSE stream to its final; a share of the readers also hang up once after a
        few deltas (as a browser or a phone changing networks does) and resume: /events with
        Last-Event-ID, a Responses stream (reader "responses") with starting_after."""
        await asyncio.sleep(join_after)
        last: str | None = None  # the last event's id (sequence number for a Responses stream)
        text = ""  # a Responses stream's whole text (response.output_text.done)
        drop_after = self.rng.randint(1, 6) if hang_up or self.rng.random() < self.hangups else None
        while time.monotonic() < self.follow_until:
            url = self.urls[(api + rd.reconnects) % len(self.urls)]
            if rd.name == "responses":
                path, headers = f"/v1/responses/{response_id(t.rid)}", {}
                params = {"stream": "true", **({"starting_after": last} if last else {})}
            else:
                path, params = f"/v1/requests/{t.rid}/events", {}
                headers = {"Last-Event-ID": last} if last else {}
            try:
                async with http.stream("GET", f"{url}{path}", headers=headers, params=params) as r:
                    async for name, cursor, data in _sse(r):
                        last = cursor or last
                        if name in ("delta", "response.output_text.delta"):
                            if name == "delta":
                                rd.deltas.append((data.get("row", 0), data["index"], data["text"]))
                            else:
                                rd.deltas.append((0, data["sequence_number"], data["delta"]))
                            if drop_after is not None and len(rd.deltas) >= drop_after:
                                drop_after, rd.dropped = None, True
                                break
                        elif name == "response.output_text.done":
                            text = data["text"]
                        elif name in ("done", "error"):
                            rd.final = data
                            return
                        elif name in RESPONSE_ENDS:  # as a RequestView: a text only when completed
                            state = RESPONSE_ENDS[name]
                            output = {"output": {"text": text}} if state == "done" else {}
                            rd.final = {"status": state, **output}
                            return
            except httpx.TransportError:
                pass
            rd.reconnects += 1  # the stream broke or ended without a final: resume from the last event
            await asyncio.sleep(0.2)

    async def _poll(self, http: httpx.AsyncClient, t: Tracked, api: int) -> None:
        reconnects = 0
        while time.monotonic() < self.follow_until:
            url = self.urls[(api + reconnects) % len(self.urls)]
            try:
                r = await http.get(f"{url}/v1/requests/{t.rid}", params={"wait": 5}, timeout=15)
                if r.status_code == 200 and r.json()["status"] in FINAL_STATES:
                    t.answer = final_texts(r.json())
                    return
                if r.status_code == 200:
                    continue
            except httpx.TransportError:
                pass
            reconnects += 1
            await asyncio.sleep(0.2)


async def _sse(r: httpx.Response) -> AsyncIterator[tuple[str, str | None, dict]]:
    """(event name, its id or Responses sequence number, its data) per server-sent event."""
    if r.status_code != 200:
        return
    async for ev in sse_events(r):
        data = ev.json()
        seq = data.get("sequence_number") if isinstance(data, dict) else None
        yield ev.event, ev.id or (str(seq) if seq is not None else None), data
