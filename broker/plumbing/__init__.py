"""Redis plumbing: the clients and how they write a command, blocking readers, what a URL names,
the one loader of the Lua scripts (and their typed calls), and pages of a listing."""

from sluice.broker.plumbing.connection import (
    connect,
    copied,
    has_replicas,
    is_cluster,
    read_copied,
    wait_for_copies,
)
from sluice.broker.plumbing.pages import newest_first
from sluice.broker.plumbing.readers import Readers
from sluice.broker.plumbing.scripts import (
    Counted,
    Key,
    KeyList,
    PipelinedCalls,
    ScriptCall,
    Scripts,
    Spread,
    register_script,
)

__all__ = ["Counted", "Key", "KeyList", "PipelinedCalls", "Readers", "ScriptCall", "Scripts", "Spread",
           "connect", "copied", "has_replicas", "is_cluster", "newest_first", "read_copied",
           "register_script", "wait_for_copies"]
