"""Redis plumbing: the clients and how they write a command, blocking readers, what a URL names,
the one loader of the Lua scripts (and their typed calls), replies as the clients decode them,
and pages of a listing."""

from sluice.broker.plumbing.connection import (
    connect,
    copied,
    has_replicas,
    is_cluster,
    read_copied,
    wait_for_copies,
)
from sluice.broker.plumbing.decoded import (
    Entry,
    Fields,
    StreamEntries,
    hash_of,
    maybe_text,
    members,
    scored_members,
    stream_entries,
    streams_read,
    text,
    texts,
)
from sluice.broker.plumbing.pages import newest_first
from sluice.broker.plumbing.readers import Readers
from sluice.broker.plumbing.scripts import (
    CallPart,
    Counted,
    Key,
    KeyList,
    Parts,
    PipelinedCalls,
    ScriptCall,
    Scripts,
    Spread,
)

__all__ = ["CallPart", "Counted", "Entry", "Fields", "Key", "KeyList", "Parts", "PipelinedCalls", "Readers",
           "ScriptCall", "Scripts", "Spread", "StreamEntries", "connect", "copied", "has_replicas", "hash_of",
           "is_cluster", "maybe_text", "members", "newest_first", "read_copied",
           "scored_members", "stream_entries", "streams_read", "text", "texts", "wait_for_copies"]
