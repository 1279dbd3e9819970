"""Every Lua script is called through one typed call (broker/plumbing/scripts.py's ScriptCall),
whose fields are the script's KEYS then ARGV in the order and under the names the script binds
them to (`local stream, status = KEYS[1], KEYS[2]`), and no Python call site builds a key or
argument list of its own."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from sluice.broker.plumbing.scripts import ScriptCall

ROOT = Path(__file__).resolve().parents[2]
LUA = ROOT / "broker" / "lua"
SCRIPTS = sorted(p.stem for p in LUA.glob("*.lua") if p.stem != "_lib")
SOURCE = ("api", "broker", "workers", "bench", "cli", "supervisor")


def calls() -> dict[str, list[type[ScriptCall]]]:
    for path in sorted((ROOT / "broker").glob("*/calls.py")):
        importlib.import_module(f"sluice.broker.{path.parent.name}.calls")
    importlib.import_module("sluice.broker.registry")  # deploy.lua's call: the registry stays at broker's top
    found: dict[str, list[type[ScriptCall]]] = {}
    todo = list(ScriptCall.__subclasses__())
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        found.setdefault(cls.script, []).append(cls)
    return found


_BINDING = re.compile(r"^local\s+([\w\s,]+?)\s*=\s*(.+)$")
_INDEX = re.compile(r"\b(KEYS|ARGV)\[(\d+)\]")


def _split(expr: str) -> list[str]:
    """Top-level comma-separated parts of a Lua expression list."""
    parts, depth, cur = [], 0, ""
    for ch in expr:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    return [*parts, cur]


def bindings(script: str) -> dict[str, dict[int, str]]:
    """{"KEYS": {n: name}, "ARGV": {n: name}}: the script's top-level `local name = ...KEYS[n]...`."""
    out: dict[str, dict[int, str]] = {"KEYS": {}, "ARGV": {}}
    for line in (LUA / f"{script}.lua").read_text().splitlines():
        m = _BINDING.match(line.split("--")[0].strip())
        if not m:
            continue
        names, values = [n.strip() for n in m.group(1).split(",")], _split(m.group(2))
        for name, value in zip(names, values):
            found = _INDEX.findall(value)
            if len(found) == 1:
                table, n = found[0]
                out[table][int(n)] = name
    return out


def fixed(cls: type[ScriptCall], kinds: tuple[str, ...]) -> list[str]:
    """The fields at fixed positions of KEYS (kinds key/keys) or ARGV: those before the first
    variadic one."""
    out = []
    for name, how in cls.layout():
        if how not in kinds:
            continue
        if how in ("keys", "counted", "spread", "parts"):
            break
        out.append(name)
    return out


def test_every_script_has_one_typed_call() -> None:
    found = calls()
    missing = [s for s in SCRIPTS if s not in found]
    doubled = {s: [c.__name__ for c in cs] for s, cs in found.items() if len(cs) > 1}
    unknown = sorted(set(found) - set(SCRIPTS))
    assert not missing and not doubled and not unknown, (missing, doubled, unknown)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_typed_call_names_its_fields_as_the_script_binds_them(script: str) -> None:
    (cls,) = calls().get(script, [None])  # type: ignore[list-item]
    assert cls is not None, f"no ScriptCall for lua/{script}.lua"
    bound = bindings(script)
    for table, kinds in (("KEYS", ("key", "keys")), ("ARGV", ("arg", "counted", "spread"))):
        names = fixed(cls, kinds)
        variadic = any(how in kinds for _, how in cls.layout()) and len(names) < sum(
            1 for _, how in cls.layout() if how in kinds)
        for n, name in sorted(bound[table].items()):
            if n > len(names):
                assert variadic, f"{cls.__name__}: lua/{script}.lua binds {table}[{n}] ({name}), past its fields"
                continue
            assert names[n - 1] == name, (f"{cls.__name__}: field {n} of {table} is {names[n - 1]!r}, "
                                          f"lua/{script}.lua binds {table}[{n}] to {name!r}")


def test_the_binding_reader_reads_a_scripts_locals() -> None:
    got = bindings("start")
    assert got["KEYS"][1] == "stream" and got["ARGV"][6] == "attempt" and got["ARGV"][11] == "quarantined"


def test_no_call_site_builds_a_key_or_argument_list() -> None:
    """Script calls pass a ScriptCall: no call with `keys=[...]` (or `args=[...]` beside a
    `keys=`), EVALSHA or script loading outside the loader."""
    loader = ROOT / "broker" / "plumbing" / "scripts.py"
    offenders = []
    for folder in SOURCE:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == loader:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                named = {k.arg: k.value for k in node.keywords} if isinstance(node, ast.Call) else {}
                if "keys" in named and any(isinstance(v, (ast.List, ast.Tuple)) for v in named.values()):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} keys=/args= lists")
                elif isinstance(node, ast.Attribute) and node.attr in ("evalsha", "register_script",
                                                                       "script_load", "eval"):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} .{node.attr}")
    assert not offenders, "\n".join(offenders)
