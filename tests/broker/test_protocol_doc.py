"""docs/protocol.md stays true: every status field, state and stream-entry field a Lua script
writes is listed there, and finality is defined once (protocol/states.py), not again in Lua."""

from __future__ import annotations

import re
from pathlib import Path

from sluice.broker.plumbing.scripts import prelude
from sluice.protocol.messages import DeltaEvent
from sluice.protocol.states import FINAL_BATCH_STATES, FINAL_STATES, BatchState, State

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "protocol.md"
LUA = sorted((ROOT / "broker" / "lua").glob("*.lua"))


# -- the document's tables --------------------------------------------------------------------


def doc_tables() -> dict[str, set[str]]:
    """Per section heading, the backticked names in its tables' first column."""
    out: dict[str, set[str]] = {}
    heading = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif line.startswith("|") and not set(line) <= set("|-: "):
            first = line.split("|")[1]
            out.setdefault(heading, set()).update(re.findall(r"`([^`]+)`", first))
    return out


def table(heading_start: str) -> set[str]:
    found = [names for heading, names in doc_tables().items() if heading.startswith(heading_start)]
    assert found, f"docs/protocol.md has no section {heading_start!r}"
    return set().union(*found)


# -- what the scripts write -------------------------------------------------------------------


def _calls(source: str, opener: str) -> list[list[str]]:
    """The top-level arguments of each call that starts with `opener` (up to its open paren)."""
    out = []
    for m in re.finditer(re.escape(opener), source):
        depth, args, cur, i = 1, [], "", m.end()
        while depth:
            ch = source[i]
            if ch in "({":
                depth += 1
            elif ch in ")}":
                depth -= 1
            if depth == 1 and ch == ",":
                args.append(cur.strip())
                cur = ""
            elif depth:
                cur += ch
            i += 1
        args.append(cur.strip())
        out.append(args)
    return out


def _literal(arg: str) -> str | None:
    m = re.fullmatch(r"'([^']*)'", arg)
    return m.group(1) if m else None


def written_hash_fields() -> dict[str, set[str]]:
    """Per hash (the script's named local for its key), the literal field names written."""
    out: dict[str, set[str]] = {}
    for path in LUA:
        src = re.sub(r"--[^\n]*", "", path.read_text())
        for args in _calls(src, "redis.call(") + [["'HSET'", *a] for a in _calls(src, "hset_known(")]:
            command, key, rest = (_literal(args[0]) or "").upper(), args[1] if len(args) > 1 else "", args[2:]
            if command == "HSET":
                fields = rest[0::2]
            elif command in ("HINCRBY", "HSETNX"):
                fields = rest[:1]
            else:
                continue
            out.setdefault(key, set()).update(f for f in map(_literal, fields) if f is not None)
    return out


def written_states() -> dict[str, set[str]]:
    """The literal values written to a status's `state` and a batch's `status`, and the literal
    states handed to the functions that write a final."""
    out: dict[str, set[str]] = {"state": set(), "status": set()}
    for path in LUA:
        src = re.sub(r"--[^\n]*", "", path.read_text())
        for args in _calls(src, "redis.call(") + [["'HSET'", *a] for a in _calls(src, "hset_known(")]:
            if (_literal(args[0]) or "").upper() == "HSET":
                for field, value in zip(args[2::2], args[3::2]):
                    if _literal(field) in out and _literal(value) is not None:
                        out[_literal(field)].add(_literal(value))
        for at, opener in ((2, "write_final("), (1, "bare_final(")):  # their `state` argument
            out["state"].update(v for v in (_literal(a[at]) for a in _calls(src, opener) if len(a) > at) if v)
        out["state"].update(re.findall(r"\bfinish\('(\w+)'", src))
    return out


def written_stream_fields() -> dict[str, set[str]]:
    """Per stream (the script's named local for its key), the literal entry field names XADDed."""
    out: dict[str, set[str]] = {}
    for path in LUA:
        src = re.sub(r"--[^\n]*", "", path.read_text())
        for args in _calls(src, "redis.call("):
            if (_literal(args[0]) or "").upper() != "XADD":
                continue
            rest = args[args.index("'*'") + 1:]
            out.setdefault(args[1], set()).update(f for f in map(_literal, rest[0::2]) if f is not None)
    return out


# -- the checks -------------------------------------------------------------------------------


def test_every_status_field_a_script_writes_is_documented() -> None:
    fields = written_hash_fields()
    assert fields.get("status"), "the parser found no status field: it no longer reads the scripts"
    missing = fields["status"] - table("The status hash")
    assert not missing, f"status fields written but not in docs/protocol.md: {sorted(missing)}"
    assert "next:<row>" in table("The status hash")  # reply.lua's and commit.lua's token counts (unpack)


def test_every_batch_field_a_script_writes_is_documented() -> None:
    documented = table("Jobs")
    missing = {f for f in written_hash_fields().get("batch", set()) if f not in documented}
    assert not missing, f"batch fields written but not in docs/protocol.md: {sorted(missing)}"


def test_every_state_is_documented_with_its_finality() -> None:
    states = written_states()
    documented = table("Request states")
    assert states["state"] >= {"queued", "running", "failed", "cancelled", "expired"}  # the parser works
    assert not states["state"] - documented, sorted(states["state"] - documented)
    assert {s.value for s in State} <= documented
    rows = [line.split("|") for line in DOC.read_text().splitlines() if line.startswith("| `")]
    finality = {re.findall(r"`([^`]+)`", r[1])[0]: r[2].strip() for r in rows if len(r) > 3
                and re.findall(r"`([^`]+)`", r[1])[0] in {s.value for s in State}}
    assert finality == {s.value: "yes" if s in FINAL_STATES else "no" for s in State}
    batch_text = DOC.read_text()
    assert not states["status"] - {s.value for s in BatchState}
    assert all(f"`{s.value}`" in batch_text for s in BatchState)


def test_every_stream_entry_field_a_script_writes_is_documented() -> None:
    written = written_stream_fields()
    sections = {"stream": "Request entries", "reply": "Reply entries", "dlq": "Dead letters",
                "outbox": "Webhook outbox", "staged": "Request entries", "wake": "Prefix affinity's doorbell"}
    assert set(written) == set(sections), f"a script XADDs to a stream this test does not know: {set(written)}"
    for stream, heading in sections.items():
        missing = written[stream] - table(heading)
        assert not missing, f"{heading}: fields written but not in docs/protocol.md: {sorted(missing)}"
    assert set(DeltaEvent.model_fields) <= table("Reply entries")
    assert {"data"} <= table("Inference log")


def test_finality_is_defined_once_in_protocol_states() -> None:
    for path in LUA:
        src = path.read_text()
        assert not re.search(r"(FINAL_STATES|BATCH_FINAL)\s*=", src), f"{path.name} defines finality again"
        assert not re.search(r"\b(done|completed)\s*=\s*true", src), f"{path.name} lists final states"
    lua = prelude()
    assert set(re.findall(r"\['(\w+)'\] = true", lua.splitlines()[0])) == {s.value for s in FINAL_STATES}
    assert set(re.findall(r"\['(\w+)'\] = true", lua.splitlines()[1])) == {s.value for s in FINAL_BATCH_STATES}


def test_every_script_names_its_keys_and_arguments_at_the_top() -> None:
    """KEYS[n]/ARGV[n] are bound to named locals before the first line that does anything; only a
    variadic tail (read in a loop: KEYS[i], ARGV[i], ARGV[i + 1]) is indexed later."""
    for path in LUA:
        if path.name == "_lib.lua":
            continue
        body = [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("--")]
        first_action = next(i for i, line in enumerate(body) if not line.startswith("local ")
                            or "redis.call" in line)
        late = [line for line in body[first_action:] if re.search(r"\b(KEYS|ARGV)\[\d", line)]
        assert not late, f"{path.name} indexes KEYS/ARGV past its top: {late}"
