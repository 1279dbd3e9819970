"""A webhook receiver on loopback for the tests (aiohttp, in the test's event loop): it records
every POST and can answer a chosen status to a chosen share of first attempts."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web
from standardwebhooks.webhooks import Webhook


@dataclass
class Received:
    headers: dict[str, str]
    body: str

    @property
    def event(self) -> dict:
        return json.loads(self.body)

    def verify(self, secret: str) -> dict:
        """The event, once `standardwebhooks` has checked its signature (raises otherwise)."""
        return Webhook(secret).verify(self.body, self.headers)


@dataclass
class Receiver:
    answer: Callable[[Received, bool], int] = lambda got, first: 200  # status for a POST (first: its id new)
    got: list[Received] = field(default_factory=list)
    url: str = ""
    delay_s: float = 0.0  # each answer comes this late
    in_flight: int = 0
    max_in_flight: int = 0
    _runner: web.AppRunner | None = None

    async def _handle(self, request: web.Request) -> web.Response:
        got = Received({k.lower(): v for k, v in request.headers.items()}, await request.text())
        first = all(r.headers.get("webhook-id") != got.headers.get("webhook-id") for r in self.got)
        self.got.append(got)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        status = self.answer(got, first)
        if status in (301, 302, 307, 308):
            return web.Response(status=status, headers={"Location": "http://127.0.0.1:9/elsewhere"})
        return web.Response(status=status)

    async def start(self, path: str = "/hooks") -> Receiver:
        app = web.Application()
        app.router.add_post(path, self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}{path}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def by_id(self) -> dict[str, list[Received]]:
        out: dict[str, list[Received]] = {}
        for r in self.got:
            out.setdefault(r.headers["webhook-id"], []).append(r)
        return out


def fails_share(share: float, seed: int = 7) -> Callable[[Received, bool], int]:
    """500 to a random `share` of first attempts, 200 to the rest and to every retry."""
    rng = random.Random(seed)
    return lambda got, first: 500 if first and rng.random() < share else 200
