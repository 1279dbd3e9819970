"""The import rules of DESIGN.md's "Packages" table, read from every source module's syntax tree,
and the size budget of a module.

Every import counts wherever it is written (inside functions, under `if TYPE_CHECKING`): the
table is about what a package depends on, and a deferred import is still a dependency. The
source folders and their packages come from pyproject.toml, so a package added there without
a rule here fails instead of being left unchecked.
"""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOP = "sluice"
ALL = frozenset({"config", "protocol", "broker", "batching", "workers", "api", "supervisor", "bench", "cli"})

# package -> the packages of ours it may import (itself always allowed)
MAY_IMPORT: dict[str, frozenset[str]] = {
    "config": frozenset(),
    "protocol": frozenset({"config"}),
    "broker": frozenset({"config", "protocol"}),
    "batching": frozenset({"config"}),
    "workers": frozenset({"config", "protocol", "broker", "batching"}),
    "api": frozenset({"config", "protocol", "broker"}),
    "supervisor": frozenset(),
    "bench": ALL - {"cli"},
    "cli": ALL,
}
# DESIGN calls over ~400 lines a sign of two jobs in one module.
MAX_LINES = 400


@dataclass(frozen=True)
class Module:
    name: str  # e.g. sluice.workers.engines.null
    path: Path
    is_package: bool  # an __init__.py: relative imports resolve against itself

    @property
    def package(self) -> str:
        """The top-level package of ours it belongs to (`workers` for sluice.workers.engines.x)."""
        return self.name.split(".")[1]


@dataclass(frozen=True)
class Import:
    module: Module
    line: int
    target: str  # the dotted name imported, e.g. sluice.supervisor.stack

    @property
    def package(self) -> str | None:
        parts = self.target.split(".")
        return parts[1] if parts[0] == TOP and len(parts) > 1 else None

    def __str__(self) -> str:
        return f"{self.module.path.relative_to(ROOT)}:{self.line} ({self.module.name}) imports {self.target}"


def package_dirs() -> dict[str, Path]:
    """sluice.<x>[.<y>] -> its folder, as pyproject.toml maps them (the installed layout)."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    mapping: dict[str, str] = pyproject["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def source_modules() -> list[Module]:
    modules = []
    for package, folder in package_dirs().items():
        for path in sorted(folder.glob("*.py")):  # subpackages have their own entry in the mapping
            is_package = path.name == "__init__.py"
            name = package if is_package else f"{package}.{path.stem}"
            modules.append(Module(name, path, is_package))
    return modules


MODULES = source_modules()
KNOWN = {m.name for m in MODULES}


def _resolve(module: Module, level: int, name: str | None) -> str:
    """The absolute name of a relative import (`from ..broker import keys` in sluice.api.x)."""
    base = module.name.split(".")
    if not module.is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, name] if name else base)


def imports_of(module: Module) -> list[Import]:
    tree = ast.parse(module.path.read_text(), filename=str(module.path))
    found: list[Import] = []
    for node in ast.walk(tree):  # every node: imports inside functions and TYPE_CHECKING blocks too
        if isinstance(node, ast.Import):
            found.extend(Import(module, node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                # `from sluice.cli import up` imports the module sluice.cli.up: name it so.
                sub = f"{base}.{alias.name}"
                found.append(Import(module, node.lineno, sub if sub in KNOWN else base))
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            # importlib.import_module("sluice.x") / __import__("sluice.x"): a literal name is an import too
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append(Import(module, node.lineno, node.args[0].value))
    unique = dict.fromkeys(found)  # `from x import a, b` is one import of x, reported once
    return [i for i in unique if i.package is not None]


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def allowed(imp: Import) -> bool:
    own, target = imp.module.package, imp.package
    assert target is not None
    return target == own or target in MAY_IMPORT[own]


def report(title: str, offenders: list[str]) -> str:
    return f"{title} ({len(offenders)}):\n  " + "\n  ".join(offenders)


def test_every_package_has_a_rule() -> None:
    packages = {m.package for m in MODULES}
    assert packages, "no source modules found: the pyproject.toml mapping moved?"
    assert packages <= set(MAY_IMPORT), f"packages without an import rule: {sorted(packages - set(MAY_IMPORT))}"
    # the walk found every folder of the table (a renamed folder must not silently leave the check)
    assert set(MAY_IMPORT) <= packages, f"rules for packages with no modules: {sorted(set(MAY_IMPORT) - packages)}"


def test_the_checker_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The parser itself: absolute, from, relative, nested in a function, dynamic."""
    path = tmp_path / "mod.py"
    path.write_text(
        "import sluice.broker.keys\n"
        "from sluice.cli import up\n"
        "from ..workers import worker\n"
        "def f():\n"
        "    from sluice.api.app import create_app\n"
        "    import importlib\n"
        "    importlib.import_module('sluice.bench.loadgen')\n"
    )
    fake = Module("sluice.protocol.mod", path, is_package=False)
    targets = [i.target for i in imports_of(fake)]
    assert targets == ["sluice.broker.keys", "sluice.cli.up", "sluice.workers.worker", "sluice.api.app",
                       "sluice.bench.loadgen"], targets
    assert [allowed(i) for i in imports_of(fake)] == [False] * 5  # protocol may import config only


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_imports_follow_the_design_table(package: str) -> None:
    offenders = [
        f"{imp}  [{package} may import: {', '.join(sorted(MAY_IMPORT[package])) or 'nothing of ours'}]"
        for module in MODULES if module.package == package
        for imp in imports_of(module) if not allowed(imp)
    ]
    assert not offenders, report(f"imports that break the rule for {package}/", offenders)


@pytest.mark.parametrize(("importer", "imported"), [("api", "workers"), ("workers", "api")])
def test_api_and_workers_meet_only_on_redis(importer: str, imported: str) -> None:
    # Stated on its own in DESIGN ("api/ never imports workers/"): it must hold even if the table changes.
    offenders = [str(imp) for module in MODULES if module.package == importer
                 for imp in imports_of(module) if imp.package == imported]
    assert not offenders, report(f"{importer}/ imports {imported}/", offenders)


def test_no_source_module_is_over_the_line_budget() -> None:
    sizes = {m.path: len(m.path.read_text().splitlines()) for m in MODULES}
    offenders = [f"{path.relative_to(ROOT)}: {n} lines" for path, n in sorted(sizes.items(), key=lambda kv: -kv[1])
                 if n > MAX_LINES]
    assert not offenders, report(f"modules over {MAX_LINES} lines (split them by job)", offenders)


# -- broker/'s wings ---------------------------------------------------------------------------
# broker/ is split by job into wings (subpackages); `keys`, `limits`, `status`, `registry` and
# `activity` sit at its top, for every wing. A wing reaches another only through what that wing
# exports (its __init__'s __all__), and no import circle runs through broker/.
BROKER = f"{TOP}.broker"
BROKER_TOP_MAX = 8  # modules at broker/'s top, beside its wings


def wing_of(name: str) -> str | None:
    """The wing of a module of broker/ (`delivery` for sluice.broker.delivery.consumer), else None."""
    parts = name.split(".")
    if parts[:2] != [TOP, "broker"] or len(parts) < 3:
        return None
    wing = f"{BROKER}.{parts[2]}"
    return parts[2] if any(m.name == wing and m.is_package for m in MODULES) else None


def exports(wing: str) -> set[str]:
    init = next(m for m in MODULES if m.name == f"{BROKER}.{wing}" and m.is_package)
    for node in ast.parse(init.path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def cross_wing_imports(module: Module) -> list[tuple[int, str, str]]:
    """(line, wing, what) for each name `module` takes from another wing: `what` is the module
    imported from and the name (`sluice.broker.delivery:group_of`)."""
    own = wing_of(module.name)
    found = []
    for node in ast.walk(ast.parse(module.path.read_text())):
        if isinstance(node, ast.Import):
            targets = [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            targets = [(node.module or "", alias.name) for alias in node.names]
        else:
            continue
        for target, name in targets:
            wing = wing_of(target)
            if wing is not None and wing != own:
                found.append((node.lineno, wing, f"{target}:{name}"))
    return found


def test_broker_has_few_top_modules_beside_its_wings() -> None:
    top = [m.name for m in MODULES if m.name.startswith(f"{BROKER}.") and m.name.count(".") == 2
           and not m.is_package]
    assert len(top) <= BROKER_TOP_MAX, f"{len(top)} modules at broker/'s top: {sorted(top)}"


def test_a_wing_reaches_another_only_through_its_exports() -> None:
    offenders = []
    for module in MODULES:
        if not module.name.startswith(f"{BROKER}.") or module.is_package and wing_of(module.name):
            continue
        for line, wing, what in cross_wing_imports(module):
            target, name = what.split(":")
            if target != f"{BROKER}.{wing}" or name not in exports(wing):
                offenders.append(f"{module.path.relative_to(ROOT)}:{line} takes {what} "
                                 f"(broker/{wing} exports: {', '.join(sorted(exports(wing)))})")
    assert not offenders, report("imports into another wing's inside", offenders)


def test_no_import_circle_in_broker() -> None:
    """Module to module, every import counted (deferred and type-only too); importing a wing's
    package counts as importing its __init__, which imports what it exports."""
    names = {m.name for m in MODULES if m.name.startswith(BROKER)}
    graph = {m.name: {i.target for i in imports_of(m) if i.target in names and i.target != m.name}
             for m in MODULES if m.name in names}
    circles: list[str] = []
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join([*path[path.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not circles, report("import circles in broker/", circles)


MAX_LINE = 110  # DESIGN's style: lines under 110 characters in the source (ruff allows the tests 120)


def test_no_source_line_is_over_110_characters() -> None:
    offenders = [f"{m.path.relative_to(ROOT)}:{n}: {len(line)} characters"
                 for m in MODULES for n, line in enumerate(m.path.read_text().splitlines(), 1)
                 if len(line) > MAX_LINE]
    assert not offenders, report(f"source lines over {MAX_LINE} characters", offenders[:50])
