"""Key names live in one place, broker/keys.py: a Lua script builds a key it is not handed from the
suffixes the prelude gives it (`SUFFIX`, from keys.Suffix), never from a literal of its own, and
each is the suffix the Python side builds that key with. The layout itself is pinned below: a
change to it is a change of the protocol (docs/protocol.md's Keys table)."""

from __future__ import annotations

import re
from pathlib import Path

from sluice.broker import keys
from sluice.broker.keys import ModelKeys, Suffix
from sluice.broker.plumbing.scripts import prelude
from sluice.broker.webhooks.outbox import batch_outbox, outbox

ROOT = Path(__file__).resolve().parents[2]
LUA = sorted((ROOT / "broker" / "lua").glob("*.lua"))
DOC = ROOT / "docs" / "protocol.md"

K = ModelKeys("m")
TAG = "sluice:{m:m}"
RID = "req-1"  # an id of no shard: its keys are shard 0's, under TAG
BATCH_LOCK = "{sluice:batch:batch_1}:lock"  # broker/jobs/store.py's lock of batch `batch_1`

# Per suffix, as the prelude names it for Lua: the key the Python side builds, what follows the
# suffix in it, and that key as it must stay.
LAYOUT: dict[str, tuple[str, str, str]] = {
    "requests": (K.requests, "", f"{TAG}:req"),
    "bulk": (K.bulk, "", f"{TAG}:bulk"),
    "dead_letters": (K.dead_letters, "", f"{TAG}:dlq"),
    "log": (K.log, "", f"{TAG}:log"),
    "done": (K.done, "", f"{TAG}:done"),
    "reply": (K.reply(RID), RID, f"{TAG}:reply:{RID}"),
    "status": (K.status(RID), RID, f"{TAG}:status:{RID}"),
    "response": (K.response(RID), RID, f"{TAG}:resp:{RID}"),
    "admitted": (K.admitted(RID), RID, f"{TAG}:admitted:{RID}"),
    "cancel": (K.cancel(RID), RID, f"{TAG}:cancel:{RID}"),
    "charge": (K.charge(RID), RID, f"{TAG}:charge:{RID}"),
    "quota": (K.quota("t", "tokens"), "t:tokens", f"{TAG}:quota:t:tokens"),
    "sweep_lock": (K.sweep_lock, "", f"{TAG}:sweeping"),
    "consumer_lock": (K.consumer_lock("w"), "w", f"{TAG}:consumer:w"),
    "outbox": (K.outbox, "", f"{TAG}:outbox"),
    "held": (K.held, "", f"{TAG}:held"),
    "backlog": (keys.backlog(K.requests), "req", f"{TAG}:backlog:req"),
    "counters": (keys.counters(K.bulk), "bulk", f"{TAG}:vtc:bulk"),
    "staged": (keys.staged(K.requests, "t"), "req:t", f"{TAG}:staged:req:t"),
    "affinity_slots": (K.affinity_slots, "", f"{TAG}:aff:slots"),
    "affinity_owners": (K.affinity_owners, "", f"{TAG}:aff:owners"),
    "affinity_groups": (K.affinity_groups, "", f"{TAG}:aff:groups"),
    "affinity_sizes": (K.affinity_sizes, "", f"{TAG}:aff:sizes"),
    "affinity_wake": (K.affinity_wake, "", f"{TAG}:aff:wake"),
    "affinity_lock": (K.affinity_lock, "", f"{TAG}:aff:lock"),
    "batch_lock": (BATCH_LOCK, "", BATCH_LOCK),
}


def lua_suffixes() -> dict[str, str]:
    """The prelude's `local SUFFIX = {name = ':suffix', ...}`."""
    (line,) = [line for line in prelude().splitlines() if line.startswith("local SUFFIX = {")]
    return dict(re.findall(r"(\w+) = '([^']*)'", line.split("--")[0]))


def lua_literals(path: Path) -> list[str]:
    """The string literals of a script, its comments left out."""
    src = re.sub(r"--[^\n]*", "", path.read_text())
    return [a or b for a, b in re.findall(r"'([^'\n]*)'|\"([^\"\n]*)\"", src)]


def test_the_prelude_gives_lua_every_suffix_of_keys_py() -> None:
    assert lua_suffixes() == {s.name.lower(): s.value for s in Suffix}
    assert len(Suffix.__members__) == len(Suffix), "two suffixes spelled alike (an enum alias)"
    for suffix in Suffix:  # safe in a Lua pattern (_lib.lua matches `^(.*)` .. SUFFIX.status)
        assert re.fullmatch(r":[a-z_:]+", suffix), suffix


def test_no_script_spells_a_key_suffix_itself() -> None:
    assert "HSET" in {literal for path in LUA for literal in lua_literals(path)}  # the parser reads them
    for path in LUA:
        src = re.sub(r"--[^\n]*", "", path.read_text())
        built = re.findall(r"\.\.\s*(['\"]:[a-z][^'\"]*['\"])", src)
        assert not built, f"{path.name} builds a key with a literal suffix (put it in keys.Suffix): {built}"
        for literal in lua_literals(path):
            spelled = [s.value for s in Suffix if re.search(re.escape(s.value) + r"(?![a-z_])", literal)]
            assert not spelled, f"{path.name} spells {spelled} in {literal!r}: use SUFFIX.<name>"


def test_python_builds_each_key_with_the_suffix_lua_is_given() -> None:
    lua = lua_suffixes()
    assert set(LAYOUT) == set(lua), "a suffix of keys.Suffix this test does not pin"
    for name, (built, tail, pinned) in LAYOUT.items():
        assert built == pinned, f"the key layout changed: {built!r} (was {pinned!r})"
        tag = TAG if name != "batch_lock" else "{sluice:batch:batch_1}"
        assert built == tag + lua[name] + tail, name
    # the module's builders of the fair-share keys agree with the shard's
    assert keys.held(K.bulk) == K.held and keys.affinity_wake(K.requests) == K.affinity_wake
    assert outbox(K) == K.outbox and K.at(2).outbox == "sluice:{m:m:2}:outbox"
    # _lib.lua's batch_outbox: a batch's outbox, from its lock
    assert batch_outbox("batch_1") == BATCH_LOCK[: -len(lua["batch_lock"])] + lua["outbox"]


def test_every_model_key_suffix_is_in_the_protocol_doc() -> None:
    doc = DOC.read_text()
    missing = [s.value for s in Suffix if s is not Suffix.BATCH_LOCK and f"`<tag>{s.value}" not in doc]
    assert not missing, f"docs/protocol.md's Keys table lacks {missing}"
