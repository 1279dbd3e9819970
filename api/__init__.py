"""The FastAPI app: Sluice's HTTP api (its own routes and OpenAI's), which meets the workers only
through Redis."""
