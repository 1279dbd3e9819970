"""Run by test_sampling_knobs.py in a process of its own (`python -m tests.workers.added_knob
REDIS_URL DIR`): adds one vLLM sampling knob to the one declaration of the sampling extras
(SamplingExtras in protocol/messages.py, its source patched in this process before anything else
of Sluice's is imported; no other file changes), then sends every extra, the new one among them,
through each surface to a worker whose engine records what it was handed. Prints one JSON object:
per surface, the SamplingParams keywords the vLLM engine builds from that request."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

KNOB = "include_stop_str_in_output"  # a SamplingParams keyword Sluice does not otherwise take
DECLARATION = "    ignore_eos: bool = False\n"  # the line of SamplingExtras the knob is added after
# A value other than the default for every extra, the added one included.
VALUES: dict[str, Any] = {"presence_penalty": 0.5, "frequency_penalty": 0.25, "top_k": 5, "min_p": 0.1,
                          "repetition_penalty": 1.2, "min_tokens": 1, "ignore_eos": True, "stop_token_ids": [7],
                          KNOB: True}


def add_knob() -> None:
    """protocol/messages.py as it would read with the knob declared, loaded in its place."""
    spec = importlib.util.find_spec("sluice.protocol.messages")
    assert spec is not None and spec.origin is not None and spec.loader is not None
    source = Path(spec.origin).read_text()
    assert source.count(DECLARATION) == 1, "SamplingExtras no longer declares ignore_eos this way"
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    exec(compile(source.replace(DECLARATION, DECLARATION + f"    {KNOB}: bool = False\n"), spec.origin, "exec"),
         module.__dict__)


async def main(redis_url: str, folder: Path, jobs_broker_url: str | None = None) -> dict[str, dict[str, Any]]:
    import httpx

    from sluice.api.app import create_app
    from sluice.broker.plumbing.connection import connect
    from sluice.config.model import load_models
    from sluice.config.settings import Settings
    from sluice.protocol.ids import new_request_id
    from sluice.protocol.messages import RequestMessage
    from sluice.workers.engines.base import GenerationRequest
    from sluice.workers.engines.null import NullEngine
    from sluice.workers.engines.vllm import sampling_keywords
    from sluice.workers.jobs.lines import Line, parse_line
    from sluice.workers.worker import Worker
    from tests.broker.helpers import MODEL

    recorded: list[GenerationRequest] = []

    class Recording(NullEngine):
        def generate(self, request: GenerationRequest):  # type: ignore[no-untyped-def]
            recorded.append(request)
            return super().generate(request)

    (folder / "models.yaml").write_text(f"models:\n  - name: {MODEL}\n")
    settings = Settings(redis_url=redis_url, jobs_broker_url=jobs_broker_url, data_dir=folder / "data",
                        models_file=folder / "models.yaml",
                        lease_timeout_s=3.0, heartbeat_interval_s=0.5, cancel_poll_s=0.05, shutdown_timeout_s=5.0)
    redis = connect(redis_url, name="sluice-knob-test")
    await redis.flushdb()
    app = create_app(settings)
    got: dict[str, dict[str, Any]] = {}
    async with app.router.lifespan_context(app):
        (model,) = load_models(settings.models_file)
        worker = Worker(settings, model, Recording(), redis, "knob-worker")
        running = asyncio.create_task(worker.run())
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as api:
            calls = {
                "native": ("/v1/requests", {"prompt": "p", "max_tokens": 2}),
                "completions": ("/v1/completions", {"model": MODEL, "prompt": "p", "max_tokens": 2}),
                "chat": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "p"}]}),
                "responses": ("/v1/responses", {"model": MODEL, "input": "p", "max_output_tokens": 2}),
            }
            for surface, (path, body) in calls.items():
                r = await api.post(path, json={**body, **VALUES}, headers={"Prefer": "wait=30"})
                assert r.status_code == 200, (surface, r.status_code, r.text)
                got[surface] = sampling_keywords(recorded[-1])
        # A batch's line, as the jobs worker parses and queues it (bulk lane).
        line = parse_line(0, json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/completions",
                                         "body": {"model": MODEL, "prompt": "p", "max_tokens": 2, **VALUES}}),
                          "/v1/completions")
        assert isinstance(line, Line), line
        now = time.time()
        await app.state.sluice.admission.submit(RequestMessage(
            id=new_request_id(0), model=MODEL, rows=[line.row], sampling=line.sampling, enqueued_at=now,
            deadline=now + 30, priority=1, lane="bulk"), max_queued=100)
        deadline = time.monotonic() + 30
        while len(recorded) < len(calls) + 1:
            assert time.monotonic() < deadline, "the batch line never reached the engine"
            await asyncio.sleep(0.01)
        got["batch line"] = sampling_keywords(recorded[-1])
        worker.stopping.set()
        await asyncio.wait_for(running, 30)
    await redis.aclose()
    return got


if __name__ == "__main__":
    add_knob()
    print(json.dumps(asyncio.run(main(sys.argv[1], Path(sys.argv[2]), *sys.argv[3:]))))
