"""The worker processes: the engine worker (worker.py, engines/), the Celery job runner (jobs/), the
webhook sender."""
