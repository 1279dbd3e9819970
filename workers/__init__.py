"""The worker processes: the engine worker (worker.py, engines/), the Celery bulk-job runner and the webhook sender."""
