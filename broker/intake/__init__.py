"""Intake, the api's side of a lane: admission (and cancels, status reads), tenants' quotas and
queued counts, open streams per tenant, queue figures, the Responses API's records."""
