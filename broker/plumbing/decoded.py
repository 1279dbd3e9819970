"""Replies as the clients of connect() give them: text. Their connections decode every reply
(`decode_responses`) and speak RESP2, which redis-py's types cannot follow: to them a reply is
`bytes | str`, and XREAD's may be RESP3's map. What a reply is, is said here once, instead of at
each read (no copy: some are hot paths)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import cast

from redis.typing import StreamRangeResponse, XReadGroupResponse, XReadResponse, ZSetRangeResponse

Fields = dict[str, str]  # a hash, or a stream entry's fields
Entry = tuple[str, Fields]  # a stream entry: its id and its fields
StreamEntries = list[tuple[str, list[Entry]]]  # per stream read: its key and its entries


def text(reply: bytes | str) -> str:
    """A string reply."""
    return cast(str, reply)


def maybe_text(reply: bytes | str | None) -> str | None:
    """A string reply, or nil."""
    return cast("str | None", reply)


def texts(reply: Sequence[bytes | str]) -> list[str]:
    """An array of strings (the fields of a hash, the members of a set, ...)."""
    return cast(list[str], reply)


def members(reply: ZSetRangeResponse) -> list[str]:
    """A range of a sorted set, asked for without scores."""
    return cast(list[str], reply)


def scored_members(reply: ZSetRangeResponse) -> list[tuple[str, float]]:
    """A range of a sorted set with its scores (WITHSCORES: redis-py makes each a float)."""
    return cast(list[tuple[str, float]], reply)


def hash_of(reply: Mapping[bytes | str, bytes | str]) -> Fields:
    """A hash (HGETALL)."""
    return cast(Fields, reply)


def stream_entries(reply: StreamRangeResponse | None) -> list[Entry]:
    """A stream's entries (XRANGE, XREVRANGE)."""
    return cast(list[Entry], reply or [])


def streams_read(reply: XReadResponse | XReadGroupResponse | None) -> StreamEntries:
    """What XREAD or XREADGROUP read: per stream, its key and its entries ([] when a block ran
    out with nothing)."""
    return cast(StreamEntries, reply or [])
