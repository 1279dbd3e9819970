"""`sluice --help` and every command's help read like argparse's or clap's (vLLM's, uv's): a flag
shows no `<bool>`, a flag with a SLUICE_* variable has its --no- form, each paragraph is wrapped
to the terminal and never broken by a hard newline, and nothing is printed on stderr; `sluice
--help` prints no warning (issue 30, defects 8 and 10)."""

from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from sluice.cli.main import app

SECTION = re.compile(r"^[A-Z][A-Za-z ]*:$")  # "Options:", "Arguments:", "Commands:"


def command_paths(command=None, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    command = command or typer.main.get_command(app)
    found = [path]
    for name, sub in getattr(command, "commands", {}).items():
        found += command_paths(sub, (*path, name))
    return found


def hard_breaks(text: str) -> list[str]:
    """Lines that end a line of a paragraph early: the next line continues the paragraph, and its
    first word would have fitted on this one. The width used is the longest line printed, less
    the 2 columns click keeps free beside an option list, so a line that wrapping filled is never
    taken for one broken by hand."""
    lines = text.splitlines()
    width = max(map(len, lines), default=0) - 2
    found = []
    in_section = in_usage = False
    for before, line in zip(lines, lines[1:]):
        if not before.strip():
            in_usage = False
        if before.startswith("Usage:"):
            in_usage = True
        if SECTION.match(before):
            in_section = True
        if in_usage or not line.strip() or not before.strip() or SECTION.match(line):
            continue
        indent = len(line) - len(line.lstrip())
        if in_section and indent <= 2:
            continue  # a new option, argument or command
        # `line` continues the text that starts at its column on `before`: `before` is indented
        # to that column too, or its text there follows a gap (an option list's second column).
        continues = (len(before) - len(before.lstrip()) == indent
                     or (before[indent - 2:indent] == "  " and before[indent:indent + 1].strip()))
        if continues and len(before.rstrip()) + 1 + len(line.split()[0]) <= width:
            found.append(f"{before.rstrip()!r} / {line.strip()!r}")
    return found


def test_the_check_finds_a_paragraph_broken_by_hand() -> None:
    text = ("Usage: sluice x [OPTIONS]\n\n  One sentence\n  broken by hand.\n\nOptions:\n"
            "  --flag  Help that is\n          broken by hand too, and then wraps as it should at the end of the line\n"
            "          of the terminal.\n")
    assert len(hard_breaks(text)) == 2
    wrapped = ("Usage: sluice x [OPTIONS]\n\n  One sentence that wraps where the terminal ends, as a\n"
               "  paragraph should.\n")
    assert hard_breaks(wrapped) == []


@pytest.mark.parametrize("columns", [80, 120])
def test_every_command_help_reads_cleanly(columns: int) -> None:
    runner = CliRunner()
    # Garbage that earlier tests in this process left (an unclosed connection) is collected first
    # and not while the help renders: its ResourceWarning would be recorded as the help's
    gc.collect()
    gc.disable()
    try:
        for path in command_paths():
            check_help(runner, path, columns)
    finally:
        gc.enable()


def check_help(runner: CliRunner, path: tuple[str, ...], columns: int) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": str(columns)}, prog_name="sluice")
    shown = " ".join(("sluice", *path))
    assert result.exit_code == 0, (shown, result.output)
    assert "<bool>" not in result.stdout, shown
    assert hard_breaks(result.stdout) == [], shown
    assert result.stderr == "", shown
    assert [str(w.message) for w in caught] == [], shown


def test_every_flag_with_a_variable_can_be_turned_off() -> None:
    """A flag set by its SLUICE_* variable can be turned off on the command line (--no-...)."""
    def params(command, path=()):
        for p in command.params:
            yield path, p
        for name, sub in getattr(command, "commands", {}).items():
            yield from params(sub, (*path, name))

    missing = [f"sluice {' '.join(path)} {p.opts[0]}" for path, p in params(typer.main.get_command(app))
               if getattr(p, "is_bool_flag", False) and p.envvar and not p.secondary_opts]
    assert missing == []


def test_sluice_help_prints_no_warning() -> None:
    """The installed command, every warning shown (-W default): its help and nothing on stderr."""
    sluice = Path(sys.executable).with_name("sluice")
    command = [str(sluice)] if sluice.exists() else [sys.executable, "-m", "sluice.cli"]
    env = {**os.environ, "PYTHONWARNINGS": "default", "COLUMNS": "80"}
    done = subprocess.run([*command, "--help"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Usage:" in done.stdout
    assert done.stderr == ""
