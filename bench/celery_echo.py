"""The Celery baseline of `sluice bench queue`: an echo task on the same Redis (broker and
results), started as `celery -A sluice.bench.celery_echo worker`. Benchmark-only."""

from __future__ import annotations

import os

from celery import Celery

app = Celery("sluice-echo", broker=os.environ.get("SLUICE_REDIS_URL", "redis://127.0.0.1:6379/0"),
             backend=os.environ.get("SLUICE_REDIS_URL", "redis://127.0.0.1:6379/0"))
app.conf.update(task_default_queue="sluice-echo", worker_prefetch_multiplier=8, result_expires=600,
                broker_connection_retry_on_startup=True)


@app.task(name="sluice.echo")
def echo(prompt: str, max_tokens: int) -> dict:
    """What the null engine answers: max_tokens tokens at once."""
    return {"text": "".join(f" t{i}" for i in range(max_tokens)), "num_output_tokens": max_tokens}
