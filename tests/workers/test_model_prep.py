"""The default model is prepared once, also when several replicas start at once on a fresh
machine (each worker prepares it on first use: workers/model_prep.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from sluice.config.model_paths import DONE_MARKER, is_prepared, prepared_dir
from sluice.workers import model_prep


def test_replicas_starting_at_once_convert_the_model_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    converted: list[Path] = []

    def convert(target: Path) -> Path:  # the conversion, slow enough for every caller to arrive
        converted.append(target)
        time.sleep(0.3)
        tmp = target.with_name(target.name + ".tmp")
        tmp.mkdir(parents=True)  # raises if a second conversion runs beside the first
        (tmp / DONE_MARKER).write_text("x\n")
        tmp.rename(target)
        return target

    monkeypatch.setattr(model_prep, "_convert", convert)
    got: list[Path] = []
    errors: list[BaseException] = []

    def replica() -> None:
        try:
            got.append(model_prep.prepare_default_model(tmp_path))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=replica) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert got == [prepared_dir(tmp_path)] * 4
    assert converted == [prepared_dir(tmp_path)]
    assert is_prepared(tmp_path)
    # Prepared: the next call neither converts nor waits for a lock.
    assert model_prep.prepare_default_model(tmp_path) == prepared_dir(tmp_path)
    assert len(converted) == 1
