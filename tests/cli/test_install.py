"""The install prints no setuptools warnings of Sluice's making (issue 30, defect 7: a
`project.license` table is deprecated)."""

from __future__ import annotations

import warnings
from pathlib import Path

from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_is_read_without_deprecation_warnings() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    ours = [str(w.message).splitlines()[0] for w in caught if "pkg_resources" not in str(w.message)]
    assert ours == []
    assert dist.metadata.license_expression == "Apache-2.0"
