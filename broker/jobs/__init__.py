"""Bulk jobs (OpenAI's Batch API) in Redis: the job store, files and each tenant's files."""
