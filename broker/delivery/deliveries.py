"""A fetched stream entry as the worker holds it, what its attempt sent (kept for a resend), and
the entries a group read answers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from redis.typing import XReadGroupResponse

from sluice.broker.delivery.quarantine import SUSPECT_ATTEMPT
from sluice.broker.plumbing import Fields, streams_read
from sluice.protocol.messages import RequestMessage

StartDecision = Literal["run", "final", "duplicate", "cancelled", "expired", "fenced"]
Read = tuple[str, Fields | None]  # an entry read from a group (None: deleted since it was delivered)


def entries_read(reply: XReadGroupResponse | None) -> list[Read]:
    """The entries an XREADGROUP of one stream read."""
    read = streams_read(reply)
    return list(read[0][1]) if read else []


@dataclass
class Sent:
    """One attempt's deltas as the engine gave them, per row by index, kept for a resend: the
    stream always ends where one of them ended (a write joins whole deltas), so a resend can
    start at any index the stream ends at."""

    rows: dict[int, dict[int, tuple]] = field(default_factory=dict)  # row -> index -> _kept(event)
    ttl_set: bool = False  # the reply stream's TTL (set by the attempt's first write)
    # reply.lua's last answer for it: when its call was sent (time.monotonic) and its cancel mark
    heard_at: float = float("-inf")
    cancel: bool = False


@dataclass
class Delivery:
    """One fetched stream entry, held (and leased) by `consumer` from its fetch to its commit."""

    stream: str
    entry_id: str
    message: RequestMessage
    consumer: str
    attempt: int = 1
    group: int = 0  # a suspect's quarantine group: its cap while parked, its size once handed out
    fence: str = ""  # the fencing token its start took (start.lua); its writes carry it
    sent: Sent = field(default_factory=Sent, compare=False)  # this attempt's deltas, kept for a resend

    @property
    def rows(self) -> int:
        return len(self.message.rows)

    @property
    def quarantined(self) -> bool:
        """Redelivered again after a retry that ran together crashed too: a suspect, run in a
        quarantine group (broker/delivery/quarantine.py)."""
        return self.attempt >= SUSPECT_ATTEMPT

    @property
    def key(self) -> tuple[str, str]:
        return self.stream, self.entry_id
