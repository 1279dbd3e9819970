"""Webhooks as the api, the senders and the CLI agree on them: the event types, an event's
payload (OpenAI's shape: `{id, type, created_at, data: {id, ...}}`), signing secrets, and which
endpoint addresses a sender may connect to. docs/webhooks.md tells the whole story."""

from __future__ import annotations

import base64
import ipaddress
import json
import secrets
import socket
import time
from typing import Any
from urllib.parse import urlsplit

REQUEST_EVENTS = ("request.completed", "request.failed", "request.cancelled", "request.expired")
RESPONSE_EVENTS = ("response.completed", "response.failed", "response.cancelled", "response.incomplete")
BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")
EVENT_TYPES = REQUEST_EVENTS + RESPONSE_EVENTS + BATCH_EVENTS

# A final state (protocol/states.py, a batch's BatchState) as the word its event ends with.
_REQUEST_WORD = {"done": "completed", "failed": "failed", "cancelled": "cancelled", "expired": "expired"}
_RESPONSE_WORD = {**_REQUEST_WORD, "expired": "incomplete"}  # OpenAI's: a response cut short


def event_type(family: str, state: str) -> str:
    """`family`: request, response or batch; `state`: the final state the outbox entry names."""
    if family == "batch":
        return f"batch.{state}"
    words = _RESPONSE_WORD if family == "response" else _REQUEST_WORD
    return f"{family}.{words[state]}"


def payload(event_id: str, family: str, state: str, object_id: str, at: float,
            extra: dict[str, Any] | None = None) -> str:
    """The body posted: the object is named, not included (fetched with the usual GET)."""
    data = {"id": object_id, "object": family, "status": state, **(extra or {})}
    return json.dumps({"id": event_id, "type": event_type(family, state), "created_at": int(at),
                       "data": data}, separators=(",", ":"))


def new_secret() -> str:
    """A Standard Webhooks signing secret: `whsec_` and 24 random bytes, base64."""
    return "whsec_" + base64.b64encode(secrets.token_bytes(24)).decode()


class UnsafeUrl(ValueError):
    """An endpoint URL a sender must not post to (the message names why)."""


def _private(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast


def check_url(url: str) -> tuple[str, str, int]:
    """The URL's scheme, host and port, or UnsafeUrl: http(s) only, a host, no credentials."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise UnsafeUrl(f"webhook url must be http:// or https://, not {url[:100]!r}")
    if not parts.hostname:
        raise UnsafeUrl(f"webhook url has no host: {url[:100]!r}")
    if parts.username or parts.password:
        raise UnsafeUrl("webhook url must not carry credentials (sign with the endpoint's secret)")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as err:
        raise UnsafeUrl(f"webhook url has a bad port: {err}") from None
    return parts.scheme, parts.hostname, port


def resolve(host: str, port: int, *, allow_private: bool) -> str:
    """The one address a sender connects to (DNS is asked once, here: no rebinding between the
    check and the connection), or UnsafeUrl for a private, loopback or link-local one unless
    `allow_private` (SLUICE_WEBHOOKS_ALLOW_PRIVATE). Every address a name resolves to is checked."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        raise UnsafeUrl(f"webhook host {host!r} does not resolve: {err}") from None
    addresses = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    if not allow_private:
        bad = [str(a) for a in addresses if _private(a)]
        if bad:
            raise UnsafeUrl(f"webhook host {host!r} is a private, loopback or link-local address ({bad[0]}); "
                            "set SLUICE_WEBHOOKS_ALLOW_PRIVATE=1 to allow it")
    return str(addresses[0])


def check_literal(host: str, *, allow_private: bool) -> None:
    """At registration: a host written as an address is checked at once (a name is checked by the
    sender at every delivery, when it resolves)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if host.lower() == "localhost" or host.lower().endswith(".localhost"):
            ip = ipaddress.ip_address("127.0.0.1")
        else:
            return
    if not allow_private and _private(ip):
        raise UnsafeUrl(f"webhook host {host!r} is a private, loopback or link-local address; "
                        "set SLUICE_WEBHOOKS_ALLOW_PRIVATE=1 to allow it")


def probe_payload(event_id: str) -> str:
    """`sluice webhooks test`'s event: it names no request."""
    return json.dumps({"id": event_id, "type": "webhook.test", "created_at": int(time.time()), "data": {}},
                      separators=(",", ":"))
