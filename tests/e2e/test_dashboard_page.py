"""The dashboard page in a real browser: headless Chromium against a local stack (Redis, a
null-engine worker, an api) under a steady load that outpaces the worker, so requests queue.
The page's script must have fetched /v1/dashboard and filled in the model, its queue depth and
its worker. SLUICE_UPDATE_SCREENSHOT=1 also copies the screenshot to docs/dashboard.png.

A null-engine stack of its own, as the other null-stack modules: not in the "engine" group.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import re
import shutil
import struct
import time
import zlib
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import null_stack

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
WORKER = f"{MODEL}-w0"  # LocalStack's name for the first worker
# Two at a time, half a second each: about 4 requests/s served, 10/s submitted.
MODELS = f"models:\n  - name: {MODEL}\n    continuous_batching_config: {{max_concurrent_batch_size: 2}}\n"
SCREENSHOT = os.environ.get("SLUICE_UPDATE_SCREENSHOT") == "1"
# Load before the page is opened; for the picture in docs/operations.md, minutes of it, so the trends have points.
WARM_UP_S = 190.0 if SCREENSHOT else 6.0
BURST_S = 8.0  # the last seconds before the page opens, and while it is open: 10/s, a queue to see


def pace(elapsed: float) -> float:
    """Seconds to the next request: a load rising and falling around what the worker serves,
    then a burst."""
    if elapsed > WARM_UP_S - BURST_S:
        return 0.1
    return 1 / (3.5 + 3 * math.sin(elapsed / 25))


async def steady_load(url: str, stop: asyncio.Event) -> int:
    """Requests until `stop`, paced by `pace`; every fourth in the bulk lane. Returns how many."""
    sent, t0 = 0, time.monotonic()
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while not stop.is_set():
            body = {"model": MODEL, "prompt": f"request {sent}", "max_tokens": 15 + (sent * 7) % 20,
                    **({"priority": 1} if sent % 4 == 3 else {})}
            r = await client.post("/v1/requests", json=body)
            assert r.status_code == 202, r.text
            sent += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), pace(time.monotonic() - t0))
    return sent


async def chromium(browser: str, tmp: Path, url: str, *args: str) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        browser, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
        f"--user-data-dir={tmp / 'profile'}", "--window-size=1280,900", "--virtual-time-budget=6000", *args, url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode(errors="replace")[-2000:]
    return out


def png_size_and_colours(data: bytes) -> tuple[int, int, int]:
    """(width, height, distinct byte values of the pixel data) of a PNG; fails if it is not one."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, width, height, idat = 8, 0, 0, b""
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        chunk = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height = struct.unpack(">II", chunk[:8])
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    return width, height, len(set(zlib.decompress(idat)))


async def test_the_page_shows_live_data_in_a_browser(tmp_path: Path) -> None:
    browser = shutil.which("chromium")
    if browser is None:
        pytest.skip("chromium is not installed (scripts/test-deps.sh installs it): the page is not rendered")
    with null_stack(tmp_path / "stack", MODELS, MODEL, SLUICE_NULL_TOKEN_DELAY_S="0.02") as stack:
        stop = asyncio.Event()
        load = asyncio.create_task(steady_load(stack.url, stop))
        try:
            await asyncio.sleep(WARM_UP_S)  # completed requests in the last minute, and a queue
            shot = tmp_path / "dashboard.png"
            await chromium(browser, tmp_path, f"{stack.url}/dashboard", f"--screenshot={shot}")
            dom = (await chromium(browser, tmp_path, f"{stack.url}/dashboard", "--dump-dom")).decode()
        finally:
            stop.set()
            sent = await load
    assert sent > 30

    # The script ran: the model, its worker and its queue depths come only from /v1/dashboard.
    assert f'data-model="{MODEL}"' in dom and f">{MODEL}<" in dom, dom[-3000:]
    assert f">{WORKER}<" in dom
    depths = [int(d.replace(",", "")) for d in re.findall(r'<span class="depth">([\d,]+)</span>', dom)]
    assert len(depths) == 2 and depths[0] > 0, depths  # interactive, bulk: the load outpaces the worker
    assert re.search(r'<span id="status" class="status">updated ', dom)  # not an error, nor asking for a key
    assert re.search(r'<section id="auth" hidden', dom)

    data = shot.read_bytes()
    width, height, colours = png_size_and_colours(data)
    assert (width, height) == (1280, 900) and len(data) > 20_000 and colours > 50
    if SCREENSHOT:
        (ROOT / "docs").mkdir(exist_ok=True)
        shutil.copyfile(shot, ROOT / "docs" / "dashboard.png")
