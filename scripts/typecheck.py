"""mypy over every source folder, as `make test` runs it (configured in pyproject.toml, [tool.mypy]).

The folders install as `sluice.<folder>` (pyproject.toml's package-dir), a layout mypy cannot
follow from the tree itself, so this builds the installed names as links in `.typecheck/`
(ignored by git) and checks the package `sluice` there, printing the tree's own paths."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINKS = ROOT / ".typecheck"


def link_tree() -> Path:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    top = LINKS / "sluice"
    top.mkdir(parents=True, exist_ok=True)
    (top / "__init__.py").touch()
    for name, folder in mapping.items():
        parts = name.split(".")
        if len(parts) != 2:  # subpackages come with their folder
            continue
        link = top / parts[1]
        if not link.is_symlink():
            link.symlink_to(ROOT / folder, target_is_directory=True)
    return LINKS


def main() -> int:
    where = link_tree()
    cache = ["--cache-dir", str(where / "cache")] if "MYPY_CACHE_DIR" not in os.environ else []
    done = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *cache,
                           "-p", "sluice", *sys.argv[1:]],
                          cwd=where, capture_output=True, text=True)
    sys.stdout.write(done.stdout.replace("sluice/", "").replace(str(where) + "/", ""))
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
