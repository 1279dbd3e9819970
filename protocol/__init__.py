"""What the api and the workers agree on: message schemas, states and their finality, ids,
OpenAI wire schemas and the name of the bulk-job task. Imports nothing of ours but config."""
