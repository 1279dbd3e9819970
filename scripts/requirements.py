"""Print what the image installs for VARIANT (cpu or gpu), one requirement a line, from
pyproject.toml: the project's dependencies, the variant's extra and the build backend (the
image builds Sluice itself with --no-build-isolation, so that a wheelhouse is all it needs).

    python3 scripts/requirements.py cpu [pyproject.toml]

The Dockerfile installs these; scripts/images.sh makes the offline wheelhouse from them.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path


def requirements(variant: str, pyproject: Path) -> list[str]:
    data = tomllib.loads(pyproject.read_text())
    project = data["project"]
    extras = project.get("optional-dependencies", {})
    if variant not in extras:
        raise SystemExit(f"unknown variant {variant!r}: pyproject.toml's extras are {sorted(extras)}")
    return [*project["dependencies"], *extras[variant], *data["build-system"]["requires"]]


if __name__ == "__main__":
    here = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(__file__).resolve().parents[1] / "pyproject.toml"
    print("\n".join(requirements(sys.argv[1], here)))
