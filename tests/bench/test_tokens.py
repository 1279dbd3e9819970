"""`sluice bench tokens` on a real local stack (null engine), briefly: every token of every
request it counts came over SSE, and its per-token figures are computed from real work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_every_streamed_token_is_counted(tmp_path: Path) -> None:
    out = tmp_path / "tokens.json"
    run = subprocess.run([sys.executable, "-m", "sluice.cli", "bench", "tokens", "--streams", "3", "--seconds", "2",
                          "--max-tokens", "40", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    f = json.loads(out.read_text())
    assert f["requests"] >= 3 and f["tokens"] == 40 * f["requests"]  # concurrent clients lose no count
    assert 0 < f["tokens_in_window"] <= f["tokens"] and f["submit_to_first_token_ms_p50"] > 0
    assert f["worker_cpu_ms_per_1000_tokens"] > 0 and f["api_cpu_ms_per_1000_tokens"] > 0
    assert f["reply_script_calls_per_s"] > 0 and f["tokens_per_reply_call"] >= 1
