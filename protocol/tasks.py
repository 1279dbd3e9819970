"""The Celery task that runs an OpenAI batch (a job), and its queue: the api sends it by name,
the jobs worker (workers/jobs/app.py) defines it."""

JOB_TASK = "sluice.run_batch"
JOB_QUEUE = "sluice-jobs"
