"""The `sluice` command."""
