"""The api's HTTP connections, bounded (README, "Security"): uvicorn's httptools protocol with

- a header timeout: a request's headers must all arrive within `api_header_timeout_s` of its
  first byte (a new connection's: of its opening), as nginx's `client_header_timeout`;
- a body timeout with a minimum rate (Apache's mod_reqtimeout `body=30,MinRate=1024`): a body
  must be in within `api_body_timeout_s` of its headers, plus one second for every
  `api_body_min_rate` bytes that arrived, so a stalled body closes after the timeout and a
  trickle cannot stretch it for ever (time while the app is not reading is not counted);
- a cap on open connections per api process (`api_max_connections`). At the cap, a new
  connection takes the place of the one that has waited longest for its request's headers
  (answered 408 and closed): slow or silent connections cannot lock out a client that sends
  its request at once, such as a health probe. Only when every connection is being served is
  the new one answered 503 and closed before anything of it is read, so the process keeps file
  descriptors for the connections it serves (uvicorn's `limit_concurrency` answers 503 but
  keeps them open);
- no draining for a caller without a valid key: its 401, given before the body was read,
  closes the connection, so the rest of that body is never read. Any other answer given before
  the body was read (a 413 to a keyed caller) lets the body arrive and discards it, under the
  body timeout, so the client, which sends its whole body before it reads, gets the answer
  instead of a reset (nginx's lingering close).

Slow clients otherwise hold a connection, and a file descriptor, for as long as they like:
partial headers, a header a byte at a time, a body at a few bytes a second. A plain ASGI
middleware cannot see a request before its headers are complete, hence a protocol.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import resource
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from sluice.api.auth import CLOSE_UNREAD
from sluice.config.settings import Settings

log = logging.getLogger(__name__)

_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n"
         b"content-length: 36\r\nretry-after: 1\r\nconnection: close\r\n\r\n"
         b"too many open connections; retry later")
_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
            b"content-length: 30\r\nconnection: close\r\n\r\nthe request was not sent in time")
_FD_RESERVE = 128  # descriptors the process needs besides its clients' (Redis, files, logs)


class GuardedHttp(HttpToolsProtocol):
    header_timeout_s: float = 20.0
    body_timeout_s: float = 30.0
    body_min_rate: int = 1024  # bytes a second that buy a body one more second
    max_connections: int = 2048

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer: asyncio.TimerHandle | None = None
        self._refused = False
        self._body_deadline = 0.0  # loop time by which the body must be in (moved on as bytes come)

    # The connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) - len(self._evicted()) >= self.max_connections and not self._evict_oldest():
            self._refused = True
            transport.write(_BUSY)
            transport.close()
            return
        super().connection_made(transport)
        self._arm(self.header_timeout_s, "headers")

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self._disarm()
        self._evicted().discard(self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._refused:
            super().data_received(data)

    # One request
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._timer is None:  # a request after another on a kept-alive connection
            self._arm(self.header_timeout_s, "headers")

    def on_headers_complete(self) -> None:
        self._disarm()
        super().on_headers_complete()
        self._body_deadline = self.loop.time() + self.body_timeout_s
        self._arm(self.body_timeout_s, "body")  # disarmed at once by a request without a body

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._timer is not None:
            self._body_deadline += len(body) / self.body_min_rate
            self._arm(self._body_deadline - self.loop.time(), "body")

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        cycle: RequestResponseCycle | None = self.cycle  # None between requests (uvicorn's type says never)
        if (not self.pipeline and cycle is not None and cycle.more_body and cycle.scope.get(CLOSE_UNREAD)
                and not self.transport.is_closing()):
            self._disarm()
            self.transport.close()  # refused before its body was read: the rest is never read
        super().on_response_complete()

    # Connections waiting for their headers, oldest first (per server); those evicted but not yet gone
    def _waiting(self) -> dict[GuardedHttp, None]:
        return self.server_state.__dict__.setdefault("sluice_waiting", {})

    def _evicted(self) -> set[GuardedHttp]:
        return self.server_state.__dict__.setdefault("sluice_evicted", set())

    def _evict_oldest(self) -> bool:
        waiting = self._waiting()
        while waiting:
            oldest = next(iter(waiting))
            del waiting[oldest]
            if not oldest.transport.is_closing():
                oldest._disarm()
                oldest.transport.write(_TIMEOUT)
                oldest.transport.close()  # its connection_lost comes later: counted apart till then
                self._evicted().add(oldest)
                self.logger.info("closing a connection from %s: at the connection cap, it had waited longest "
                                 "for its request's headers", oldest.client)
                return True
        return False

    # The timer
    def _arm(self, delay: float, what: str) -> None:
        self._disarm()
        self._timer = self.loop.call_later(delay, self._expired, what)
        if what == "headers":
            waiting = self._waiting()
            waiting.pop(self, None)
            waiting[self] = None  # the newest

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._waiting().pop(self, None)

    def _expired(self, what: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if what == "body" and self.flow.read_paused:  # the app is not reading: not the client's delay
            self._body_deadline = self.loop.time() + self.body_timeout_s
            self._arm(self.body_timeout_s, what)
            return
        cycle: RequestResponseCycle | None = self.cycle  # None between requests (uvicorn's type says never)
        answered = (cycle is not None and cycle.response_started
                    and not (what == "headers" and cycle.response_complete))
        if not answered:
            self.transport.write(_TIMEOUT)
        waited_s = self.header_timeout_s if what == "headers" else self.body_timeout_s
        self.logger.info("closing a connection from %s: its request's %s did not arrive within %g s",
                         self.client, what, waited_s)
        self.transport.close()


def guarded(settings: Settings) -> type[GuardedHttp]:
    """The protocol class with `settings`' limits."""
    return type("GuardedHttp", (GuardedHttp,), {
        "header_timeout_s": settings.api_header_timeout_s,
        "body_timeout_s": settings.api_body_timeout_s,
        "body_min_rate": settings.api_body_min_rate,
        "max_connections": settings.api_max_connections,
    })


class FromEnvironment(GuardedHttp):
    """The protocol of `sluice api --workers N`'s processes, which uvicorn starts by import path:
    the limits from SLUICE_*, read once per process."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        limits = _environment_limits()
        self.header_timeout_s, self.body_timeout_s, self.body_min_rate, self.max_connections = limits
        super().__init__(*args, **kwargs)


@functools.cache
def _environment_limits() -> tuple[float, float, int, int]:
    s = Settings()
    return (s.api_header_timeout_s, s.api_body_timeout_s, s.api_body_min_rate,
            raise_fd_limit(s.api_max_connections))


def raise_fd_limit(max_connections: int) -> int:
    """Raise this process's open-file limit towards its hard limit so that `max_connections`
    can be reached; returns the connections it allows (fewer, with a warning, when the hard
    limit is too low: then a flood is refused with 503 before the process runs out of descriptors)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + _FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < wanted:
        soft = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft != resource.RLIM_INFINITY and soft < wanted:
        allowed = max(soft - _FD_RESERVE, 1)
        log.warning("open-file limit %d: the api holds at most %d connections, not "
                    "SLUICE_API_MAX_CONNECTIONS=%d (raise the limit, e.g. ulimit -n)", soft, allowed,
                    max_connections)
        return allowed
    return max_connections
