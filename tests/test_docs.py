"""The docs tell the truth about the code: every `SLUICE_*` setting is documented in
docs/operations.md's settings table with its default, every `SLUICE_*` name the docs mention
exists, every relative link resolves (file and heading), and the README stays short."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from sluice.config.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("api", "batching", "bench", "broker", "cli", "config", "protocol", "workers")
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "tests" / "README.md",
        ROOT / "deploy" / "k8s" / "README.md"]
SKIP_DIRS = {".git", ".venv", "node_modules", "__pycache__", "docs", "wheelhouse", "sluice.egg-info"}
NAME = re.compile(r"SLUICE_[A-Z0-9_]*[A-Z0-9]")
UNITS = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "day": 86400, "days": 86400}


def settings_table() -> dict[str, str]:
    """docs/operations.md's `### Settings` table: variable -> its default cell."""
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("### Settings", 1)[1]
    section = re.split(r"\n#{1,3} ", section, maxsplit=1)[0]
    rows: dict[str, str] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and re.fullmatch(r"`SLUICE_[A-Z0-9_]+`", cells[0]):
            name = cells[0].strip("`")
            assert name not in rows, f"{name} has two rows in the settings table"
            rows[name] = cells[1]
    return rows


def env_names_in_code() -> set[str]:
    """Every `SLUICE_*` name the packages read from the environment: the whole of a string
    literal (os.environ.get("SLUICE_X"), envvar="SLUICE_X", env["SLUICE_X"] = ...)."""
    names = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                    names.add(node.value)
    return names


def setting_defaults(monkeypatch: pytest.MonkeyPatch) -> dict[str, object]:
    for var in ("XDG_CACHE_HOME", "XDG_DATA_HOME"):  # platformdirs' defaults, as documented
        monkeypatch.delenv(var, raising=False)
    defaults = {}
    for field, info in Settings.model_fields.items():
        defaults[f"SLUICE_{field.upper()}"] = info.default_factory() if info.default_factory else info.default
    return defaults


def matches(cell: str, default: object) -> bool:
    cell = cell.replace("`", "").strip()
    if default is None:
        return bool(cell)  # computed at run time: the cell says from what
    if isinstance(default, bool):
        return cell.split()[0] == ("on" if default else "off")
    if isinstance(default, list | tuple):
        return cell.split()[0] == "none" if not default else cell == ", ".join(map(str, default))
    if isinstance(default, Path):
        return cell == str(default).replace(str(Path.home()), "~", 1)
    if isinstance(default, int | float):
        m = re.match(r"([0-9][0-9,]*(?:\.[0-9]+)?)\s*(KiB|MiB|GiB|days?)?\b", cell)
        return bool(m) and float(m.group(1).replace(",", "")) * UNITS.get(m.group(2) or "", 1) == default
    return cell == str(default)


def test_every_setting_is_documented_with_its_default(monkeypatch: pytest.MonkeyPatch) -> None:
    table = settings_table()
    defaults = setting_defaults(monkeypatch)
    missing = sorted((set(defaults) | env_names_in_code()) - set(table))
    assert not missing, f"not in docs/operations.md's settings table: {missing}"
    wrong = {name: (table[name], defaults[name]) for name in defaults if not matches(table[name], defaults[name])}
    assert not wrong, f"documented default (cell, code) disagrees with config/settings.py: {wrong}"
    assert all(table.values()), "every row of the settings table gives a default"


def test_every_documented_name_exists() -> None:
    """A name the docs mention is read somewhere: a setting, or a name in the code, scripts,
    compose files or tests (a stale or misspelt name in the docs fails here)."""
    known = {f"SLUICE_{f.upper()}" for f in Settings.model_fields}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for name in files:
            if Path(name).suffix not in (".md", ".png", ".json", ".pyc", ".gguf", ".safetensors"):
                known |= set(NAME.findall((Path(folder) / name).read_text(errors="ignore")))
    unknown = {doc.relative_to(ROOT).as_posix(): sorted(set(NAME.findall(doc.read_text())) - known) for doc in DOCS}
    assert not {d: n for d, n in unknown.items() if n}, f"SLUICE_* names documented but read nowhere: {unknown}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_every_relative_link_resolves() -> None:
    broken = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            resolved = (doc.parent / file).resolve() if file else doc
            if not resolved.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_is_short() -> None:
    lines = len((ROOT / "README.md").read_text().splitlines())
    assert lines <= 250, f"README.md has {lines} lines: move detail into docs/"


def quick_start_tour() -> list[tuple[str, str]]:
    """The README's curl tour: (the comment above a command, the command), in order."""
    section = (ROOT / "README.md").read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    tour = [block for block in re.findall(r"```bash\n(.*?)```", section, flags=re.S) if "curl" in block][0]
    steps, comment = [], ""
    for line in tour.replace("\\\n", " ").splitlines():
        if line.startswith("#"):
            comment = line.lstrip("# ")
        elif line.strip():
            steps.append((comment, line.strip()))
    return steps


def test_the_quick_start_answers_as_the_readme_shows(tmp_path: Path) -> None:
    """Each curl command of the Quick start, run as written (against a stack on a free port,
    with a null engine for the default model), answers what its comment says."""
    import json
    import shlex
    import subprocess

    from sluice.bench.sse import parse
    from sluice.supervisor.stack import LocalStack

    steps = quick_start_tour()
    assert [c.split()[0] for c, _ in steps] == ["submit", "or", "poll,", "stream", "cancel"], steps
    with LocalStack(tmp_path, env={"SLUICE_LOG_LEVEL": "WARNING"}) as local:
        local.up(["smollm2"], engine="null", timeout_s=120)
        host = local.url.removeprefix("http://")
        rid = ""
        answers = []
        for comment, command in steps:
            argv = shlex.split(command.replace("localhost:8000", host).replace("<id>", rid))
            run = subprocess.run([*argv, "-w", "\n%{http_code}", "--max-time", "60"], capture_output=True, text=True)
            assert run.returncode == 0, (comment, command, run.returncode, run.stderr, run.stdout, answers)
            body, _, code = run.stdout.rpartition("\n")
            answers.append((comment, int(code), body))
            if not rid:
                rid = json.loads(body)["id"]

    (_, submit_code, submit), (_, wait_code, waited), (_, poll_code, polled), (_, _, events), (_, cancel_code, _) = \
        answers
    shown = re.search(r"\((\d{3}): (\{.*\})\)", steps[0][0])  # (202: {"id", "status": "queued", "model"})
    assert shown and submit_code == int(shown.group(1)), (steps[0][0], submit_code, submit)
    submitted = json.loads(submit)
    assert set(submitted) == set(re.findall(r'(?<!: )"(\w+)"', shown.group(2))), (shown.group(2), submitted)
    assert all(submitted[k] == v for k, v in re.findall(r'"(\w+)": "(\w+)"', shown.group(2))), submitted
    assert wait_code == 200 and json.loads(waited)["status"] == "done" and "output" in json.loads(waited), answers
    assert poll_code == 200 and json.loads(polled)["id"] == rid and json.loads(polled)["status"] == "done", answers
    kinds = [e.event for e in parse(events)]
    assert kinds and set(kinds[:-1]) == {"delta"} and kinds[-1] in ("done", "error"), events
    assert cancel_code == 409 and "409" in steps[4][0], answers  # final by then, as the README says
