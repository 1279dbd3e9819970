"""The Celery bulk-job runner (`sluice jobs`): an OpenAI batch's lines become bulk requests, their
results its output"""
