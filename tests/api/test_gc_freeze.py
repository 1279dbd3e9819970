"""The api process freezes its start-up heap (config/runtime.py): under load, full collections
walking the modules, schemas and tokenizers the start made took 20 to 255 ms each, stalling
every request on the event loop (`sluice bench fairness`, docs/performance.md). Only the api's
own process freezes: an app built in a test's process (as every api test does) leaves the
collector alone."""

from __future__ import annotations

import gc

from sluice.api.app import create_app
from sluice.config.settings import Settings
from tests.api.conftest import http_client


async def test_the_api_process_freezes_its_start_up_heap_after_its_start(settings: Settings) -> None:
    assert gc.get_freeze_count() == 0
    app = create_app(settings)
    async with app.router.lifespan_context(app):
        assert gc.get_freeze_count() == 0  # an app in someone else's process
    app = create_app(settings, freeze_gc=True)
    try:
        async with app.router.lifespan_context(app):
            assert gc.get_freeze_count() > 0  # frozen by the start, before any request
            async with http_client(app) as client:
                assert (await client.get("/healthz")).status_code == 200
    finally:
        gc.unfreeze()
